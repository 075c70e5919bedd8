"""GSPO: the length-normalised sequence ratio, clipped at sequence level (Zheng et al., 2025, arXiv:2507.18071).

With ``|y_i|`` the action tokens of response ``i`` and ``log r_it = logp_it − old_logp_it``, the sequence ratio is the
geometric mean of the token ratios, computed in log space (a product of T ratios over- or underflows)::

    s_i = exp( Σ_t log r_it / |y_i| )                                     (log clamped to ± log_ratio_clamp)

``gspo`` (sequence level) — the paper's objective, broadcast to the response's action tokens::

    J_it = min(s_i·A_it, clip(s_i, 1 − eps_low, 1 + eps_high)·A_it)

``s_i`` carries the gradient of *every* token of response ``i``: ∂s_i/∂logp_iu = s_i / |y_i|. The clip decision is
one per response (and advantage sign): a response is kept or saturated as a whole.

``delta`` (optional, TRL's ``delta`` — INTELLECT-2's two-sided clip) caps the unclipped branch::

    J_it = min(min(s_i, δ)·A_it, clip(s_i, 1 − eps_low, 1 + eps_high)·A_it)

so a negative-advantage response whose ratio exceeds ``δ`` contributes ``δ·A`` and no gradient (TRL:
``coef_1 = clamp(coef_1, max=delta)`` after ``coef_2`` is taken from the unclamped ratio). ``null`` (the default)
leaves the objective above bit for bit.

``gspo_token`` (GSPO-token, as verl's ``compute_policy_loss_gspo`` implements it)::

    s_it = sg(s_i) · π_θ(y_it) / sg(π_θ(y_it))     i.e.  log s_it = sg(log s_i) + logp_it − sg(logp_it)
    J_it = min(s_it·A_it, clip(s_it, 1 − eps_low, 1 + eps_high)·A_it)

Its value equals ``s_i`` but each token's gradient flows only through its own ``logp_it`` (∂s_it/∂logp_it = s_i), so
token-level advantages are meaningful. With an advantage that is constant over a response and a reduction that
weighs a response's tokens equally (all built-in reductions), ``gspo`` and ``gspo_token`` give the same loss and the
same gradient.

Detach/gradient contract: ``old_logp`` and the advantage are constants (explicitly detached); gradient flows through
``logp`` only. Defaults: clip range 3e-4 / 4e-4 (the paper's, used by verl's GSPO example scripts) and a log-ratio
clamp of 10 (verl clamps the log sequence ratio at 10 in ``compute_policy_loss_gspo``), so log-ratios of ±100 give
finite losses and gradients. Empty responses are rejected by the batch contract; with ``validate="off"`` an empty
response gets ``s_i = 1`` (its length is clamped to 1 and its log-ratio sum is 0) and contributes nothing.

Paper: Zheng et al., 2025, *Group Sequence Policy Optimization*, arXiv:2507.18071 (GSPO and GSPO-token).

Reference: verl ``compute_policy_loss_gspo`` (``loss_mode=gspo``); TRL ``importance_sampling_level="sequence"``
(``delta``: TRL ``GRPOTrainer._compute_loss``; Prime Intellect, 2025, *INTELLECT-2*, arXiv:2505.07291).
"""

from __future__ import annotations

import functools

import torch
from pydantic import Field

import lossplug
from lossplug.ops import any_rows, clamp_exact, response_stats


class GSPOParams(lossplug.Params):
    eps_low: float = Field(
        3e-4, gt=0, lt=1, description="lower clip: sequence ratios below 1 − eps_low are cut when A < 0 (paper: 3e-4)"
    )
    eps_high: float = Field(
        4e-4, gt=0, description="upper clip: sequence ratios above 1 + eps_high are cut when A > 0 (paper: 4e-4)"
    )
    log_ratio_clamp: float = Field(
        10.0, gt=0, le=80, description="the log sequence ratio is clamped to ± this before exp (verl: 10)"
    )
    delta: float | None = Field(
        None,
        gt=0,
        description="cap on the unclipped branch: min(min(s, delta)·A, clip(s)·A) (TRL's delta, INTELLECT-2); "
        "null: none",
    )


def _sequence_log_ratio(inp: lossplug.GateInput) -> torch.Tensor:
    """mean_t(logp − old_logp) over each response's action tokens, ``[B]`` (carries the gradient of ``logp``).

    Both are zero off the actions in a GateInput (the pipeline's cleaning; value and gradient), so their difference
    is too: no mask pass is needed."""
    log_ratio = inp.update_log_ratio()
    return log_ratio.sum(-1) / inp.lengths.clamp(min=1).to(log_ratio.dtype)


def _clipped(ratio: torch.Tensor, adv: torch.Tensor, p: GSPOParams) -> torch.Tensor:
    """min(s·A, clip(s, 1 − eps_low, 1 + eps_high)·A), with ``delta``: min(min(s, δ)·A, clip(s)·A)."""
    clipped = ratio.clamp(1 - p.eps_low, 1 + p.eps_high) * adv
    unclipped = ratio if p.delta is None else ratio.clamp(max=p.delta)
    return torch.minimum(unclipped * adv, clipped)


def _output(
    inp: lossplug.GateInput,
    p: GSPOParams,
    objective: torch.Tensor,
    ratio: torch.Tensor,
    adv: torch.Tensor,
    seq_ratio: torch.Tensor,
    per_response: bool,
) -> lossplug.GateOutput:
    """The objective with its declared metrics: the cut fractions over the action tokens (a ratio outside the range
    on the side A's sign guards), at ``full`` also the sequence ratio's mean and range over responses and ``active``.

    ``ratio``/``adv`` are ``[B, 1]`` per response (counted once per action token through the lengths) or ``[B, T]``
    with the advantage zero off the actions (never counted there: ``A < 0``/``A > 0`` fail)."""

    @functools.cache
    def cut() -> tuple[torch.Tensor, torch.Tensor]:
        r = ratio.detach()
        return (r < 1 - p.eps_low) & (adv < 0), (r > 1 + p.eps_high) & (adv > 0)

    @functools.cache
    def capped() -> torch.Tensor:
        # with delta: a ratio above δ where A < 0 takes the constant branch δ·A (no gradient)
        return (
            (ratio.detach() > p.delta) & (adv < 0) if p.delta is not None else torch.zeros_like(adv, dtype=torch.bool)
        )

    def active() -> torch.Tensor:
        low, high = cut()
        kept = ~(low | high | capped()) if p.delta is not None else ~(low | high)
        # a response still carries gradient if any of its action tokens is not cut
        return any_rows(kept & inp.mask) if per_response else kept

    return lossplug.GateOutput(
        objective=objective,
        metrics={
            "clip_frac_low": lambda: inp.token_fraction(cut()[0], false_off_actions=True),
            "clip_frac_high": lambda: inp.token_fraction(cut()[1], false_off_actions=True),
            **({"delta_frac": lambda: inp.token_fraction(capped(), false_off_actions=True)} if p.delta else {}),
        },
        details=response_stats("seq_ratio", seq_ratio.detach(), inp.lengths > 0),
        active=active,
    )


@lossplug.gate("gspo", params=GSPOParams, requires=("old_logp",), level="sequence")
def gspo(inp: lossplug.GateInput, p: GSPOParams) -> lossplug.GateOutput:
    """GSPO: min(s·A, clip(s, 1−eps_low, 1+eps_high)·A) with s = exp(mean_t log r_t), clipped per response."""
    seq_ratio = _sequence_log_ratio(inp).clamp(-p.log_ratio_clamp, p.log_ratio_clamp).exp()
    ratio = seq_ratio.unsqueeze(-1)
    if inp.seq_advantage is not None:
        # a [B] advantage: the objective is one value per response, computed on [B] and broadcast once (the same
        # values on the actions; the pipeline zeroes it off them)
        adv = inp.seq_advantage.unsqueeze(-1)
        objective = _clipped(ratio, adv, p).expand(inp.mask.shape)
    else:
        adv = inp.advantage
        objective = _clipped(ratio, adv, p)
    return _output(inp, p, objective, ratio, adv, seq_ratio, per_response=True)


@lossplug.gate("gspo_token", params=GSPOParams, requires=("old_logp",), level="token")
def gspo_token(inp: lossplug.GateInput, p: GSPOParams) -> lossplug.GateOutput:
    """GSPO-token: s_t = sg(s)·π_θ/sg(π_θ), clipped like GSPO; each token's gradient flows through its own logp."""
    adv = inp.advantage
    seq_log_ratio = _sequence_log_ratio(inp).detach()
    log_ratio = inp.logp - inp.logp.detach() + seq_log_ratio.unsqueeze(-1)
    ratio = clamp_exact(log_ratio, -p.log_ratio_clamp, p.log_ratio_clamp).exp()
    seq_ratio = seq_log_ratio.clamp(-p.log_ratio_clamp, p.log_ratio_clamp).exp()
    return _output(inp, p, _clipped(ratio, adv, p), ratio, adv, seq_ratio, per_response=False)
