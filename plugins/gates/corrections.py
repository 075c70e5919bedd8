"""Detached corrections of the train–inference (engine) mismatch: TIS and IcePop, token and sequence variants.

They act on the **engine ratio** — the same checkpoint scored by the training engine (``old_logp``) and by the
rollout engine that sampled the tokens (``behavior_logp``)::

    log ρ_t = old_logp_t − behavior_logp_t                       (never the update ratio π_θ/π_old)

Token variants use ``ρ_t`` per action token; sequence variants use one ratio per response. Following verl's
``rollout_corr_helper.compute_rollout_correction_weights`` (``rollout_is="sequence"``), the sequence ratio is the
*product* of the token ratios, ``ρ_i = exp(Σ_t log ρ_t)`` (the unbiased sequence importance weight), with the log
sum clamped to ``± log_ratio_clamp`` (verl's ``SAFETY_BOUND`` = 20) before ``exp``. ``ratio: geometric`` uses the
length-normalised ``exp(mean_t log ρ_t)`` instead (GSPO-style; lower variance, biased; not a verl mode).

* ``tis`` / ``tis_seq`` — truncated importance sampling: ``w = min(ρ, cap)``, or ``clamp(ρ, floor, cap)`` with a
  ``floor`` (verl: ``rollout_is_threshold=cap``, TRL: ``vllm_importance_sampling_mode="token_truncate"`` /
  ``"sequence_truncate"`` with ``clip_max=cap``, ``clip_min=floor``).
* ``icepop`` / ``icepop_seq`` — two-sided rejection: ``w = ρ`` if ``low ≤ ρ ≤ high`` else ``0`` (verl:
  ``rollout_is_threshold="low_high"``, TRL: ``..._mask`` modes).

Each returns a **detached** weight (``[B, T]`` token level, ``[B]`` sequence level) that multiplies the update
gate's objective (``role="correction"``): the weight carries no gradient by construction — it is computed from
detached log-probs under ``no_grad`` and ``.detach()``-ed explicitly — so gradient flows only through the update
gate's ``logp``. ``active`` marks what still carries gradient (weight > 0).

``batch_normalize`` (verl's ``rollout_is_batch_normalize``) divides the weights by their mean over the batch the
gate is given — over its action tokens (token level) or its responses with an action token (sequence level) — when
that mean exceeds 1e-8: ``w ← w / mean(w)``. verl takes that mean over the whole rollout batch in the driver (before
it is split into mini- and micro-batches, on the response mask before rejection): a gate reproduces it exactly only
when it is given that whole batch. Otherwise compute the weights once per rollout batch with
:func:`lossplug.plugins.gates.whole_batch_weight` and pass each micro-batch's rows to
``policy_loss(weight=...)`` — the way verl hands ``rollout_is_weights`` to its loss.

Metrics: each gate reports its cut fractions (``metrics``) and, at ``metrics="full"``, verl's
``compute_is_metrics`` under verl's names (``rollout_is_mean``, ``_std``, ``_eff_sample_size``, ``_seq_*``, … of
the weights *before* batch normalisation; ``rollout_is_batch_norm_factor`` when normalising), over the batch the
gate is given. Equal to verl's wherever verl's are finite; where verl's overflow, these stay finite: the effective
sample size of a batch whose weights are all 0 is 0 (verl: ``1 / 0 = inf``), and the sequence level's
``rollout_is_min`` is clamped at e^``SAFETY_BOUND`` like verl's ``rollout_is_max`` (verl's is unclamped: above
its own maximum past e^20, inf past float32's e^88.7).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.ops import clamp_exact, clamp_moved_fast, count_moved, response_stats

from . import _rollout_stats as rs

REQUIRES = ("old_logp", "behavior_logp")


def _clamp_field(optional: bool = False) -> Any:
    unclamped = (
        "; null: no clamp, TRL's arithmetic (the weight is detached: a ratio past float range saturates at the cap)"
        if optional
        else ""
    )
    return Field(
        20.0,
        gt=0,
        le=80,
        description="the (token or summed) engine log-ratio is clamped to ± this before exp (verl's SAFETY_BOUND: "
        f"20){unclamped}",
    )


def _batch_normalize_field() -> Any:
    return Field(
        False,
        description=(
            "divide the weights by their mean over the batch the gate is given, when above 1e-8 (verl's "
            "rollout_is_batch_normalize; exact against verl when that batch is verl's whole rollout batch)"
        ),
    )


def _sequence_ratio_field() -> Any:
    return Field(
        "product",
        description="sequence ratio: product of the token ratios (verl rollout_is=sequence) or their geometric mean",
    )


def _floor_field() -> Any:
    return Field(
        None,
        gt=0,
        description="optional lower bound F of the weight clamp(ρ, F, C) (TRL's vllm_importance_sampling_clip_min "
        "with the *_truncate modes); none by default, as in verl",
    )


class _TISBounds(lossplug.Params):
    @model_validator(mode="after")
    def _floor_below_cap(self) -> _TISBounds:
        floor, cap = getattr(self, "floor", None), getattr(self, "cap", None)
        if floor is not None and cap is not None and not floor <= cap:
            raise ValueError(f"floor ({floor}) must not exceed cap ({cap})")
        return self


class TISParams(_TISBounds):
    cap: float = Field(2.0, gt=0, description="upper cap C of the weight min(ρ, C) (verl default 2.0)")
    floor: float | None = _floor_field()
    log_ratio_clamp: float | None = _clamp_field(optional=True)
    batch_normalize: bool = _batch_normalize_field()


class TISSequenceParams(_TISBounds):
    cap: float = Field(2.0, gt=0, description="upper cap C of the sequence weight min(ρ_i, C)")
    floor: float | None = _floor_field()
    ratio: Literal["product", "geometric"] = _sequence_ratio_field()
    log_ratio_clamp: float | None = _clamp_field(optional=True)
    batch_normalize: bool = _batch_normalize_field()


class _IcePopBounds(lossplug.Params):
    low: float = Field(0.5, gt=0, description="weights with ρ < low are rejected (set to 0)")
    high: float = Field(5.0, gt=0, description="weights with ρ > high are rejected (set to 0)")

    @model_validator(mode="after")
    def _ordered(self) -> _IcePopBounds:
        if not self.low <= self.high:  # (verl accepts low == high: only ρ = low is kept)
            raise ValueError(f"low ({self.low}) must not be above high ({self.high})")
        return self


class IcePopParams(_IcePopBounds):
    log_ratio_clamp: float = _clamp_field()
    batch_normalize: bool = _batch_normalize_field()


class IcePopSequenceParams(_IcePopBounds):
    ratio: Literal["product", "geometric"] = _sequence_ratio_field()
    log_ratio_clamp: float = _clamp_field()
    batch_normalize: bool = _batch_normalize_field()


def _token_log_ratio(inp: lossplug.GateInput, p: TISParams | IcePopParams) -> torch.Tensor:
    """log(π_old/π_behaviour) per token: 0 off the actions, where both are cleaned to 0 (so ρ = 1 there)."""
    return _clamped(inp.engine_log_ratio(), p.log_ratio_clamp)


def _sequence_log_ratio(
    inp: lossplug.GateInput, p: TISSequenceParams | IcePopSequenceParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clamped sequence log-ratio ``[B]`` and the unclamped one (verl's metrics read the latter)."""
    log_ratio = inp.engine_log_ratio().sum(-1)
    if p.ratio == "geometric":
        log_ratio = log_ratio / inp.lengths.clamp(min=1).to(log_ratio.dtype)
    return _clamped(log_ratio, p.log_ratio_clamp), log_ratio


def _clamped(log_ratio: torch.Tensor, bound: float | None) -> torch.Tensor:
    """The log-ratio clamped to ``± bound`` before ``exp``; as it is with no bound (TIS with TRL's arithmetic)."""
    return log_ratio if bound is None else clamp_exact(log_ratio, -bound, bound)


def _fraction(inp: lossplug.GateInput, hit: torch.Tensor, off_actions_false: bool) -> torch.Tensor:
    """Fraction of the action tokens (token level, ``[B, T]``) or of the non-empty responses (``[B]``) that ``hit``
    marks; off the actions a token ratio is exactly 1 (both log-probs are cleaned to 0), so a bound on the far side
    of 1 is never hit there and the mask pass is skipped."""
    if hit.ndim == 1:
        return inp.response_fraction(hit)
    return inp.token_fraction(hit, false_off_actions=off_actions_false)


def _valid(inp: lossplug.GateInput, ratio: torch.Tensor) -> torch.Tensor:
    return inp.lengths > 0 if ratio.ndim == 1 else inp.mask


def _count(inp: lossplug.GateInput, ratio: torch.Tensor) -> torch.Tensor:
    """The denominator of a mean over the actions (token level) or the non-empty responses (sequence level)."""
    return torch.count_nonzero(inp.lengths > 0).clamp(min=1) if ratio.ndim == 1 else inp.action_tokens


def _batch_mean(inp: lossplug.GateInput, weight: torch.Tensor) -> torch.Tensor:
    """verl's normalising mean: over the action tokens (token level) or the responses with an action token
    (sequence level: one weight per response)."""
    if weight.ndim == 1:
        valid = inp.lengths > 0
        return torch.where(valid, weight, 0).sum() / torch.count_nonzero(valid).clamp(min=1)
    return rs.token_mean(inp, weight)


def _verl_is_metrics(
    inp: lossplug.GateInput,
    weight: torch.Tensor,
    ratio: torch.Tensor,
    metric_log_ratio: torch.Tensor | None,
    upper: float,
    lower: float | None,
) -> dict[str, Callable[[], torch.Tensor]]:
    """verl's ``compute_is_metrics`` (and IcePop's ``rollout_is_oob_ratio``) of the weights before batch
    normalisation. ``ratio`` is the raw (clamped) ratio, ``metric_log_ratio`` the unclamped sequence log-ratio
    (None at token level); ``lower`` is IcePop's bound (TIS: verl's ``1 / upper``)."""
    low = 1.0 / upper if lower is None else lower
    # verl's raw weights are 0 off the actions (ours are 1 there: both log-probs are cleaned to 0); every statistic
    # below reads the actions only
    out: dict[str, Callable[[], torch.Tensor]] = {"rollout_is_mean": lambda: rs.token_mean(inp, weight)}
    if metric_log_ratio is None:
        out["rollout_is_ratio_fraction_high"] = lambda: rs.token_fraction(inp, ratio > upper)
        out["rollout_is_ratio_fraction_low"] = lambda: rs.token_fraction(inp, ratio < low)
        out["rollout_is_max"] = lambda: rs.token_max(inp, weight)
        out["rollout_is_min"] = lambda: rs.token_min(inp, weight)
    else:
        log_ratio = metric_log_ratio
        out["rollout_is_max"] = lambda: log_ratio.max().clamp(max=rs.SAFETY_BOUND).exp()
        # verl's exp(min) is unclamped: beyond e^SAFETY_BOUND it exceeds its own rollout_is_max, and overflows to inf
        # past float32's e^88.7; clamped like the max, it is verl's wherever min ≤ SAFETY_BOUND and never above max
        out["rollout_is_min"] = lambda: log_ratio.min().clamp(max=rs.SAFETY_BOUND).exp()
        # log-space thresholds, in float32 as verl computes them
        out["rollout_is_ratio_fraction_high"] = lambda: (log_ratio > rs.float32_log(upper)).float().mean()
        out["rollout_is_ratio_fraction_low"] = lambda: (log_ratio < rs.float32_log(low)).float().mean()
    out["rollout_is_std"] = lambda: rs.clamped_std(inp, weight, 0.0, upper)

    def ess() -> torch.Tensor:
        # in float64: with a log_ratio_clamp far beyond 20 a float32 second moment can underflow to a denormal
        clamped = rs.wide(weight).clamp(min=0.0, max=upper)
        normalized = clamped / (rs.token_mean(inp, clamped) + 1e-8)
        second_moment = rs.token_mean(inp, normalized.square())
        # every weight 0 (IcePop rejected the whole batch): no effective sample, 0 where verl's 1 / 0 is inf
        return torch.where(second_moment > 0, 1.0 / second_moment, torch.zeros_like(second_moment))

    out["rollout_is_eff_sample_size"] = ess
    # per-response means over every row, as verl's (a row without actions counts 0)

    def per_row(x: torch.Tensor) -> torch.Tensor:
        return torch.where(inp.lengths > 0, x, 0) if x.ndim == 1 else rs.row_mean(inp, x)

    def seq_weights() -> torch.Tensor:
        return per_row(weight)

    def raw_seq_weights() -> torch.Tensor:
        return per_row(ratio)

    out["rollout_is_seq_mean"] = lambda: seq_weights().mean()
    out["rollout_is_seq_std"] = lambda: rs.std_or_zero(seq_weights())
    out["rollout_is_seq_max"] = lambda: seq_weights().max()
    out["rollout_is_seq_min"] = lambda: seq_weights().min()
    out["rollout_is_seq_max_deviation"] = lambda: (seq_weights() - 1.0).abs().max()
    out["rollout_is_seq_fraction_high"] = lambda: (raw_seq_weights() > upper).float().mean()
    out["rollout_is_seq_fraction_low"] = lambda: (raw_seq_weights() < low).float().mean()
    if lower is not None:
        out["rollout_is_oob_ratio"] = lambda: rs.token_fraction(inp, (ratio < lower) | (ratio > upper))
    return out


def _output(
    inp: lossplug.GateInput,
    weight: torch.Tensor,
    batch_normalize: bool,
    metrics: dict[str, Callable[[], torch.Tensor]],
    details: dict[str, Callable[[], torch.Tensor]],
    active: Callable[[], torch.Tensor],
) -> lossplug.GateOutput:
    if batch_normalize:
        mean = _batch_mean(inp, weight)
        above = mean > 1e-8
        weight = torch.where(above, weight / mean, weight)
        factor = torch.where(above, mean, torch.ones_like(mean))
        metrics = {**metrics, "rollout_is_batch_norm_factor": lambda: factor}
    return lossplug.GateOutput(weight=weight.detach(), metrics=metrics, details=details, active=active)


def _tis(
    ratio: torch.Tensor,
    cap: float,
    inp: lossplug.GateInput,
    batch_normalize: bool,
    metric_log_ratio: torch.Tensor | None = None,
    floor: float | None = None,
) -> lossplug.GateOutput:
    weight = ratio.clamp(min=floor, max=cap)
    valid = _valid(inp, ratio)
    if floor is None and cap >= 1 and ratio.ndim == 2 and clamp_moved_fast(ratio, weight):
        # the tokens above cap are those the clamp moved (the ratio is 1 off the actions): no comparison's bool tensor
        metrics = {"trunc_frac": lambda: count_moved(ratio, weight) / inp.action_tokens}
    else:
        metrics = {"trunc_frac": lambda: _fraction(inp, ratio > cap, cap >= 1)}
    if floor is not None:
        metrics["floor_frac"] = lambda: _fraction(inp, ratio < floor, floor <= 1)
    return _output(
        inp,
        weight,
        batch_normalize,
        metrics=metrics,
        details={
            **response_stats("ratio", ratio, valid),
            "weight_mean": lambda: torch.where(valid, weight, 0).sum() / _count(inp, ratio),
            **_verl_is_metrics(inp, weight, ratio, metric_log_ratio, cap, None),
        },
        active=lambda: weight > 0,
    )


def _icepop(
    ratio: torch.Tensor,
    low: float,
    high: float,
    inp: lossplug.GateInput,
    batch_normalize: bool,
    metric_log_ratio: torch.Tensor | None = None,
) -> lossplug.GateOutput:
    keep = (ratio >= low) & (ratio <= high)
    weight = torch.where(keep, ratio, torch.zeros_like(ratio))
    valid = _valid(inp, ratio)
    return _output(
        inp,
        weight,
        batch_normalize,
        metrics={
            "reject_frac_low": lambda: _fraction(inp, ratio < low, low <= 1),
            "reject_frac_high": lambda: _fraction(inp, ratio > high, high >= 1),
        },
        details={
            **response_stats("ratio", ratio, valid),
            "weight_mean": lambda: torch.where(valid, weight, 0).sum() / _count(inp, ratio),
            **_verl_is_metrics(inp, weight, ratio, metric_log_ratio, high, low),
        },
        active=lambda: keep,
    )


@lossplug.gate("tis", params=TISParams, requires=REQUIRES, role="correction", level="token")
def tis(inp: lossplug.GateInput, p: TISParams) -> lossplug.GateOutput:
    """TIS (token): detached weight min(ρ_t, cap), ρ_t = π_old/π_behaviour.

    Paper: Yao et al., 2025, *Your Efficient RL Framework Secretly Brings You Off-Policy RL Training*,
    https://fengyao.notion.site/off-policy-rl (truncated importance sampling against the rollout engine).

    Reference: verl ``rollout_corr_helper.compute_rollout_correction_weights`` (``rollout_is="token"``,
    ``rollout_is_threshold=cap``); TRL ``vllm_importance_sampling_mode="token_truncate"``.
    """
    with torch.no_grad():
        return _tis(_token_log_ratio(inp, p).exp(), p.cap, inp, p.batch_normalize, floor=p.floor)


@lossplug.gate("tis_seq", params=TISSequenceParams, requires=REQUIRES, role="correction", level="sequence")
def tis_seq(inp: lossplug.GateInput, p: TISSequenceParams) -> lossplug.GateOutput:
    """TIS (sequence): detached weight min(ρ_i, cap), ρ_i = Π_t ρ_t (or their geometric mean).

    Paper: Yao et al., 2025, *Your Efficient RL Framework Secretly Brings You Off-Policy RL Training*,
    https://fengyao.notion.site/off-policy-rl (truncated importance sampling against the rollout engine).

    Reference: verl ``rollout_corr_helper.compute_rollout_correction_weights`` (``rollout_is="sequence"``,
    ``rollout_is_threshold=cap``); TRL ``vllm_importance_sampling_mode="sequence_truncate"``.
    """
    with torch.no_grad():
        log_ratio, unclamped = _sequence_log_ratio(inp, p)
        return _tis(log_ratio.exp(), p.cap, inp, p.batch_normalize, unclamped, floor=p.floor)


@lossplug.gate("icepop", params=IcePopParams, requires=REQUIRES, role="correction", level="token")
def icepop(inp: lossplug.GateInput, p: IcePopParams) -> lossplug.GateOutput:
    """IcePop (token): detached weight ρ_t where low ≤ ρ_t ≤ high, else 0.

    Paper: IcePop, Ling Team, 2025, *Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
    Thinking Model* (Ring-1T), arXiv:2510.18855.

    Reference: verl ``rollout_corr_helper.compute_rollout_correction_weights`` (``rollout_is="token"``,
    ``rollout_is_threshold="<low>_<high>"``); TRL ``vllm_importance_sampling_mode="token_mask"``.
    """
    with torch.no_grad():
        return _icepop(_token_log_ratio(inp, p).exp(), p.low, p.high, inp, p.batch_normalize)


@lossplug.gate("icepop_seq", params=IcePopSequenceParams, requires=REQUIRES, role="correction", level="sequence")
def icepop_seq(inp: lossplug.GateInput, p: IcePopSequenceParams) -> lossplug.GateOutput:
    """IcePop (sequence): detached weight ρ_i where low ≤ ρ_i ≤ high, else 0 (ρ_i = Π_t ρ_t by default).

    Paper: IcePop, Ling Team, 2025, *Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
    Thinking Model* (Ring-1T), arXiv:2510.18855.

    Reference: verl ``rollout_corr_helper.compute_rollout_correction_weights`` (``rollout_is="sequence"``,
    ``rollout_is_threshold="<low>_<high>"``); TRL ``vllm_importance_sampling_mode="sequence_mask"``.
    """
    with torch.no_grad():
        log_ratio, unclamped = _sequence_log_ratio(inp, p)
        return _icepop(log_ratio.exp(), p.low, p.high, inp, p.batch_normalize, unclamped)
