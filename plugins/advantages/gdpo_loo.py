"""GDPO with leave-one-out statistics (NeMo-RL's ``gdpo``): each reward component normalised against the *other*
responses of its group, the weighted sum standardised over the batch's responses::

    A_k,i = (r_k,i − mean_{j≠i} r_k,j) / (std_{j≠i} r_k,j + ε)     where that std > 0, else r_k,i − mean_{j≠i} r_k,j
    S_i   = Σ_k w_k · A_k,i                                         weighted sum (weights default to 1)
    A_i   = (S_i − mean(S)) / std(S)                                over the batch's responses, each once;
                                                                    S_i − mean(S) where std(S) = 0

The components are ``PolicyBatch.reward_components`` ``[B, K]`` (NeMo-RL: the batch's ``reward/<name>`` keys in
sorted order, ``reward_weights`` in the same order). Per component the statistics are those of ``grpo_loo`` (NeMo-RL's
GRPO estimator, same function ``calculate_baseline_and_std_per_prompt``): the mean and the Bessel-corrected std of
the *other* rows of the group, ε = 1e-6, the division only where that std is > 0 — so a pair's advantages are the
plain differences ``r_k,i − r_k,j``. A group of one gets 0 for every component (NeMo-RL sets its baseline to its own
reward), and a group whose values of a component are all equal gets exactly 0 for that component. ``baseline:
mean`` is NeMo-RL's ``use_leave_one_out_baseline: false``: the group's mean and sample std (the row included), with
the same division rule and the same zeros. ``scale: none`` is ``normalize_rewards: false``: the per-component
division is skipped — the final standardisation still runs (NeMo-RL runs it whatever ``normalize_rewards`` says).
The final standardisation divides by torch's sample std of ``S`` over the batch's rows (no ε, each response once,
whatever its length); a batch whose ``S`` are all exactly equal (or a batch of one row) gets exactly 0. Advantages
are ``[B]``, at least float32, and carry no gradient.

Why a plugin of its own and not options on ``gdpo`` (verl's): the two share only the shape "normalise each
component, sum, standardise", and every step's convention differs — the baseline (leave-one-out vs the group mean),
the std (the others' vs the group's, divided only where > 0 vs always ``+ ε``), a group of one (0 vs ``r / (1 + ε)``)
and the final standardisation (over responses with torch's std and no ε vs verl's ``masked_whiten`` over action
tokens with ``1e-8`` inside the square root). Options would have to switch all of them together; a second name says
so at once, as ``grpo_loo`` does beside ``grpo``.

Where this plugin is exact and NeMo-RL rounds: NeMo-RL computes the others' variance as ``E_{−i}[r²] − E_{−i}[r]²``
in float32, which can leave a tiny positive std where the others are all equal (then a division by ≈ ε); here that
case is detected exactly (``grpo_loo``'s downdate), and a constant ``S`` is 0 rather than rounding noise divided by
its own std. NeMo-RL refuses a batch with fewer than two components (it points to GRPO); here one column is accepted
(it is ``grpo_loo`` followed by the standardisation).

Paper: GDPO: Group reward-Decoupled Normalization Policy Optimization, 2026, arXiv:2601.05242; the leave-one-out
statistics: Ahmadian et al., 2024, arXiv:2402.14740.

Reference: NeMo-RL (NVIDIA-NeMo/RL, commit 7ea279abfbeb698b092856d0dab61e7cf39bc909, 2026-08-22)
``nemo_rl/algorithms/advantage_estimator.py`` ``GDPOAdvantageEstimator`` (``use_leave_one_out_baseline``,
``normalize_rewards``, ``reward_weights``; defaults from ``AdvEstimatorConfig``: leave-one-out, normalised, weights
1) and ``nemo_rl/algorithms/utils.py`` ``calculate_baseline_and_std_per_prompt``. NeMo-RL's PyPI package
(``nemo-rl`` 0.0.0) is an empty placeholder, so the tests' oracle is that code transcribed, in float64.
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from pydantic import Field

import lossplug
from lossplug.ops import Groups

from ._verl_statistics import at_least_float32
from .grpo_loo import leave_one_out_stats
from .multi_reward import component_weights

Tensor = torch.Tensor


class GDPOLeaveOneOutParams(lossplug.Params):
    weights: tuple[float, ...] | None = Field(
        None, description="weight of each reward component (NeMo-RL: reward_weights); default: all 1"
    )
    baseline: Literal["leave_one_out", "mean"] = Field(
        "leave_one_out",
        description="leave_one_out: the other rows' mean and std (NeMo-RL's default, use_leave_one_out_baseline); "
        "mean: the group's mean and sample std",
    )
    scale: Literal["std", "none"] = Field(
        "std",
        description="std: divide each centred component by its std + eps where the std > 0 (normalize_rewards); "
        "none: centre only (the final standardisation still runs)",
    )
    eps: float = Field(1e-6, ge=0, description="epsilon added to each component's std (NeMo-RL: 1e-6)")


def component_advantage(groups: Groups, r: Tensor, p: GDPOLeaveOneOutParams) -> Tensor:
    """``[B]``: one reward component centred (and scaled) within its groups, as NeMo-RL's GRPO estimator does."""
    if p.baseline == "leave_one_out":
        baseline, std = leave_one_out_stats(groups, r)
    else:
        baseline = groups.mean(r)[groups.inverse]
        std = groups.std(r, unbiased=True).nan_to_num(0.0)[groups.inverse]  # a group of one: 0 below anyway
    centred = r - baseline
    adv = centred if p.scale == "none" else torch.where(std > 0, centred / (std + p.eps), centred)
    zero = (groups.counts[groups.inverse] < 2) | groups.constant(r)[groups.inverse]
    return torch.where(zero, torch.zeros_like(adv), adv)


def standardise_over_responses(total: Tensor) -> Tensor:
    """``(S − mean S) / std S`` over the rows (torch's sample std, no ε); ``S − mean S`` where the std is 0; exactly
    0 for a constant ``S`` or a single row."""
    if total.numel() < 2 or bool((total == total[0]).all()):
        return torch.zeros_like(total)
    centred = total - total.mean()
    std = total.std()
    return centred / std if bool(std > 0) else centred


@lossplug.advantage("gdpo_loo", params=GDPOLeaveOneOutParams, requires=("reward_components", "group_id"))
def gdpo_loo(batch: lossplug.PolicyBatch, p: GDPOLeaveOneOutParams) -> Tensor:
    """GDPO-LOO: A = standardise(Σ_k w_k · (r_k − mean_{j≠i} r_k) / (std_{j≠i} r_k + eps)) over the responses.

    Paper: GDPO, arXiv:2601.05242.

    Reference: NeMo-RL ``GDPOAdvantageEstimator`` (``nemo_rl/algorithms/advantage_estimator.py``).
    """
    components = at_least_float32(cast(Tensor, batch.reward_components))  # required
    K = components.shape[-1]
    weights = component_weights("gdpo_loo", p.weights, K)
    groups = Groups.from_ids(cast(Tensor, batch.group_id))  # required
    total = weights[0] * component_advantage(groups, components[:, 0], p)
    for k in range(1, K):  # in order, as NeMo-RL's sum() accumulates them
        total = total + weights[k] * component_advantage(groups, components[:, k], p)
    return standardise_over_responses(total)
