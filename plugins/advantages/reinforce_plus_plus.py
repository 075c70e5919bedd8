"""REINFORCE++ and REINFORCE++-baseline (verl's ``reinforce_plus_plus`` and ``reinforce_plus_plus_baseline``).

REINFORCE++ (token level, no critic, no group)::

    G_t = r_t + γ · G_{t+1}          over the response's action tokens (G = 0 after its last one)
    A_t = whiten(G)_t                whitened over every action token of the batch (verl's masked_whiten)

The discount advances once per **action token**: observation/tool tokens inside a multi-turn response
(``action_mask`` False) are skipped, their return carried through unchanged (verl 0.9.1 does the same). Rewards are
read on action positions only: a ``[B]`` score sits on the last action token, a ``[B, T]`` token reward is read
where ``action_mask`` is True. ``returns`` are the un-whitened ``G`` (verl's second output).

REINFORCE++-baseline (outcome level)::

    A_i = whiten(R_i − mean_g(R))    the centred score of each response, broadcast over its action tokens and
                                      whitened over every action token of the batch; a group of one keeps R_i
                                      (verl: its mean is 0); no γ

Both return advantages that carry no gradient; REINFORCE++-baseline's are ``[B]`` (one value per response).

``whiten`` (both; default ``true``, verl's): ``center`` subtracts the same token-weighted batch mean and does not
divide — OpenRLHF 0.11.2's ``--algo.advantage.no_std_norm`` for its ``reinforce`` (REINFORCE++) and
``reinforce_baseline`` estimators (``openrlhf/trainer/ppo_utils/experience_maker.py``,
``compute_advantages_and_returns``: ``A − Σ A·mask / Σ mask`` over every action token of the rollout batch, the mean
in float32 there, in the advantages' dtype here); ``false`` leaves ``G`` (or ``R_i − mean_g(R)``) as is. As
``gae``'s, the statistics are over the batch given (the trainers' seams hold the whole rollout batch; nothing is
all-reduced).

Paper: Hu, 2025, *REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models*,
arXiv:2501.03262.

Reference: verl 0.9.1 ``compute_reinforce_plus_plus_outcome_advantage`` and
``compute_reinforce_plus_plus_baseline_outcome_advantage`` (``verl/trainer/ppo/core_algos.py``).
"""

from __future__ import annotations

from typing import cast

import torch
from pydantic import Field

import lossplug
from lossplug.ops import Groups

from ._verl_statistics import (
    at_least_float32,
    center_rows,
    constant_group,
    group_mean_or_zero,
    masked_center,
    masked_whiten,
    whiten_rows,
)
from .gae import Whiten, reverse_linear_scan
from .group_relative import sequence_scores

Tensor = torch.Tensor


def discounted_returns(batch: lossplug.PolicyBatch, gamma: float) -> Tensor:
    """``G_t = r_t + γ·G_{t+1}`` over each row's action tokens, ``[B, T]``, zero off them (no Python loop over t).

    The action tokens of all rows are packed into one vector (row-major) and the recurrence is solved by
    :func:`~lossplug.plugins.advantages.gae.reverse_linear_scan` with coefficient 0 after each row's last action.
    """
    mask = batch.action_mask
    reward = cast(Tensor, batch.reward)  # required
    dtype = torch.promote_types(reward.dtype, torch.float32)  # at least float32, as gae: bf16 sums drift
    lengths = mask.sum(-1)
    ends = torch.cumsum(lengths, 0) - 1  # packed index of each row's last action token
    nonempty = lengths > 0  # all rows under the contract; validate="off" may pass empty rows
    if not bool(nonempty.all()):
        ends = ends[nonempty]
    n = int(lengths.sum())
    if reward.ndim == 1:
        packed = torch.zeros(n, dtype=dtype, device=mask.device)
        packed[ends] = reward.to(dtype) if ends.shape[0] == reward.shape[0] else reward.to(dtype)[nonempty]
    else:
        packed = torch.masked_select(reward, mask).to(dtype)
    coef = torch.full((n,), gamma, dtype=dtype, device=mask.device)
    coef[ends] = 0
    returns = reverse_linear_scan(packed, coef)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_scatter_(mask, returns)


WHITEN_DESCRIPTION = (
    "true: whiten over all action tokens (verl); center: subtract their mean only (OpenRLHF's no_std_norm); "
    "false: neither"
)


class ReinforcePlusPlusParams(lossplug.Params):
    gamma: float = Field(1.0, ge=0, le=1, description="discount per action token (verl: algorithm.gamma, 1.0)")
    whiten: Whiten = Field(True, description=WHITEN_DESCRIPTION)


class ReinforcePlusPlusBaselineParams(lossplug.Params):
    whiten: Whiten = Field(True, description=WHITEN_DESCRIPTION)


@lossplug.advantage("reinforce_plus_plus", params=ReinforcePlusPlusParams, requires=("reward",))
def reinforce_plus_plus(batch: lossplug.PolicyBatch, p: ReinforcePlusPlusParams) -> lossplug.AdvantageResult:
    """REINFORCE++: A_t = whiten(G_t), G_t = r_t + γ·G_{t+1} over action tokens; returns G.

    Paper: Hu, 2025, *REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models*,
    arXiv:2501.03262.

    Reference: verl ``compute_reinforce_plus_plus_outcome_advantage``.
    """
    mask = batch.action_mask
    returns = discounted_returns(batch, p.gamma)
    if p.whiten == "center":
        advantage = torch.where(mask, masked_center(returns, mask), 0)
    else:
        advantage = torch.where(mask, masked_whiten(returns, mask), 0) if p.whiten else returns
    return lossplug.AdvantageResult(advantage=advantage, returns=returns)


@lossplug.advantage(
    "reinforce_plus_plus_baseline", params=ReinforcePlusPlusBaselineParams, requires=("reward", "group_id")
)
def reinforce_plus_plus_baseline(batch: lossplug.PolicyBatch, p: ReinforcePlusPlusBaselineParams) -> Tensor:
    """REINFORCE++-baseline: A_i = whiten(R_i − mean_group(R)) over action tokens; a group of one keeps R_i.

    Paper: Hu, 2025, *REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models*,
    arXiv:2501.03262.

    Reference: verl ``compute_reinforce_plus_plus_baseline_outcome_advantage``.
    """
    score = at_least_float32(sequence_scores(batch))
    groups = Groups.from_ids(cast(Tensor, batch.group_id))  # required
    centered = score - group_mean_or_zero(groups, score)
    centered = torch.where(constant_group(groups, score), torch.zeros_like(centered), centered)
    if p.whiten == "center":
        return center_rows(centered, batch.action_mask)
    return whiten_rows(centered, batch.action_mask) if p.whiten else centered
