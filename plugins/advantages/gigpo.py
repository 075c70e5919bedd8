"""GiGPO: group-in-group advantages for multi-turn agents — an episode-level and a step-level relative advantage::

    A_E,i = (R_traj(i) − mean_g(R_traj)) / F_g          R_traj(i) = Σ_{steps j of i's trajectory} r_j
    A_S,i = (G_i − mean_s(G)) / F_s                      G_i = Σ_{k ≥ t_i} γ^{k − t_i} r_k within the trajectory
    A_i   = A_E,i + ω · A_S,i

One row of the batch is one **step** (one model turn) of an episode:

* ``reward`` ``[B]`` (or ``[B, T]``, summed over the actions) — the step's immediate reward r_t (an outcome-only
  task puts the episode's reward on its last step);
* ``trajectory_id`` ``[B]`` — the episode the step belongs to; its rows in **batch order are its time order**;
* ``group_id`` ``[B]`` — the prompt group (the episodes started from the same task); every step of an episode must
  carry the episode's group;
* ``anchor_id`` ``[B]`` — the environment state the step starts from: rows of one prompt group with equal
  ``anchor_id`` saw the same state and form the step-level group ``s`` (GiGPO's anchor states).

``R_traj`` is the episode's undiscounted return (the sum of its step rewards) repeated on each of its steps; ``G``
the discounted return-to-go from the step (``gamma``). The episode statistics ``mean_g``/``std_g`` are taken over
the group's **rows** (steps, verl-agent's default ``compute_mean_std_cross_steps``: an episode weighs by its number
of steps) or, with ``episode_stats: trajectories``, over its episodes once each (the paper's Eq. 3). ``scale: none``
only centres (``F = 1``, verl-agent's configured default ``mode: mean_norm``); ``scale: std`` divides by ``std + ε``
(sample std, ``mean_std_norm``). ``gamma`` defaults to verl-agent's examples' 0.95. Conventions kept from verl-agent: an episode group of one row is divided by ``1 + ε`` after
centring on 0 (``mean 0, std 1``); a step group of one row gets 0 (its mean is its own value). A group of two or
more rows of exactly equal values gets exactly 0 at that level. Advantages are ``[B]`` (verl-agent broadcasts them
over the response), at least float32, and carry no gradient.

Paper: Feng et al., 2025, *Group-in-Group Policy Optimization for LLM Agent Training*, arXiv:2505.10978.

Reference: verl-agent ``compute_gigpo_outcome_advantage``, ``episode_norm_reward``, ``step_norm_reward`` and
``compute_step_discounted_returns`` (``gigpo/core_gigpo.py`` of langfengQ/verl-agent, as of commit 29e3e8b, read in
the mirror johnhaofu/verl-agent 5d7e4b83; defaults from ``verl/trainer/config/ppo_trainer.yaml``
``algorithm.gigpo``); the anchor states are ``build_step_group``'s exact-match clusters, given here as ids.
verl-agent is on no package index, so the tests' oracle is that code transcribed loop by loop, in float64.
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from pydantic import Field

import lossplug
from lossplug.contracts import LossplugError
from lossplug.contracts.errors import describe_positions
from lossplug.ops import Groups

from ._verl_statistics import at_least_float32
from .group_relative import sequence_scores

Tensor = torch.Tensor


class GiGPOParams(lossplug.Params):
    step_weight: float = Field(
        1.0, ge=0, allow_inf_nan=False, description="ω: weight of the step-level advantage (step_advantage_w)"
    )
    gamma: float = Field(
        0.95, ge=0, le=1, description="discount of the step return-to-go (verl-agent: algorithm.gamma)"
    )
    scale: Literal["std", "none"] = Field(
        "none",
        description="none: centre only (verl-agent's default mode, mean_norm); std: divide the centred values by "
        "std + eps (mean_std_norm)",
    )
    eps: float = Field(1e-6, ge=0, description="epsilon added to each group's std (verl-agent: 1e-6)")
    episode_stats: Literal["steps", "trajectories"] = Field(
        "steps",
        description="episode-level mean/std over the group's rows (verl-agent's default) or over its episodes once "
        "each (the paper's Eq. 3)",
    )


def _time_order(trajectories: Groups) -> tuple[Tensor, Tensor]:
    """The step index of every row within its trajectory (batch order) ``[B]``, and the rows sorted by (trajectory,
    step) ``[B]``."""
    inverse = trajectories.inverse
    order = torch.sort(inverse, stable=True).indices  # rows of one trajectory together, in batch order
    starts = torch.cumsum(trajectories.counts, 0) - trajectories.counts
    step = torch.empty_like(inverse)
    step[order] = torch.arange(inverse.numel(), device=inverse.device) - starts[inverse[order]]
    return step, order


def discounted_returns(reward: Tensor, trajectories: Groups, gamma: float) -> Tensor:
    """``[B]`` ``G_t = r_t + γ · G_{t+1}`` within each trajectory, steps in batch order (one pass per step index)."""
    step, _ = _time_order(trajectories)
    horizon = int(trajectories.counts.max())
    # [trajectories, horizon] table of rewards, 0 past each trajectory's end
    table = torch.zeros(trajectories.num_groups, horizon, dtype=reward.dtype, device=reward.device)
    table[trajectories.inverse, step] = reward
    to_go = torch.zeros_like(table)
    running = torch.zeros(trajectories.num_groups, dtype=reward.dtype, device=reward.device)
    for t in range(horizon - 1, -1, -1):  # verl-agent's backward recursion, same operations
        running = table[:, t] + gamma * running
        to_go[:, t] = running
    return to_go[trajectories.inverse, step]


def _normalised(x: Tensor, groups: Groups, p: GiGPOParams, *, singleton_mean_zero: bool, weight: Tensor) -> Tensor:
    """``(x − mean) / (std + ε)`` per group (or centred only), statistics weighted by ``weight`` (0/1 per row)."""
    w = weight.to(x.dtype)
    n = groups.sum(w)
    mean = groups.sum(x * w) / n
    centered_rows = x - mean[groups.inverse]
    dof = (n - 1).clamp(min=1)
    std = (groups.sum(centered_rows * centered_rows * w) / dof).sqrt()
    single = n == 1
    if singleton_mean_zero:  # verl-agent's episode level: mean 0, std 1
        mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    centered = x - mean[groups.inverse]
    out = centered / (std[groups.inverse] + p.eps) if p.scale == "std" else centered
    constant = groups.constant(x) & (n > 1)  # two or more counted rows (steps or episodes), all equal
    return torch.where(constant[groups.inverse], torch.zeros_like(out), out)


def _check_trajectories_in_one_group(group_id: Tensor, trajectories: Groups) -> None:
    first = torch.zeros(trajectories.num_groups, dtype=group_id.dtype, device=group_id.device)
    first[trajectories.inverse] = group_id  # any row's group; a trajectory in two groups disagrees somewhere
    mixed = first[trajectories.inverse] != group_id
    if bool(mixed.any()):
        raise LossplugError(
            f"gigpo: trajectory_id rule broken: every step of a trajectory must carry the same group_id; rows "
            f"{describe_positions(mixed, noun='rows')} belong to a trajectory whose other steps have another group_id"
        )


@lossplug.advantage("gigpo", params=GiGPOParams, requires=("reward", "group_id", "trajectory_id", "anchor_id"))
def gigpo(batch: lossplug.PolicyBatch, p: GiGPOParams) -> Tensor:
    """GiGPO: A = norm_group(R_trajectory) + ω · norm_anchor(G_step), G the discounted step return-to-go.

    Paper: Feng et al., 2025, *Group-in-Group Policy Optimization for LLM Agent Training*, arXiv:2505.10978.

    Reference: verl-agent ``compute_gigpo_outcome_advantage`` (``gigpo/core_gigpo.py``).
    """
    reward = at_least_float32(sequence_scores(batch))
    group_id = cast(Tensor, batch.group_id)  # required
    trajectories = Groups.from_ids(cast(Tensor, batch.trajectory_id))  # required
    _check_trajectories_in_one_group(group_id, trajectories)
    episode_return = trajectories.sum(reward)[trajectories.inverse]
    groups = Groups.from_ids(group_id)
    if p.episode_stats == "steps":
        counted = torch.ones_like(reward, dtype=torch.bool)
    else:  # each trajectory once: its first row in batch order
        step, _ = _time_order(trajectories)
        counted = step == 0
    episode = _normalised(episode_return, groups, p, singleton_mean_zero=True, weight=counted)
    # step-level groups: (prompt group, anchor state) pairs
    anchor = torch.stack([group_id, cast(Tensor, batch.anchor_id)], -1)  # required
    anchors = Groups.from_ids(torch.unique(anchor, dim=0, return_inverse=True)[1])
    step_return = discounted_returns(reward, trajectories, p.gamma)
    step = _normalised(step_return, anchors, p, singleton_mean_zero=False, weight=torch.ones_like(counted))
    return episode + p.step_weight * step
