"""GRPO with leave-one-out statistics (NeMo-RL's default GRPO estimator): each rollout is compared with the *other*
rollouts of its group only, for the baseline and for the scale::

    b_i = mean_{j≠i} R_j                     s_i = std_{j≠i} R_j   (Bessel-corrected over the n − 1 others)
    A_i = (R_i − b_i) / (s_i + eps)          where s_i > 0
    A_i =  R_i − b_i                         where s_i = 0  (the others are all equal, or n = 2)
    A_i = 0                                  for a group of one, or a group whose rewards are all equal

Leaving the rollout out of its own baseline makes the baseline independent of the rollout (RLOO's unbiased
baseline), and NeMo-RL leaves it out of the standard deviation too. ``scale: none`` keeps the baseline and drops the
division: that is RLOO (``rloo``), except that a group of one gets 0 here (NeMo-RL's convention) where ``rloo``
refuses it.

The leave-one-out sum of squares is computed from the group's centred one by Welford's downdate,
``M2_{−i} = M2 − (R_i − m)²·n/(n − 1)`` with ``m`` the group mean, then ``s_i² = M2_{−i}/(n − 2)``; NeMo-RL takes
``E_{−i}[R²] − E_{−i}[R]²`` instead — equal in exact arithmetic. Either form can leave rounding noise where the
others are all equal, and a tiny positive ``s_i`` would then divide by ``≈ eps`` (a 10⁶ advantage): here that case
is detected exactly (the row holds its group's only maximum or minimum and the others the other extreme) and its
std is 0, so the advantage is ``R_i − b_i``. NeMo-RL's form happens to be exact for 0/1 rewards, not for others.
Token rewards ``[B, T]`` are summed over action positions first. Advantages are ``[B]``, at least float32, and
carry no gradient.

Paper: Ahmadian et al., 2024, *Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
Feedback in LLMs*, arXiv:2402.14740 (the leave-one-out baseline); Shao et al., 2024, *DeepSeekMath*,
arXiv:2402.03300 (GRPO's std normalisation).

Reference: NeMo-RL (NVIDIA-NeMo/RL, commit 7ea279ab), ``nemo_rl/algorithms/advantage_estimator.py``
``GRPOAdvantageEstimator`` (``use_leave_one_out_baseline: true``, ``normalize_rewards: true``, epsilon 1e-6,
division only where ``std > 0``) and ``nemo_rl/algorithms/utils.py`` ``calculate_baseline_and_std_per_prompt``.
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from pydantic import Field

import lossplug
from lossplug.ops import Groups

from ._verl_statistics import at_least_float32
from .group_relative import sequence_scores

Tensor = torch.Tensor


class GRPOLeaveOneOutParams(lossplug.Params):
    scale: Literal["std", "none"] = Field(
        "std", description="std: divide by the others' std + eps where it is > 0 (normalize_rewards); none: RLOO"
    )
    eps: float = Field(1e-6, ge=0, description="epsilon added to the others' std (NeMo-RL: 1e-6)")


def others_equal(groups: Groups, score: Tensor) -> Tensor:
    """``[B]`` bool: the *other* rows of the row's group all hold exactly the same value — in a group that is not
    constant, exactly when the row holds the only occurrence of its group's maximum (or minimum) and every other row
    holds the minimum (or maximum). A pair always qualifies."""
    n = groups.counts[groups.inverse]
    high, low = groups.amax(score)[groups.inverse], groups.amin(score)[groups.inverse]
    at_high = groups.sum((score == high).to(score.dtype))[groups.inverse]
    at_low = groups.sum((score == low).to(score.dtype))[groups.inverse]
    lone_high = (score == high) & (at_high == 1) & (at_low == n - 1)
    lone_low = (score == low) & (at_low == 1) & (at_high == n - 1)
    return lone_high | lone_low


def leave_one_out_stats(groups: Groups, score: Tensor) -> tuple[Tensor, Tensor]:
    """Per row: the mean and the Bessel-corrected std of the *other* rows of its group (``[B]`` each; 0 where the
    group has fewer than two, resp. three, rows, and exactly 0 where the others are all equal)."""
    n = groups.counts.to(score.dtype)[groups.inverse]
    others = (n - 1).clamp(min=1)
    baseline = torch.where(n > 1, (groups.sum(score)[groups.inverse] - score) / others, torch.zeros_like(score))
    centred = score - groups.mean(score)[groups.inverse]
    m2 = groups.sum(centred * centred)[groups.inverse]
    m2_others = (m2 - centred * centred * n / others).clamp(min=0)  # Welford's downdate
    var = torch.where(n > 2, m2_others / (n - 2).clamp(min=1), torch.zeros_like(score))
    return baseline, torch.where(others_equal(groups, score), torch.zeros_like(var), var.sqrt())


@lossplug.advantage("grpo_loo", params=GRPOLeaveOneOutParams, requires=("reward", "group_id"))
def grpo_loo(batch: lossplug.PolicyBatch, p: GRPOLeaveOneOutParams) -> Tensor:
    """GRPO-LOO: A_i = (R_i − mean_{j≠i} R_j) / (std_{j≠i} R_j + eps) where that std > 0; 0 for a group of one."""
    score = at_least_float32(sequence_scores(batch))
    groups = Groups.from_ids(cast(Tensor, batch.group_id))  # set: required
    baseline, std = leave_one_out_stats(groups, score)
    centred = score - baseline
    adv = centred if p.scale == "none" else torch.where(std > 0, centred / (std + p.eps), centred)
    alone = groups.counts[groups.inverse] < 2
    return torch.where(alone | groups.constant(score)[groups.inverse], torch.zeros_like(adv), adv)
