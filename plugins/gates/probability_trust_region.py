"""prime-rl's losses: a trust region on the *probability* change against the rollout policy, plus a squared-log KL.

Per action token, against the rollout engine's log-probs (prime-rl's ``inference_logprobs``; no old-policy pass)::

    log r = logp − behavior_logp        r = exp(log r)        Δ = exp(logp) − exp(behavior_logp)
    J     = keep · adv_tau · A · r − kl_tau · (log r)²
    ∂J/∂logp = keep · adv_tau · A · r − 2 · kl_tau · log r

The ratio is *not* detached (the policy gradient flows through ``r``), and ``keep`` — a constant of the update —
drops the policy-gradient term of a token whose probability moved too far; the KL term applies to every action
token, kept or not, whatever its advantage:

* ``dppo_binary_tv`` (prime-rl's default loss, DPPO-Binary-TV + Kimi-K2.5's KL): ``keep = Δ ≤ eps_high`` where
  ``A > 0``, ``Δ ≥ −eps_low`` otherwise (a token with ``A = 0`` contributes no policy gradient either way);
* ``dppo_binary_kl`` (DPPO-Binary-KL, SkyRL's ``dppo_type: binary_kl``): with the binary KL between the rollout
  and the current policy on the two outcomes {sampled token, anything else}, ``p = exp(logp)``,
  ``μ = exp(behavior_logp)``::

      D = μ·(log μ − logp) + (1 − μ)·log((1 − μ + 1e-8) / (1 − p + 1e-8))

  ``keep = not (Δ > 0 and D > eps_high)`` where ``A > 0``, ``not (Δ < 0 and D > eps_low)`` where ``A < 0`` (only a
  move in the direction the advantage pushes, and past the bound, is masked); ``kl_tau`` defaults to 0 (SkyRL has no
  KL term);
* ``ipo``: the symmetric region ``keep = |Δ| ≤ threshold``, whatever the advantage's sign.

How they differ from ``dppo_tv``: that one (verl's) is anchored at ``old_logp``, detaches a *truncated* ratio
(``sg(min(r, ratio_cap))·A·logp``) and has no KL term — the same mask rule, another value and gradient. With
``kl_tau: 0`` ``dppo_binary_tv`` is SkyRL's ``dppo`` (``dppo_type: binary_tv``, ``delta_low/high`` = ``eps_low/high``)
given rollout log-probs, and ``dppo_binary_kl`` SkyRL's ``binary_kl``. verl's ``dppo_kl`` applies the same binary-KL
rule anchored at ``old_logp`` to a detached truncated ratio.

The log-ratio is clamped to ``± log_ratio_clamp`` (20) before ``exp`` and in the KL term; prime-rl clamps
neither, and agrees wherever ``|log r| ≤ 20``. prime-rl sums the per-token loss and divides by the step's global
count of loss tokens (``rl_scale``): lossplug's ``token`` reduction.

Paper: Qi et al., 2026, *Rethinking the Trust Region in LLM Reinforcement Learning* (DPPO, Binary-TV),
arXiv:2602.04879; the squared log-ratio term from Kimi Team, 2026, *Kimi K2.5*, arXiv:2602.02276.

Reference: prime-rl (PrimeIntellect-ai/prime-rl, commit 559b4477), ``src/prime_rl/trainer/rl/loss.py``
(``default_loss_fn``, ``ipo_loss_fn``, ``compute_loss``) and ``packages/prime-rl-configs/src/prime_rl/configs/
trainer.py`` (``DefaultLossConfig``: ``dppo_mask_low/high`` 0.2, ``adv_tau`` 1, ``kl_tau`` 1e-3;
``IPOLossConfig``: ``ipo_threshold`` 0.1); SkyRL 0.3.0 ``skyrl/backends/skyrl_train/utils/ppo_utils.py``
``dppo_policy_loss``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from pydantic import Field

import lossplug
from lossplug.ops import clamp_exact

Tensor = torch.Tensor


def _adv_tau() -> Any:
    return Field(1.0, ge=0, description="adv_tau: the advantage's coefficient (prime-rl: 1.0)")


def _kl_tau() -> Any:
    return Field(1e-3, ge=0, description="kl_tau: coefficient of the squared log-ratio (log r)² (prime-rl: 1e-3)")


def _clamp() -> Any:
    return Field(20.0, gt=0, le=80, description="the log-ratio is clamped to ± this (before exp and in the KL term)")


class DPPOBinaryTVParams(lossplug.Params):
    eps_low: float = Field(
        0.2, ge=0, description="A ≤ 0 tokens whose probability fell by more than this are masked (dppo_mask_low)"
    )
    eps_high: float = Field(
        0.2, ge=0, description="A > 0 tokens whose probability rose by more than this are masked (dppo_mask_high)"
    )
    adv_tau: float = _adv_tau()
    kl_tau: float = _kl_tau()
    log_ratio_clamp: float = _clamp()


class DPPOBinaryKLParams(lossplug.Params):
    eps_low: float = Field(
        0.2, ge=0, description="A < 0 tokens whose probability fell with a binary KL above this are masked (delta_low)"
    )
    eps_high: float = Field(
        0.2, ge=0, description="A > 0 tokens whose probability rose with a binary KL above this are masked (delta_high)"
    )
    adv_tau: float = _adv_tau()
    kl_tau: float = Field(0.0, ge=0, description="kl_tau: coefficient of the squared log-ratio (log r)² (SkyRL: none)")
    log_ratio_clamp: float = _clamp()


class IPOParams(lossplug.Params):
    threshold: float = Field(
        0.1, ge=0, description="tokens whose probability moved by more than this (either way) are masked"
    )
    adv_tau: float = _adv_tau()
    kl_tau: float = _kl_tau()
    log_ratio_clamp: float = _clamp()


def _trust_region(
    inp: lossplug.GateInput,
    p: DPPOBinaryTVParams | DPPOBinaryKLParams | IPOParams,
    keep_of: Callable[[Tensor, Tensor], Tensor],
) -> lossplug.GateOutput:
    """``keep·adv_tau·A·r − kl_tau·(log r)²`` with ``keep = keep_of(Δ, A)`` (computed without gradient)."""
    adv = inp.broadcast_advantage()
    behavior_logp = cast(Tensor, inp.behavior_logp)  # set: declared in requires
    log_ratio = clamp_exact(inp.logp - behavior_logp, -p.log_ratio_clamp, p.log_ratio_clamp)
    with torch.no_grad():
        change = inp.logp.detach().exp() - behavior_logp.exp()  # 0 off the actions
        keep = keep_of(change, adv)
    policy_gradient = torch.where(keep, (p.adv_tau * adv) * log_ratio.exp(), 0)
    objective = policy_gradient - p.kl_tau * log_ratio.square() if p.kl_tau else policy_gradient
    return lossplug.GateOutput(
        objective=objective,
        metrics={
            "mask_frac": lambda: inp.token_fraction(~keep),
            "mask_frac_high": lambda: inp.token_fraction(~keep, adv > 0),
            "mask_frac_low": lambda: inp.token_fraction(~keep, adv < 0),
        },
        # the KL term keeps a gradient on masked tokens; with kl_tau = 0 only the kept ones carry one
        active=(lambda: inp.mask) if p.kl_tau else (lambda: keep),
    )


@lossplug.gate("dppo_binary_tv", params=DPPOBinaryTVParams, requires=("behavior_logp",))
def dppo_binary_tv(inp: lossplug.GateInput, p: DPPOBinaryTVParams) -> lossplug.GateOutput:
    """prime-rl's default: keep·adv_tau·A·r − kl_tau·(log r)², keep = Δp ≤ eps_high (A > 0) / Δp ≥ −eps_low."""

    def keep(change: Tensor, adv: Tensor) -> Tensor:
        return torch.where(adv > 0, change <= p.eps_high, change >= -p.eps_low)

    return _trust_region(inp, p, keep)


@lossplug.gate("dppo_binary_kl", params=DPPOBinaryKLParams, requires=("behavior_logp",))
def dppo_binary_kl(inp: lossplug.GateInput, p: DPPOBinaryKLParams) -> lossplug.GateOutput:
    """DPPO-Binary-KL at the rollout policy: keep·adv_tau·A·r − kl_tau·(log r)², a token masked when it moved the
    way A pushes with a binary KL(μ ‖ p) above eps_high (A > 0) / eps_low (A < 0)."""
    logp, behavior_logp = inp.logp.detach(), cast(Tensor, inp.behavior_logp)

    def keep(change: Tensor, adv: Tensor) -> Tensor:
        prob, mu = logp.exp(), behavior_logp.exp()
        binary_kl = mu * (behavior_logp - logp) + (1 - mu) * torch.log((1 - mu + 1e-8) / (1 - prob + 1e-8))
        rose_too_far = (adv > 0) & (change > 0) & (binary_kl > p.eps_high)
        fell_too_far = (adv < 0) & (change < 0) & (binary_kl > p.eps_low)
        return ~(rose_too_far | fell_too_far)

    return _trust_region(inp, p, keep)


@lossplug.gate("ipo", params=IPOParams, requires=("behavior_logp",))
def ipo(inp: lossplug.GateInput, p: IPOParams) -> lossplug.GateOutput:
    """prime-rl's IPO: keep·adv_tau·A·r − kl_tau·(log r)², keep = |exp(logp) − exp(behavior_logp)| ≤ threshold."""

    def keep(change: Tensor, adv: Tensor) -> Tensor:
        return change.abs() <= p.threshold

    return _trust_region(inp, p, keep)
