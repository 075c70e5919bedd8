"""CISPO with PPO's trust-region mask (ROLL's ``cispo_use_unified_mask``): the clipped, detached importance weight
of CISPO, and no gradient at all for the tokens PPO's clip would cut.

Objective per action token, with ``r = exp(logp − old_logp)`` and advantage ``A``::

    w    = sg(clip(r, 1 − eps_low, 1 + eps_high))
    keep = not (A > 0 and r > 1 + eps_high)  and  not (A < 0 and r < 1 − eps_low)
    J    = keep · w · A · logp                 ∂J/∂logp = keep · w · A

Plain CISPO keeps every token's gradient (the clip only saturates its weight); the unified mask drops the tokens
that already moved past the trust region *in the advantage's direction* — the ones PPO's ``min`` cuts — and keeps
the others with CISPO's weight. Unlike PPO, a token on the inner side (``A > 0``, ``r < 1 − eps_low``) keeps the
clipped weight ``1 − eps_low``, not ``r``.

Detach/gradient contract: ``w`` and ``keep`` are constants of the update (computed under ``no_grad``), the advantage
and ``old_logp`` are constants; gradient flows through the ``logp`` factor only, on the kept tokens.

Numerics: the log-ratio is clamped to ``± log_ratio_clamp`` before ``exp`` (``null``: not clamped, as ROLL); the
mask reads the same ratio.

Paper: MiniMax, 2025, *MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention*, arXiv:2506.13585
(CISPO).

Reference: ROLL (alibaba/ROLL, commit 8eb27cc2), ``roll/pipeline/rlvr/actor_pg_worker.py``
``ActorPGWorker._compute_cispo_loss`` (``pg_variant: cispo``, ``cispo_epsilon_low``/``cispo_epsilon_high`` default
0.1, ``cispo_use_unified_mask: true``): ``−clipped_ratio.detach() · A · logp · token_mask``.
"""

from __future__ import annotations

import torch
from pydantic import Field

import lossplug
from lossplug.ops import clamp_exact, count_actions


class CISPOMaskedParams(lossplug.Params):
    eps_low: float = Field(0.1, gt=0, le=1, description="the weight's lower bound is 1 − eps_low (ROLL: 0.1)")
    eps_high: float = Field(0.1, gt=0, description="the weight's upper bound is 1 + eps_high (ROLL: 0.1)")
    log_ratio_clamp: float | None = Field(
        20.0, gt=0, description="the log-ratio is clamped to ± this before exp (null: not clamped, as ROLL)"
    )


@lossplug.gate("cispo_masked", params=CISPOMaskedParams, requires=("old_logp",))
def cispo_masked(inp: lossplug.GateInput, p: CISPOMaskedParams) -> lossplug.GateOutput:
    """CISPO, masked: keep·sg(clip(r, 1−eps_low, 1+eps_high))·A·logp, keep = not (A > 0, r > 1+eps_high) and not
    (A < 0, r < 1−eps_low)."""
    adv = inp.broadcast_advantage()
    low, high = 1.0 - p.eps_low, 1.0 + p.eps_high
    with torch.no_grad():
        log_ratio = inp.update_log_ratio().detach()
        if p.log_ratio_clamp is not None:
            log_ratio = clamp_exact(log_ratio, -p.log_ratio_clamp, p.log_ratio_clamp)
        ratio = log_ratio.exp()
        cut_high, cut_low = (adv > 0) & (ratio > high), (adv < 0) & (ratio < low)
        keep = ~(cut_high | cut_low)
        weight = torch.where(keep, ratio.clamp(min=low, max=high), torch.zeros_like(ratio))
    objective = weight.detach() * adv * inp.logp

    def fraction(cut: torch.Tensor) -> torch.Tensor:
        return count_actions(cut, inp.mask, inp.lengths) / inp.action_tokens

    return lossplug.GateOutput(
        objective=objective,
        metrics={
            "clip_frac": lambda: fraction(cut_high | cut_low),
            "clip_frac_low": lambda: fraction(cut_low),
            "clip_frac_high": lambda: fraction(cut_high),
        },
        active=lambda: keep & inp.mask,
    )
