"""SAPO: a smooth, sign-asymmetric gate instead of a hard clip (Gao et al., 2025, arXiv:2511.20347).

Per action token, with ``r = exp(logp − old_logp)`` (log-ratio clamped to ``± log_ratio_clamp``, verl's 20; TRL
clamps nothing: ``log_ratio_clamp: null``) and ``τ = tau_pos`` where ``A > 0``, ``τ = tau_neg`` otherwise::

    J = (4/τ) · σ(τ·(r − 1)) · A

The loss itself is the sigmoid surrogate; ``sech²`` only appears in its derivative. With respect to ``logp``::

    ∂J/∂logp = r · sech²(τ·(r − 1)/2) · A          (= 4·σ(x)·σ(−x)·r·A with x = τ·(r − 1))

so the gradient gate is 1 at ``r = 1`` and decays smoothly as the ratio leaves 1 — faster on the side of the larger
temperature. Note that at ``r = 1`` the objective's *value* is ``2A/τ``, not ``A``: only its gradient matches the
policy gradient there. Nothing is clipped, so no token is dropped outright; ``active`` marks the tokens whose
gradient gate is not exactly zero (it underflows to 0 only for extreme ratios).

``sapo_seq`` uses GSPO's sequence ratio ``s_i = exp(mean_t log r_it)`` in place of ``r`` (TRL
``importance_sampling_level="sequence"``): ``J_it = (4/τ)·σ(τ·(s_i − 1))·A_it``, whose gradient reaches every token
of the response through ``s_i`` (∂s_i/∂logp_it = s_i/|y_i|).

Defaults ``tau_pos = 1.0``, ``tau_neg = 1.05``: the SAPO paper's values, and the defaults of both TRL
(``sapo_temperature_pos/neg``) and verl (``actor.tau_pos/tau_neg``). ``tau_neg > tau_pos`` damps off-policy
negative-advantage updates faster, which the paper found stabilising. verl always reduces SAPO with
``seq-mean-token-mean`` (lossplug's ``response`` reduction), whatever ``loss_agg_mode`` says; TRL's ``sapo`` loss
uses the same per-response mean.

Detach/gradient contract: ``old_logp`` and the advantage are constants (explicitly detached); gradient flows through
``logp`` only.

Paper: Gao et al., 2025, *Soft Adaptive Policy Optimization*, arXiv:2511.20347.

Reference: verl ``compute_policy_loss_sapo``; TRL ``loss_type="sapo"`` (``importance_sampling_level`` token or
sequence).
"""

from __future__ import annotations

import functools

import torch
from pydantic import Field

import lossplug
from lossplug.ops import any_rows, clamp_exact


class SAPOParams(lossplug.Params):
    tau_pos: float = Field(1.0, gt=0, le=100, description="temperature τ for tokens with A > 0 (TRL, verl: 1.0)")
    tau_neg: float = Field(1.05, gt=0, le=100, description="temperature τ for tokens with A ≤ 0 (TRL, verl: 1.05)")
    log_ratio_clamp: float | None = Field(
        20.0, gt=0, le=80, description="the log-ratio is clamped to ± this before exp (verl: 20); null: no clamp (TRL)"
    )


@lossplug.gate("sapo", params=SAPOParams, requires=("old_logp",))
def sapo(inp: lossplug.GateInput, p: SAPOParams) -> lossplug.GateOutput:
    """SAPO: (4/τ)·σ(τ(r−1))·A with τ = tau_pos for A > 0, tau_neg otherwise; gradient r·sech²(τ(r−1)/2)·A."""
    log_ratio = inp.update_log_ratio()
    if p.log_ratio_clamp is not None:
        log_ratio = clamp_exact(log_ratio, -p.log_ratio_clamp, p.log_ratio_clamp)
    return _sapo(inp, p, log_ratio.exp(), per_response=False)


@lossplug.gate("sapo_seq", params=SAPOParams, requires=("old_logp",), level="sequence")
def sapo_seq(inp: lossplug.GateInput, p: SAPOParams) -> lossplug.GateOutput:
    """SAPO on the sequence ratio: (4/τ)·σ(τ(s−1))·A with s = exp(mean_t log r_t), carrying every token's gradient.

    The soft gate of SAPO applied to GSPO's length-normalised sequence ratio, one per response; ∂s/∂logp_t = s/|y|.
    TRL's ``loss_type="sapo"`` with ``importance_sampling_level="sequence"``: ``{name: sapo_seq, tau_pos:
    sapo_temperature_pos, tau_neg: sapo_temperature_neg, log_ratio_clamp: null}`` (TRL clamps nothing).

    Paper: Gao et al., 2025, *Soft Adaptive Policy Optimization*, arXiv:2511.20347 (its sequence-level variant);
    the sequence ratio of Zheng et al., 2025, *Group Sequence Policy Optimization*, arXiv:2507.18071.

    Reference: TRL ``GRPOTrainer._compute_loss`` (``loss_type="sapo"``, ``importance_sampling_level="sequence"``).
    """
    log_ratio = inp.update_log_ratio()
    # mean over each response's action tokens (0 off them), [B, 1], carrying every token's gradient
    seq_log_ratio = log_ratio.sum(-1, keepdim=True) / inp.lengths.clamp(min=1).unsqueeze(-1).to(log_ratio.dtype)
    if p.log_ratio_clamp is not None:
        seq_log_ratio = seq_log_ratio.clamp(-p.log_ratio_clamp, p.log_ratio_clamp)
    return _sapo(inp, p, seq_log_ratio.exp(), per_response=True)


@functools.lru_cache(maxsize=32)
def _temperatures(
    tau_pos: float, tau_neg: float, dtype: torch.dtype, device: torch.device
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``(τ_pos, τ_neg)`` and ``(4/τ_pos, 4/τ_neg)`` as 0-d tensors of ``dtype``: 4/τ divided in ``dtype``, exactly as
    ``4 / tau`` of a ``dtype`` tensor (scaling by 4 is exact), so the objective's values do not depend on whether the
    coefficients are made per call or once."""
    positive, negative = (torch.full((), tau, dtype=dtype, device=device) for tau in (tau_pos, tau_neg))
    return (positive, negative), (4 / positive, 4 / negative)


def _sapo(inp: lossplug.GateInput, p: SAPOParams, ratio: torch.Tensor, *, per_response: bool) -> lossplug.GateOutput:
    """The objective (4/τ)·σ(τ(ratio − 1))·A, ``[B, T]``, and its diagnostics; ``ratio`` is ``[B, T]`` or a per-response
    ``[B, 1]`` column."""
    adv = inp.broadcast_advantage()  # a [B] advantage: τ and A are [B, 1] columns
    positive = adv > 0
    # τ and 4/τ in the ratio's dtype (not float32), chosen per position from the two values of each
    (tau_pos, tau_neg), (scale_pos, scale_neg) = _temperatures(p.tau_pos, p.tau_neg, ratio.dtype, ratio.device)
    tau = torch.where(positive, tau_pos, tau_neg)
    # (4/τ)·A is a constant of the update: one [B, 1] (or [B, T]) coefficient, one multiplication carrying gradient
    shifted = ratio - 1
    # in place (one [B, T] buffer fewer) unless τ is wider than the ratio ([B, 1] ratio, [B, T] advantage)
    shifted = shifted.mul_(tau) if tau.shape[-1] in (1, shifted.shape[-1]) else shifted * tau
    coefficient = torch.where(positive, scale_pos, scale_neg) * adv
    # a [B, T] ratio or advantage: (4/τ)·A zero off the actions ([B, T] already when A is: the cleaned advantage),
    # so that the objective is +0 there (σ is finite) and the pipeline's zero-off is not needed
    # (GateOutput.zero_off_actions)
    zeroed = ratio.shape == inp.mask.shape or adv.shape == inp.mask.shape
    if zeroed and coefficient.shape != inp.mask.shape:
        coefficient = inp.on_actions(coefficient)
    objective = torch.sigmoid(shifted) * coefficient
    if objective.shape != inp.mask.shape:  # a [B, 1] ratio and a [B] advantage: one value per response
        objective = objective.expand(inp.mask.shape)

    # nothing is cut: the gate's diagnostics are distributions of its gradient gate, at metrics="full" only
    @functools.cache
    def gradient_gate() -> torch.Tensor:
        x = tau * (ratio.detach() - 1)
        return (4 * torch.sigmoid(x) * torch.sigmoid(-x)).expand(inp.mask.shape)  # sech²(x/2)

    mask = inp.mask
    return lossplug.GateOutput(
        objective=objective,
        zero_off_actions=zeroed,
        details={
            "gate_mean": lambda: inp.masked_mean(gradient_gate()),
            "gate_min": lambda: torch.where(mask, gradient_gate(), float("inf")).min(),
            # tokens whose gradient is damped by more than half
            "soft_frac": lambda: inp.token_fraction(gradient_gate() < 0.5),
        },
        # per token, or per response for the sequence ratio (a response carries gradient if any token does)
        active=lambda: any_rows((gradient_gate() > 0) & mask) if per_response else gradient_gate() > 0,
    )
