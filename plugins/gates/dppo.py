"""DPPO: a policy gradient masked by a binary estimate of the policy divergence instead of PPO's ratio clip.

Per action token, with ``p = exp(logp)``, ``p_old = exp(old_logp)``, ``r = exp(logp − old_logp)`` (log-ratio clamped
to ±20) and the truncated, detached ratio ``w = sg(min(r, ratio_cap))``::

    J = A · w · logp · valid                  ∂J/∂logp = A · w · valid

``valid`` keeps a token whose divergence between the old and the current policy, estimated on the two-outcome
distribution {sampled token, anything else}, stays inside the trust region on the side the advantage pushes:

* ``dppo_tv`` (total variation): ``valid = (p − p_old ≤ eps_high)`` where ``A > 0``, ``(p − p_old ≥ −eps_low)``
  otherwise;
* ``dppo_kl`` (binary KL ``D = p_old·log(p_old/p) + (1 − p_old)·log((1 − p_old + 1e-8)/(1 − p + 1e-8))``):
  ``valid = (D ≤ eps_high) or (p ≤ p_old)`` where ``A > 0``, ``(D ≤ eps_low) or (p ≥ p_old)`` otherwise.

The mask is computed under ``no_grad`` (a constant of the update), so a masked token contributes neither value nor
gradient. Instead of dual-clip the ratio is truncated at ``ratio_cap`` (TIS on the update ratio; the paper
recommends a large cap, its §5.4). ``eps_low``/``eps_high`` are divergence thresholds, not ratio clips — in verl they
are read from ``clip_ratio_low``/``clip_ratio_high``, and ``ratio_cap`` from ``clip_ratio_c`` (3.0 in verl's default
actor config; verl's own fallback without the key is 20).

Detach/gradient contract: ``w`` and ``valid`` are detached; gradient flows through the ``logp`` factor only.

Paper: Qi et al., 2026, *Rethinking the Trust Region in LLM Reinforcement Learning* (DPPO, Binary-TV and
Binary-KL approximations), arXiv:2602.04879.

Reference: verl ``compute_policy_loss_dppo_tv`` and ``compute_policy_loss_dppo_kl`` (``loss_mode=dppo_tv|dppo_kl``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from pydantic import Field

import lossplug
from lossplug.ops import clamp_exact

Tensor = torch.Tensor

#: verl's safety clamp of the log-ratio before exp
LOG_RATIO_CLAMP = 20.0


class DPPOParams(lossplug.Params):
    eps_low: float = Field(
        0.2, gt=0, description="divergence threshold for A ≤ 0 tokens (verl: clip_ratio_low, default 0.2)"
    )
    eps_high: float = Field(
        0.2, gt=0, description="divergence threshold for A > 0 tokens (verl: clip_ratio_high, default 0.2)"
    )
    ratio_cap: float = Field(
        3.0, gt=0, description="the detached update ratio is truncated at this value (verl: clip_ratio_c, 3.0)"
    )


def _dppo(
    inp: lossplug.GateInput, p: DPPOParams, divergence_valid: Callable[[Tensor, Tensor, Tensor], Tensor]
) -> lossplug.GateOutput:
    adv = inp.broadcast_advantage()
    logp = inp.logp
    with torch.no_grad():
        log_ratio = inp.update_log_ratio().detach()
        ratio = clamp_exact(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        weight = ratio.clamp(max=p.ratio_cap)
        valid = divergence_valid(logp.detach(), cast(Tensor, inp.old_logp), adv)
        # the detached coefficient of logp: A · w · valid (valid ∈ {0, 1})
        coefficient = torch.where(valid, adv * weight, 0)
    objective = coefficient * logp
    return lossplug.GateOutput(
        objective=objective,
        metrics={
            # verl's pg_clipfrac (tokens outside the trust region) and pg_clipfrac_lower (kept tokens truncated)
            "mask_frac": lambda: inp.token_fraction(~valid),
            "trunc_frac": lambda: inp.token_fraction(ratio > p.ratio_cap, valid),
        },
        active=lambda: valid,
    )


@lossplug.gate("dppo_tv", params=DPPOParams, requires=("old_logp",))
def dppo_tv(inp: lossplug.GateInput, p: DPPOParams) -> lossplug.GateOutput:
    """DPPO-Binary-TV: A·sg(min(r, cap))·logp where p − p_old stays within [−eps_low, eps_high] on A's side."""

    def valid(logp: Tensor, old_logp: Tensor, adv: Tensor) -> Tensor:
        change = logp.exp() - old_logp.exp()
        return torch.where(adv > 0, change <= p.eps_high, change >= -p.eps_low)

    return _dppo(inp, p, valid)


@lossplug.gate("dppo_kl", params=DPPOParams, requires=("old_logp",))
def dppo_kl(inp: lossplug.GateInput, p: DPPOParams) -> lossplug.GateOutput:
    """DPPO-Binary-KL: A·sg(min(r, cap))·logp where the binary KL(p_old ‖ p) stays within eps on A's side."""

    def valid(logp: Tensor, old_logp: Tensor, adv: Tensor) -> Tensor:
        prob, old_prob = logp.exp(), old_logp.exp()
        binary_kl = old_prob * (old_logp - logp) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
        )
        return torch.where(
            adv > 0, (binary_kl <= p.eps_high) | (prob <= old_prob), (binary_kl <= p.eps_low) | (prob >= old_prob)
        )

    return _dppo(inp, p, valid)
