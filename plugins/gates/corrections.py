"""Detached corrections of the train–inference (engine) mismatch: TIS and IcePop, token and sequence variants.

They act on the **engine ratio** — the same checkpoint scored by the training engine (``old_logp``) and by the
rollout engine that sampled the tokens (``behavior_logp``)::

    log ρ_t = old_logp_t − behavior_logp_t                       (never the update ratio π_θ/π_old)

Token variants use ``ρ_t`` per action token; sequence variants use one ratio per response. Following verl's
``rollout_corr_helper.compute_rollout_correction_weights`` (``rollout_is="sequence"``), the sequence ratio is the
*product* of the token ratios, ``ρ_i = exp(Σ_t log ρ_t)`` (the unbiased sequence importance weight), with the log
sum clamped to ``± log_ratio_clamp`` (verl's ``SAFETY_BOUND`` = 20) before ``exp``. ``ratio: geometric`` uses the
length-normalised ``exp(mean_t log ρ_t)`` instead (GSPO-style; lower variance, biased; not a verl mode).

* ``tis`` / ``tis_seq`` — truncated importance sampling: ``w = min(ρ, cap)`` (verl: ``rollout_is_threshold=cap``,
  TRL: ``vllm_importance_sampling_mode="token_truncate"/"sequence_truncate"`` with ``clip_max=cap``).
* ``icepop`` / ``icepop_seq`` — two-sided rejection: ``w = ρ`` if ``low ≤ ρ ≤ high`` else ``0`` (verl:
  ``rollout_is_threshold="low_high"``, TRL: ``..._mask`` modes).

Each returns a **detached** weight (``[B, T]`` token level, ``[B]`` sequence level) that multiplies the update
gate's objective (``role="correction"``): the weight carries no gradient by construction — it is computed from
detached log-probs under ``no_grad`` and ``.detach()``-ed explicitly — so gradient flows only through the update
gate's ``logp``. ``active`` marks what still carries gradient (weight > 0).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.ops import clamp_exact, response_stats

REQUIRES = ("old_logp", "behavior_logp")


def _clamp_field() -> Any:
    return Field(
        20.0,
        gt=0,
        le=80,
        description="the (token or summed) engine log-ratio is clamped to ± this before exp (verl's SAFETY_BOUND: 20)",
    )


def _sequence_ratio_field() -> Any:
    return Field(
        "product",
        description="sequence ratio: product of the token ratios (verl rollout_is=sequence) or their geometric mean",
    )


class TISParams(lossplug.Params):
    cap: float = Field(2.0, gt=0, description="upper cap C of the weight min(ρ, C) (verl default 2.0)")
    log_ratio_clamp: float = _clamp_field()


class TISSequenceParams(lossplug.Params):
    cap: float = Field(2.0, gt=0, description="upper cap C of the sequence weight min(ρ_i, C)")
    ratio: Literal["product", "geometric"] = _sequence_ratio_field()
    log_ratio_clamp: float = _clamp_field()


class _IcePopBounds(lossplug.Params):
    low: float = Field(0.5, gt=0, description="weights with ρ < low are rejected (set to 0)")
    high: float = Field(5.0, gt=0, description="weights with ρ > high are rejected (set to 0)")

    @model_validator(mode="after")
    def _ordered(self) -> _IcePopBounds:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        return self


class IcePopParams(_IcePopBounds):
    log_ratio_clamp: float = _clamp_field()


class IcePopSequenceParams(_IcePopBounds):
    ratio: Literal["product", "geometric"] = _sequence_ratio_field()
    log_ratio_clamp: float = _clamp_field()


def _token_log_ratio(inp: lossplug.GateInput, p: TISParams | IcePopParams) -> torch.Tensor:
    """log(π_old/π_behaviour) per token: 0 off the actions, where both are cleaned to 0 (so ρ = 1 there)."""
    return clamp_exact(inp.engine_log_ratio(), -p.log_ratio_clamp, p.log_ratio_clamp)


def _sequence_log_ratio(inp: lossplug.GateInput, p: TISSequenceParams | IcePopSequenceParams) -> torch.Tensor:
    log_ratio = inp.engine_log_ratio().sum(-1)
    if p.ratio == "geometric":
        log_ratio = log_ratio / inp.lengths.clamp(min=1).to(log_ratio.dtype)
    return clamp_exact(log_ratio, -p.log_ratio_clamp, p.log_ratio_clamp)


def _fraction(inp: lossplug.GateInput, hit: torch.Tensor, off_actions_false: bool) -> torch.Tensor:
    """Fraction of the action tokens (token level, ``[B, T]``) or of the non-empty responses (``[B]``) that ``hit``
    marks; off the actions a token ratio is exactly 1 (both log-probs are cleaned to 0), so a bound on the far side
    of 1 is never hit there and the mask pass is skipped."""
    if hit.ndim == 1:
        return inp.response_fraction(hit)
    return inp.token_fraction(hit, false_off_actions=off_actions_false)


def _valid(inp: lossplug.GateInput, ratio: torch.Tensor) -> torch.Tensor:
    return inp.lengths > 0 if ratio.ndim == 1 else inp.mask


def _tis(ratio: torch.Tensor, cap: float, inp: lossplug.GateInput) -> lossplug.GateOutput:
    weight = ratio.clamp(max=cap)
    valid = _valid(inp, ratio)
    return lossplug.GateOutput(
        weight=weight.detach(),
        metrics={"trunc_frac": lambda: _fraction(inp, ratio > cap, cap >= 1)},
        details={
            **response_stats("ratio", ratio, valid),
            "weight_mean": lambda: torch.where(valid, weight, 0).sum() / _count(inp, ratio),
        },
        active=lambda: weight > 0,
    )


def _icepop(ratio: torch.Tensor, low: float, high: float, inp: lossplug.GateInput) -> lossplug.GateOutput:
    keep = (ratio >= low) & (ratio <= high)
    weight = torch.where(keep, ratio, torch.zeros_like(ratio))
    valid = _valid(inp, ratio)
    return lossplug.GateOutput(
        weight=weight.detach(),
        metrics={
            "reject_frac_low": lambda: _fraction(inp, ratio < low, low <= 1),
            "reject_frac_high": lambda: _fraction(inp, ratio > high, high >= 1),
        },
        details={
            **response_stats("ratio", ratio, valid),
            "weight_mean": lambda: torch.where(valid, weight, 0).sum() / _count(inp, ratio),
        },
        active=lambda: keep,
    )


def _count(inp: lossplug.GateInput, ratio: torch.Tensor) -> torch.Tensor:
    """The denominator of a mean over the actions (token level) or the non-empty responses (sequence level)."""
    return torch.count_nonzero(inp.lengths > 0).clamp(min=1) if ratio.ndim == 1 else inp.action_tokens


@lossplug.gate("tis", params=TISParams, requires=REQUIRES, role="correction", level="token")
def tis(inp: lossplug.GateInput, p: TISParams) -> lossplug.GateOutput:
    """TIS (token): detached weight min(ρ_t, cap), ρ_t = π_old/π_behaviour.

    Paper: Yao et al., 2025, *Your Efficient RL Framework Secretly Brings You Off-Policy RL Training*,
    https://fengyao.notion.site/off-policy-rl (truncated importance sampling against the rollout engine).

    Reference: verl ``rollout_corr_helper.compute_rollout_correction_weights`` (``rollout_is="token"``,
    ``rollout_is_threshold=cap``); TRL ``vllm_importance_sampling_mode="token_truncate"``.
    """
    with torch.no_grad():
        return _tis(_token_log_ratio(inp, p).exp(), p.cap, inp)


@lossplug.gate("tis_seq", params=TISSequenceParams, requires=REQUIRES, role="correction", level="sequence")
def tis_seq(inp: lossplug.GateInput, p: TISSequenceParams) -> lossplug.GateOutput:
    """TIS (sequence): detached weight min(ρ_i, cap), ρ_i = Π_t ρ_t (or their geometric mean).

    Paper: Yao et al., 2025, *Your Efficient RL Framework Secretly Brings You Off-Policy RL Training*,
    https://fengyao.notion.site/off-policy-rl (truncated importance sampling against the rollout engine).

    Reference: verl ``rollout_corr_helper.compute_rollout_correction_weights`` (``rollout_is="sequence"``,
    ``rollout_is_threshold=cap``); TRL ``vllm_importance_sampling_mode="sequence_truncate"``.
    """
    with torch.no_grad():
        return _tis(_sequence_log_ratio(inp, p).exp(), p.cap, inp)


@lossplug.gate("icepop", params=IcePopParams, requires=REQUIRES, role="correction", level="token")
def icepop(inp: lossplug.GateInput, p: IcePopParams) -> lossplug.GateOutput:
    """IcePop (token): detached weight ρ_t where low ≤ ρ_t ≤ high, else 0.

    Paper: IcePop, Ling Team, 2025, *Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
    Thinking Model* (Ring-1T), arXiv:2510.18855.

    Reference: verl ``rollout_corr_helper.compute_rollout_correction_weights`` (``rollout_is="token"``,
    ``rollout_is_threshold="<low>_<high>"``); TRL ``vllm_importance_sampling_mode="token_mask"``.
    """
    with torch.no_grad():
        return _icepop(_token_log_ratio(inp, p).exp(), p.low, p.high, inp)


@lossplug.gate("icepop_seq", params=IcePopSequenceParams, requires=REQUIRES, role="correction", level="sequence")
def icepop_seq(inp: lossplug.GateInput, p: IcePopSequenceParams) -> lossplug.GateOutput:
    """IcePop (sequence): detached weight ρ_i where low ≤ ρ_i ≤ high, else 0 (ρ_i = Π_t ρ_t by default).

    Paper: IcePop, Ling Team, 2025, *Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
    Thinking Model* (Ring-1T), arXiv:2510.18855.

    Reference: verl ``rollout_corr_helper.compute_rollout_correction_weights`` (``rollout_is="sequence"``,
    ``rollout_is_threshold="<low>_<high>"``); TRL ``vllm_importance_sampling_mode="sequence_mask"``.
    """
    with torch.no_grad():
        return _icepop(_sequence_log_ratio(inp, p).exp(), p.low, p.high, inp)
