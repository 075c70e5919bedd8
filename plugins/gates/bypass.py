"""verl's bypass mode: importance weights and rejection against the rollout policy that stands in for π_old.

In bypass mode verl skips the old-policy forward pass and uses the rollout engine's log-probs as ``old_logp``, so the
update ratio *is* the correction ratio::

    log ρ_t = logp_t − old_logp_t          (old_logp = the rollout policy's log-probs; detached here)

and the policy loss itself computes, from the current ``logp`` (under ``no_grad``), what verl's decoupled mode gets
from the trainer: IS weights and a rejection mask. Both gates are detached corrections (``role="correction"``) that
multiply the update gate's objective:

* ``bypass_is`` / ``bypass_is_seq`` — the IS weight: token level ``w_t = ρ_t``, sequence level
  ``w_i = exp(Σ_t log ρ_t)`` (the log or its
  sum clamped to ±20 before exp), then truncated ``min(w, cap)`` (TIS) or, with ``low`` set, rejected outside
  ``[low, cap]`` (IcePop: ``w`` if ``low ≤ w ≤ cap`` else 0). ``batch_normalize`` divides by the weights' mean over
  the micro-batch (token level: over its action tokens; sequence level: over its responses) — pooled over the gate
  input's ``peers`` (the verl adapter passes every rank, as verl's ``distributed_masked_mean`` sums over the default
  process group) — unless that mean is ≤ 1e-8.
* ``bypass_rs`` — rejection: a token is kept (weight 1) when every rule passes, else dropped (weight 0). A rule
  bounds a divergence statistic of ``log ρ`` (clamped to ±20): ``k1 = −log ρ``, ``k2 = ½(log ρ)²``,
  ``k3 = ρ − 1 − log ρ``, per token (``token_k*``) or per response as the sum, mean or max over its action tokens
  (``seq_sum_k*``, ``seq_mean_k*``, ``seq_max_k2/k3``; a sequence rule keeps or drops the whole response). ``k1``
  rules keep ``log(lower) ≤ k1 ≤ log(upper)`` (ratio bounds; ``lower`` defaults to ``1/upper``), the others
  ``statistic ≤ upper``. verl drops rejected tokens from the response mask instead of weighting them 0; that is the
  same loss under every aggregation but ``seq-mean-token-mean``, whose per-response mean then runs over the kept
  tokens only — ``renormalize: true`` reproduces it, scaling each kept token by ``n_i / kept_i``, for the
  ``response`` reduction.

verl's bypass recipes: ``loss_type=reinforce`` → ``[reinforce, bypass_is|bypass_is_seq?, bypass_rs?]``; ``loss_type=ppo_clip`` →
``[ppo_clip (dual-clip clip_ratio_c), bypass_rs?]`` — verl computes the IS weights there for its metrics only (the
clipped ratio already is the IS correction), so no ``bypass_is``.

Paper: Liu, Li, Fu, Wang, Liu, Shen, 2025, *When Speed Kills Stability: Demystifying RL Collapse from the
Training-Inference Mismatch*, https://richardli.xyz/rl-collapse (bypass mode, IS and rejection on the rollout
ratio); truncated IS from Yao et al., 2025, https://fengyao.notion.site/off-policy-rl; IcePop from the Ling Team,
2025, arXiv:2510.18855.

Reference: verl ``compute_policy_loss_bypass_mode`` (``policy_loss.rollout_correction``: ``rollout_is``,
``rollout_is_threshold``, ``rollout_is_batch_normalize``, ``rollout_rs``, ``rollout_rs_threshold``, ``loss_type``),
``rollout_corr_helper.compute_rollout_correction_weights`` and ``compute_rollout_rejection_mask``.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.ops import any_rows, clamp_exact

from ._rollout_stats import SAFETY_BOUND
from .rollout_rejection import Option

Tensor = torch.Tensor


class BypassISParams(lossplug.Params):
    cap: float = Field(2.0, gt=0, description="upper threshold: TIS cap, or IcePop's upper bound (verl: 2.0)")
    low: float | None = Field(
        None, gt=0, description="IcePop's lower bound: weights outside [low, cap] are 0; null: TIS (truncate at cap)"
    )
    batch_normalize: bool = Field(
        False,
        description="divide the weights by their mean over the micro-batch (pooled over the peer ranks: verl's "
        "whole data-parallel group)",
    )

    @model_validator(mode="after")
    def _ordered(self) -> BypassISParams:
        if self.low is not None and self.low > self.cap:
            raise ValueError(f"low ({self.low}) must not exceed cap ({self.cap})")
        return self


def _pooled_mean(inp: lossplug.GateInput, total: Tensor, count: Tensor) -> Tensor:
    """``total / count`` summed over the gate input's peers (verl's ``distributed_masked_mean`` over its ranks)."""
    pooled = inp.peers.sum(torch.stack([total, count]))
    return pooled[0] / pooled[1].clamp(min=1)


def _importance(inp: lossplug.GateInput, p: BypassISParams, raw: Tensor) -> lossplug.GateOutput:
    """The truncated (or IcePop) weight of the raw ratio ``[B, T]`` or ``[B]``, batch-normalised if asked."""
    if p.low is None:
        weight = raw.clamp(max=p.cap)
    else:
        weight = torch.where((raw >= p.low) & (raw <= p.cap), raw, 0)
    if p.batch_normalize:
        dtype = weight.dtype
        if weight.ndim == 2:
            mean = _pooled_mean(inp, torch.where(inp.mask, weight, 0).sum(), inp.lengths.sum().to(dtype))
        else:
            # verl averages each response's token weights first (the same value n_i times, over n_i)
            valid = inp.lengths > 0
            per_response = torch.where(inp.mask, weight.unsqueeze(-1), 0).sum(-1) / inp.lengths.clamp(min=1)
            mean = _pooled_mean(inp, torch.where(valid, per_response, 0).sum(), valid.sum().to(dtype))
        weight = torch.where(mean > 1e-8, weight / mean, weight)
    weight = weight.detach()
    valid_rows = inp.lengths > 0

    def cut_fraction() -> Tensor:
        hit = raw > p.cap if p.low is None else (raw < p.low) | (raw > p.cap)
        return inp.response_fraction(hit) if hit.ndim == 1 else inp.token_fraction(hit)

    def weight_mean() -> Tensor:
        if weight.ndim == 2:
            return torch.where(inp.mask, weight, 0).sum() / inp.action_tokens
        return torch.where(valid_rows, weight, 0).sum() / torch.count_nonzero(valid_rows).clamp(min=1)

    return lossplug.GateOutput(
        weight=weight,
        metrics={("trunc_frac" if p.low is None else "reject_frac"): cut_fraction},
        details={"weight_mean": weight_mean},
        active=lambda: weight > 0,
    )


@lossplug.gate("bypass_is", params=BypassISParams, requires=("old_logp",), role="correction", level="token", pools=True)
def bypass_is(inp: lossplug.GateInput, p: BypassISParams) -> lossplug.GateOutput:
    """Bypass-mode token IS: detached min(ρ_t, cap) (or IcePop's ρ_t·[low ≤ ρ_t ≤ cap]), ρ_t = π_θ/π_rollout."""
    with torch.no_grad():
        raw = clamp_exact(inp.update_log_ratio().detach(), -SAFETY_BOUND, SAFETY_BOUND).exp()
        return _importance(inp, p, raw)


@lossplug.gate(
    "bypass_is_seq", params=BypassISParams, requires=("old_logp",), role="correction", level="sequence", pools=True
)
def bypass_is_seq(inp: lossplug.GateInput, p: BypassISParams) -> lossplug.GateOutput:
    """Bypass-mode sequence IS: detached min(ρ_i, cap) (or IcePop), ρ_i = exp(Σ_t log π_θ/π_rollout) per response."""
    with torch.no_grad():
        raw = inp.update_log_ratio().detach().sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
        return _importance(inp, p, raw)


class RejectionRule(lossplug.Params):
    statistic: Option = Field(description="the divergence statistic and its level (verl's rollout_rs option)")
    upper: float = Field(gt=0, description="k1: upper ratio bound; k2/k3: the statistic's upper bound")
    lower: float | None = Field(
        None, gt=0, description="k1 only: lower ratio bound (default 1/upper); kept when log(lower) ≤ k1 ≤ log(upper)"
    )

    @model_validator(mode="after")
    def _bounds(self) -> RejectionRule:
        is_k1 = self.statistic.endswith("k1")
        if self.lower is not None and not is_k1:
            raise ValueError(f"{self.statistic}: only k1 statistics take a lower bound")
        if is_k1 and self.lower is not None and self.lower > self.upper:
            raise ValueError(f"{self.statistic}: lower ({self.lower}) must not exceed upper ({self.upper})")
        return self


class BypassRSParams(lossplug.Params):
    rules: list[RejectionRule] = Field(
        default_factory=list,
        description="every rule must pass for a token to be kept (verl's comma-chained rollout_rs); none: keep all",
    )
    renormalize: bool = Field(
        False,
        description="scale kept tokens by n_i/kept_i: the response reduction then averages over the kept tokens "
        "(verl's seq-mean-token-mean over the rejection-modified mask)",
    )


def _statistic(name: str, k: Tensor, inp: lossplug.GateInput) -> Tensor:
    """A rule's statistic ``[B, T]`` (token level) or ``[B, 1]`` (per response)."""
    if name.startswith("token"):
        return k
    if name.startswith("seq_sum"):
        return k.sum(-1, keepdim=True)
    if name.startswith("seq_mean"):
        return (k.sum(-1) / inp.lengths.clamp(min=1)).unsqueeze(-1)
    peak = torch.where(inp.mask, k, float("-inf")).amax(-1, keepdim=True)
    return torch.where(inp.lengths.unsqueeze(-1) > 0, peak, 0)


@lossplug.gate("bypass_rs", params=BypassRSParams, requires=("old_logp",), role="correction", level="token")
def bypass_rs(inp: lossplug.GateInput, p: BypassRSParams) -> lossplug.GateOutput:
    """Bypass-mode rejection: weight 1 where every k1/k2/k3 rule on log(π_θ/π_rollout) passes, else 0."""
    with torch.no_grad():
        log_ratio = inp.update_log_ratio().detach().clamp(-SAFETY_BOUND, SAFETY_BOUND)
        divergences = {
            "k1": -log_ratio,
            "k2": 0.5 * log_ratio**2,
            "k3": torch.exp(log_ratio) - 1.0 - log_ratio,
        }
        keep = torch.ones_like(inp.mask)
        for rule in p.rules:
            stat = _statistic(rule.statistic, divergences[rule.statistic[-2:]], inp)
            if rule.statistic.endswith("k1"):
                lower = rule.lower if rule.lower is not None else 1.0 / rule.upper
                passed = (stat >= math.log(lower)) & (stat <= math.log(rule.upper))
            else:
                passed = stat <= rule.upper
            keep = keep & passed
        weight = keep.to(log_ratio.dtype)
        if p.renormalize:
            kept = torch.count_nonzero(keep & inp.mask, -1)
            # (in the weight's dtype: an int / int division would round to float32)
            scale = inp.lengths.to(weight.dtype) / kept.clamp(min=1).to(weight.dtype)
            weight = weight * scale.unsqueeze(-1)
    return lossplug.GateOutput(
        weight=weight.detach(),
        metrics={
            "reject_frac": lambda: inp.token_fraction(~keep),
            "reject_seq_frac": lambda: inp.response_fraction(any_rows(~keep & inp.mask)),
        },
        active=lambda: keep,
    )
