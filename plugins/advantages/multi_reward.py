"""Several rewards per response: normalise each reward within its group, then sum (GDPO; TRL ``normalize_then_sum``).

With ``R_ik`` the ``k``-th reward of response ``i`` (``PolicyBatch.reward_components`` ``[B, K]``, one column per
reward function), ``g(i)`` its prompt group and ``w_k`` the reward weights::

    Â_ik = (R_ik − mean_g(i)(R_·k)) / (std_g(i)(R_·k) + eps)         each reward normalised within its group
    S_i  = Σ_k w_k · Â_ik                                             the weighted sum
    A_i  = (S_i − mean(S)) / (std(S) + eps)                          scale: batch (TRL) — or A_i = S_i (scale: none)

with the sample (Bessel-corrected) standard deviation, as TRL. Normalising each reward before summing keeps a
reward with a large range from drowning the others, and distinct reward combinations from collapsing onto the same
advantage (the GDPO paper's argument against ``sum_then_normalize``). A reward that is constant within a group
contributes exactly 0 to that group (an epsilon avoids a division by zero; it never turns rounding noise in the mean
into a signal); TRL divides that rounding noise by ``1e-4``, which differs from 0 by at most ~1e-12 per component.
The batch normalisation spans the whole batch given to the estimator (TRL: the whole generation batch, gathered
across processes). Advantages are ``[B]`` and carry no gradient.

Paper: Liu et al., 2026, *GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward RL
Optimization*, arXiv:2601.05242.

Reference: TRL ``GRPOTrainer._generate_and_score_completions`` (``multi_objective_aggregation="normalize_then_sum"``,
``reward_weights``).
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from pydantic import Field

import lossplug
from lossplug.contracts import LossplugError
from lossplug.ops import Groups


class NormalizeThenSumParams(lossplug.Params):
    weights: tuple[float, ...] | None = Field(
        None, description="one weight per reward column w_k (TRL reward_weights); null: every weight 1"
    )
    eps: float = Field(1e-4, ge=0, description="epsilon added to both standard deviations (TRL: 1e-4)")
    scale: Literal["batch", "none"] = Field(
        "batch", description="batch: normalise the summed rewards over the batch (TRL); none: the sum is the advantage"
    )


def component_weights(plugin: str, weights: tuple[float, ...] | None, columns: int) -> tuple[float, ...]:
    """The weight of each of ``columns`` reward components (every weight 1 when none are given); a count that is not
    the number of columns is refused, naming ``plugin``."""
    if weights is None:
        return (1.0,) * columns
    if len(weights) != columns:
        raise LossplugError(
            f"{plugin}: weights has {len(weights)} entries but reward_components has {columns} columns (one weight "
            "per reward component, in the order of the columns)"
        )
    return tuple(weights)


@lossplug.advantage("normalize_then_sum", params=NormalizeThenSumParams, requires=("reward_components", "group_id"))
def normalize_then_sum(batch: lossplug.PolicyBatch, p: NormalizeThenSumParams) -> torch.Tensor:
    """A = batch-normalised Σ_k w_k·(R_k − mean_group R_k)/(std_group R_k + eps): each reward normalised in its group.

    Paper: Liu et al., 2026, *GDPO*, arXiv:2601.05242.

    Reference: TRL ``multi_objective_aggregation="normalize_then_sum"``.
    """
    rewards = cast(torch.Tensor, batch.reward_components)  # [B, K]; set: required
    num_rewards = rewards.shape[1]
    per_column = component_weights("normalize_then_sum", p.weights, num_rewards)
    groups = Groups.from_ids(cast(torch.Tensor, batch.group_id))  # set: required
    inverse, counts = groups.inverse, groups.counts.to(rewards.dtype).unsqueeze(-1)  # [G, 1]

    def group_sum(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(groups.num_groups, num_rewards, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)

    centered = rewards - (group_sum(rewards) / counts)[inverse]
    # Bessel-corrected; a singleton group has nothing to compare with: its centred reward is exactly 0 (std unused)
    std = (group_sum(centered * centered) / (counts - 1).clamp(min=1)).sqrt()[inverse]
    rows = inverse.unsqueeze(-1).expand_as(rewards)
    empty = rewards.new_empty(groups.num_groups, num_rewards)  # every group has ≥ 1 row: all overwritten
    highest = empty.scatter_reduce(0, rows, rewards, reduce="amax", include_self=False)
    lowest = empty.scatter_reduce(0, rows, rewards, reduce="amin", include_self=False)
    constant = (highest == lowest)[inverse]  # [B, K]: the reward is the same for the whole group
    denom = std + p.eps  # eps may be 0: a zero std must not turn into ±inf
    normalised = torch.where(constant | (denom <= 0), torch.zeros_like(centered), centered / denom)
    # float32 weights, as TRL holds reward_weights (a weight like 0.3 enters with float32 rounding)
    weights = torch.tensor(per_column, dtype=torch.float32)
    summed = (normalised * weights.to(device=rewards.device, dtype=rewards.dtype)).sum(-1)
    if p.scale == "none":
        return summed
    batch_std = summed.std() if summed.numel() > 1 else torch.zeros((), dtype=summed.dtype, device=summed.device)
    batch_denom = batch_std + p.eps
    centered_sum = summed - summed.mean()
    return torch.where(batch_denom > 0, centered_sum / batch_denom, torch.zeros_like(centered_sum))
