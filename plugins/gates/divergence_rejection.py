"""AReaL's ``rejection_sampling``: the behaviour importance weight ρ = π_prox/π_behave, rejected (or clamped) where
a divergence metric between the two leaves its bounds — every metric, level and aggregation AReaL has, k3 and k1-max
included.

With ``log ρ_t = old_logp_t − behavior_logp_t`` (``old_logp`` is AReaL's proximal policy π_prox, ``behavior_logp``
its inference engine's π_behave), the per-token metric is::

    ratio:  ρ_t            kl_k1:  log ρ_t            kl_k2:  ½ (log ρ_t)²            kl_k3:  1/ρ_t − 1 + log ρ_t

(AReaL's k3 is ``KLEstimator`` k3 of π_prox against π_behave: the reverse direction of verl's ``rollout_rs`` k3,
``ρ − 1 − log ρ``; its k1 is ``+log ρ``, verl's ``−log ρ``). At ``level: token`` each token's metric is checked;
at ``level: sequence`` one statistic per response is, over its action tokens: for a KL metric ``agg`` ``sum``,
``mean`` (the sum / L_i) or ``max`` of the token metrics; for ``ratio`` the same in log space (``exp`` of the
sum, the mean — the geometric mean — or the max of ``log ρ_t``). A statistic is in bounds when
``lower ≤ stat ≤ upper`` (``stat ≤ upper`` without ``lower``).

``action: mask``: the weight is ``w_t = ρ_t`` where the token (its response, at sequence level) is in bounds, ``0``
elsewhere; for ``ratio`` at sequence level the weight of every token of a kept response is the response's geometric
mean ``exp(mean_t log ρ_t)``. ``action: clamp``: nothing is rejected; the weight is ``clamp(ρ_t, lower or 0,
upper)`` — for every token at token level, for the tokens of out-of-bounds responses at sequence level (the bounds
of a KL metric clamp the ratio, as AReaL does). The weight is detached; gradient flows only through the update
gate's ``logp``. A rejected token stays in the reduction's population, as in AReaL, whose
``ppo_actor_loss_fn`` divides by the loss-mask count before rejection: with ``ppo_clip`` and ``reduction: token``
the loss is AReaL's. The log-ratio inside the weight's ``exp`` is clamped at ``±20`` (as ``icepop``): AReaL's
weight would overflow there, and no bound it accepts keeps such a ratio except a k1 sum or mean.

Metrics: ``rejected_frac`` (the action tokens given weight 0 by a rejection, ``action: mask``), ``clamped_frac``
(the action tokens whose weight a clamp changed, ``action: clamp``), ``weight_mean`` (the mean weight over the
action tokens) and ``metric_max`` (the largest per-token metric).

Reference: AReaL 1.0.4 (``areal`` on PyPI), ``areal/utils/functional/functional.py``, ``apply_rejection_sampling``
and ``_check_bounds`` (``RejectionSamplingConfig`` in ``areal/api/cli_args.py``: ``level``, ``action``, ``metric``,
``agg``, ``upper``, ``lower``), the metric from ``areal/utils/data.py``, ``KLEstimator._compute_approx_kl``
(``apply_clamp=False``).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.ops import clamp_exact

from . import _rollout_stats as rs

Tensor = torch.Tensor

#: the log-ratio bound inside the weight's exp (icepop's)
WEIGHT_LOG_RATIO_BOUND = 20.0


class DivergenceRejectionParams(lossplug.Params):
    metric: Literal["ratio", "kl_k1", "kl_k2", "kl_k3"] = Field(
        "kl_k3",
        description=("AReaL's metric: ratio ρ = π_prox/π_behave, kl_k1 log ρ, kl_k2 ½(log ρ)², kl_k3 1/ρ − 1 + log ρ"),
    )
    level: Literal["token", "sequence"] = Field(
        "token", description="token: each token judged alone; sequence: a response's tokens share its fate"
    )
    agg: Literal["sum", "mean", "max"] = Field(
        "mean", description="the per-response statistic at level sequence (in log space for ratio)"
    )
    action: Literal["mask", "clamp"] = Field(
        "mask", description="mask: weight 0 out of bounds; clamp: the ratio clamped to [lower or 0, upper]"
    )
    upper: float = Field(5.0, description="upper bound on the metric (or statistic)")
    lower: float | None = Field(None, description="lower bound on the metric (or statistic); none: no lower bound")

    @model_validator(mode="after")
    def _bounds(self) -> DivergenceRejectionParams:
        # AReaL's RejectionSamplingConfig.__post_init__ rules
        if self.lower is not None and self.lower > self.upper:
            raise ValueError(f"lower ({self.lower}) must not exceed upper ({self.upper})")
        if self.metric == "ratio" and self.upper <= 1.0:
            raise ValueError(
                f"upper must be > 1 for metric 'ratio' (else every off-policy token is rejected), got {self.upper}"
            )
        if self.metric == "ratio" and self.lower is not None and self.lower <= 0:
            raise ValueError(f"lower must be > 0 for metric 'ratio', got {self.lower}")
        return self


def _token_metric(log_ratio: Tensor, metric: str) -> Tensor:
    if metric == "ratio":
        return torch.exp(log_ratio)
    if metric == "kl_k1":
        return log_ratio
    if metric == "kl_k2":
        return 0.5 * log_ratio**2
    return torch.exp(-log_ratio) - 1.0 + log_ratio


def _in_bounds(stat: Tensor, p: DivergenceRejectionParams) -> Tensor:
    if p.lower is not None:
        return (stat >= p.lower) & (stat <= p.upper)
    return stat <= p.upper


def _response_statistic(inp: lossplug.GateInput, values: Tensor, agg: str) -> Tensor:
    """``[B, 1]``: the sum / mean / max of ``values`` over each response's action tokens (0 for a response without
    any, which AReaL keeps)."""
    if agg == "sum":
        return torch.where(inp.mask, values, 0).sum(-1, keepdim=True)
    if agg == "mean":
        return rs.row_mean(inp, values).unsqueeze(-1)
    top = torch.where(inp.mask, values, float("-inf")).amax(-1, keepdim=True)
    return torch.where(inp.lengths.unsqueeze(-1) == 0, torch.zeros_like(top), top)


def rejection_weight(inp: lossplug.GateInput, p: DivergenceRejectionParams) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(weight, rejected, clamped, metric)``, each ``[B, T]``: AReaL's ``behave_imp_weight`` (0 off the actions),
    the action tokens rejected (``action: mask``), those whose weight a clamp changed (``action: clamp``), and the
    per-token metric."""
    log_ratio = inp.engine_log_ratio()
    metric = _token_metric(log_ratio, p.metric)
    weight = torch.exp(clamp_exact(log_ratio, -WEIGHT_LOG_RATIO_BOUND, WEIGHT_LOG_RATIO_BOUND))
    if p.level == "token":
        in_bounds = _in_bounds(metric, p)
    else:
        is_ratio = p.metric == "ratio"
        stat = _response_statistic(inp, log_ratio if is_ratio else metric, p.agg)
        if is_ratio:
            weight = (
                torch.exp(clamp_exact(rs.row_mean(inp, log_ratio), -WEIGHT_LOG_RATIO_BOUND, WEIGHT_LOG_RATIO_BOUND))
                .unsqueeze(-1)
                .expand_as(log_ratio)
            )
            stat = torch.exp(stat)
        in_bounds = _in_bounds(stat, p).expand_as(inp.mask)
    changed = torch.zeros_like(inp.mask)
    if p.action == "clamp":
        bounded = weight.clamp(min=p.lower if p.lower is not None else 0.0, max=p.upper)
        bounded = bounded if p.level == "token" else torch.where(in_bounds, weight, bounded)
        changed = inp.mask & (bounded != weight)
        weight, in_bounds = bounded, torch.ones_like(inp.mask)
    rejected = inp.mask & ~in_bounds
    return torch.where(inp.mask & in_bounds, weight, 0.0), rejected, changed, metric


@lossplug.gate(
    "divergence_rejection",
    params=DivergenceRejectionParams,
    requires=("old_logp", "behavior_logp"),
    role="correction",
    level="token",
)
def divergence_rejection(inp: lossplug.GateInput, p: DivergenceRejectionParams) -> lossplug.GateOutput:
    """AReaL's rejection_sampling: weight ρ = π_prox/π_behave where the metric (ratio ρ, k1 log ρ, k2 ½(log ρ)², k3
    1/ρ − 1 + log ρ; per token, or summed / averaged / maxed over the response) is within [lower, upper], else 0;
    action clamp: ρ clamped to [lower or 0, upper] instead."""
    with torch.no_grad():
        weight, rejected, changed, metric = rejection_weight(inp, p)
        dtype = inp.compute_dtype
        metrics = {
            "rejected_frac": lambda: rs.token_mean(inp, rejected.to(dtype)),
            "clamped_frac": lambda: rs.token_mean(inp, changed.to(dtype)),
            "weight_mean": lambda: rs.token_mean(inp, weight),
            # in float64: k3 and the ratio exponentiate the log-ratio, beyond float32 at |log ρ| ≳ 88
            "metric_max": lambda: rs.token_max(inp, _token_metric(inp.engine_log_ratio().double(), p.metric)),
        }
        return lossplug.GateOutput(weight=weight.to(dtype).detach(), metrics=metrics, active=lambda: ~rejected)
