"""Step REINFORCE (ROLL's ``step_reinforce``): each step's discounted return-to-go, normalised as ROLL normalises
rewards, is the advantage of every token of the step::

    G_i = Σ_{k ≥ t_i} γ^{k − t_i} r_k          within the trajectory of row i (t_i its step index)
    A_i = norm(G)_i                           ROLL's agentic_reward_norm (mean / std over the batch or the group)

One row of the batch is one **step** (one model turn) of an episode, as in ``gigpo``:

* ``reward`` ``[B]`` (or ``[B, T]``, summed over the actions) — the step's immediate reward (ROLL's ``step_scores``;
  an outcome-only task puts the episode's reward on its last step);
* ``trajectory_id`` ``[B]`` — the episode (ROLL's ``traj_id``); its rows in **batch order are its time order**
  (ROLL sorts them by their ``step`` field);
* ``group_id`` ``[B]`` — the prompt group (ROLL's ``traj_group_id``), read with ``grouping: group`` only.

``norm`` is ROLL's ``agentic_reward_norm`` (:func:`._roll_statistics.roll_reward_norm`): ``mean`` subtracts the
batch's mean (``batch``), the grouping's (``group``) or nothing (``none``); ``std`` divides by torch's sample std
+ 1e-6 of the batch or the grouping, and gives 0 where the grouping has one row or a spread of at most 1e-6
(ROLL's threshold, not exact equality); ``grouping`` is the batch or the prompt group. ROLL derives ``mean``/``std``
from its deprecated ``method`` where they are unset: ``identity`` → none/none (ROLL's default, kept here),
``mean`` → group/none, ``mean_std`` → group/group (with ``grouping: batch``: batch instead of group). ``gamma``
defaults to ROLL's ``step_reward_gamma`` 0.95 (its examples set 1.0). ``whiten`` is ROLL's ``whiten_advantages``
(``masked_whiten`` over the batch's action tokens; skipped when there is at most one). Unlike ``gigpo`` there is no
episode-level term and no anchor-state grouping: the step's return is compared with the returns of the batch or of
its prompt group. Advantages are ``[B]`` (ROLL broadcasts them over the step's response), at least float32, and
carry no gradient.

ROLL places the normalised return on the step's last token and takes the token-level reward-to-go with its
``gamma`` (``compute_reinforce_return``): with ROLL's default ``gamma: 1`` (every example) every token of the step
gets the same value, which is what this plugin gives; a token-level ``gamma < 1`` has no counterpart. ROLL's
``reward_clip`` and ``advantage_clip`` (clamps, off by default) have none either.

Paper: Williams, 1992, *Simple Statistical Gradient-Following Algorithms for Connectionist Reinforcement Learning*
(REINFORCE); the step-level returns are ROLL's (Wang et al., 2025, *Reinforcement Learning Optimization for
Large-Scale Learning: An Efficient and User-Friendly Scaling Library*, arXiv:2506.06122).

Reference: ROLL (alibaba/ROLL, commit 8eb27cc2dc34c4d1310b169d9b86d339004d811a, 2026-08-19)
``roll/pipeline/agentic/utils.py`` ``compute_discounted_returns`` (the returns, γ = ``step_reward_gamma``),
``compute_response_level_rewards`` (its ``step_reinforce`` branch), ``agentic_reward_norm`` and
``agentic_compute_advantage``; defaults from ``roll/pipeline/agentic/agentic_config.py`` (``AgenticConfig``,
``RewardNormalizationConfig``). ROLL is on no package index (PyPI's ``roll`` is an unrelated web framework), so the
tests' oracle is that code transcribed loop by loop, in float64.
"""

from __future__ import annotations

from typing import cast

import torch
from pydantic import Field

import lossplug
from lossplug.contracts import LossplugError
from lossplug.contracts.errors import describe_positions
from lossplug.ops import Groups

from ._roll_statistics import RollNormParams, roll_group_id, roll_reward_norm, roll_whiten
from ._verl_statistics import at_least_float32
from .gigpo import discounted_returns
from .group_relative import sequence_scores

Tensor = torch.Tensor


class StepReinforceParams(RollNormParams):
    gamma: float = Field(
        0.95, ge=0, le=1, description="discount of the step return-to-go (ROLL: step_reward_gamma, default 0.95)"
    )


def check_one_group_per_trajectory(group_id: Tensor, trajectories: Groups) -> None:
    """Every step of a trajectory carries the same ``group_id`` (ROLL groups an episode's steps by its
    ``traj_group_id``)."""
    first = torch.zeros(trajectories.num_groups, dtype=group_id.dtype, device=group_id.device)
    first[trajectories.inverse] = group_id  # any row's group: a trajectory in two groups disagrees somewhere
    mixed = first[trajectories.inverse] != group_id
    if bool(mixed.any()):
        raise LossplugError(
            f"step_reinforce: trajectory_id rule broken: every step of a trajectory must carry the same group_id; "
            f"{describe_positions(mixed)} belong to a trajectory whose other steps have another "
            "group_id"
        )


def _requires(p: StepReinforceParams) -> tuple[str, ...]:
    return ("reward", "trajectory_id", "group_id") if p.grouping == "group" else ("reward", "trajectory_id")


@lossplug.advantage("step_reinforce", params=StepReinforceParams, requires=_requires)
def step_reinforce(batch: lossplug.PolicyBatch, p: StepReinforceParams) -> Tensor:
    """Step REINFORCE: A = norm(G), G each step's discounted return-to-go in its trajectory (ROLL).

    Paper: Williams, 1992 (REINFORCE); ROLL, arXiv:2506.06122.

    Reference: ROLL ``compute_discounted_returns`` and ``agentic_reward_norm`` (``roll/pipeline/agentic/utils.py``).
    """
    reward = at_least_float32(sequence_scores(batch))
    trajectories = Groups.from_ids(cast(Tensor, batch.trajectory_id))  # required
    group_id = roll_group_id(batch, p)
    if group_id is not None:
        check_one_group_per_trajectory(group_id, trajectories)
    returns = discounted_returns(reward, trajectories, p.gamma)
    adv = roll_reward_norm(returns, group_id, p.grouping, p.mean, p.std)
    if not p.whiten:
        return adv
    mask = batch.action_mask
    return roll_whiten(adv.unsqueeze(-1).expand(mask.shape), mask)
