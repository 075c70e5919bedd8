"""A trust region on the train–inference mismatch: drop the tokens (or responses) whose sampled-token probability
differs too much between the rollout engine and the training engine, weigh the kept ones by their engine ratio.

A detached correction on the **engine** pair (``behavior_logp``: the rollout engine that sampled the token;
``old_logp``: the training engine, same weights). Per action token, with ``p = exp(behavior_logp)`` and
``q = exp(old_logp)`` both clamped to ``[1e-6, 1 − 1e-6]`` (so the binary-KL logs stay finite)::

    binary_kl_t = p·log(p/q) + (1 − p)·log((1 − p)/(1 − q))      (the KL of the two Bernoulli "this token or not")
    tv_t        = |p − q|                                         (their total variation)
    stat        = the divergence per token (level token) or its mean over the response's action tokens (sequence)
    w_t         = ρ_t · 1[stat ≤ delta] · 1[|log ρ_t| < log_ratio_clamp]     ρ_t = exp(old_logp_t − behavior_logp_t)

Unlike a ratio bound, the divergence of a token both engines find unlikely stays small however large its ratio:
the region is on probabilities, not ratios (FlashREINFORCE's gate on the per-response mean binary KL). The weight is
``[B, T]`` and detached; gradient flows only through the update gate's ``logp``; it is 0 on dropped tokens, which
stay in the reduction's population (OpenRLHF's denominators count them too).

Numerics: a token whose engine log-ratio reaches ``± log_ratio_clamp`` (20) is dropped (weight 0: ``e^20`` would be
an overflow, not a correction — a token both engines find unlikely has a small divergence whatever its ratio);
OpenRLHF does not clamp, and agrees wherever ``|log ρ_t| < 20``.

Paper: Yao et al., 2025, *Your Efficient RL Framework Secretly Brings You Off-Policy RL Training*,
https://fengyao.notion.site/off-policy-rl (the engine mismatch and its importance weight).

Reference: OpenRLHF 0.11.2 (``pip download --no-deps 'openrlhf>=0.11,<0.12'``), ``openrlhf/models/loss.py``
``PolicyLoss.forward`` (``is_correction_gating: binary_kl`` or ``tv``, ``is_correction_level: token`` or ``seq``,
``is_correction_mode: mask``, ``is_correction_threshold: [0, delta]``): ``coef = where(stat ≤ delta, token_is, 0)``.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

import lossplug
from lossplug.ops import clamp_exact, response_stats

Tensor = torch.Tensor

#: OpenRLHF's probability clamp: keeps log(p/q) and log((1 − p)/(1 − q)) finite
PROB_CLAMP = 1e-6


class EngineDivergenceParams(lossplug.Params):
    divergence: Literal["binary_kl", "tv"] = Field(
        "binary_kl", description="binary_kl: the KL of the sampled-token Bernoullis p, q; tv: their absolute difference"
    )
    level: Literal["token", "sequence"] = Field(
        "token", description="token: drop the token; sequence: the response's mean divergence drops it whole"
    )
    delta: float = Field(0.01, gt=0, description="the largest divergence kept (OpenRLHF's is_correction_threshold)")
    log_ratio_clamp: float = Field(
        20.0, gt=0, le=80, description="the engine log-ratio is clamped to ± this before exp (the weight only)"
    )


def engine_divergence(inp: lossplug.GateInput, kind: str) -> Tensor:
    """The per-token divergence between the rollout engine's and the training engine's sampled-token probability,
    ``[B, T]``, 0 off the actions."""
    p = inp.behavior_logp.exp().clamp(PROB_CLAMP, 1 - PROB_CLAMP)  # type: ignore[union-attr]  # required
    q = inp.old_logp.exp().clamp(PROB_CLAMP, 1 - PROB_CLAMP)  # type: ignore[union-attr]  # required
    if kind == "tv":
        stat = (p - q).abs()
    else:
        stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
    return torch.where(inp.mask, stat, torch.zeros_like(stat))


@lossplug.gate(
    "engine_divergence_mask",
    params=EngineDivergenceParams,
    requires=("old_logp", "behavior_logp"),
    role="correction",
    level="token",
)
def engine_divergence_mask(inp: lossplug.GateInput, p: EngineDivergenceParams) -> lossplug.GateOutput:
    """Engine trust region: detached weight ρ_t·1[D ≤ delta], D the binary KL or TV of exp(behavior_logp) and
    exp(old_logp), per token or averaged over the response; ρ_t = π_old/π_behaviour."""
    with torch.no_grad():
        stat = engine_divergence(inp, p.divergence)
        if p.level == "sequence":
            stat = (stat.sum(-1) / inp.lengths.clamp(min=1).to(stat.dtype)).unsqueeze(-1).expand_as(stat)
        log_ratio = inp.engine_log_ratio()
        # a token whose engine log-ratio reaches the clamp is dropped too: its weight would be e^20 or more — an
        # overflow, not a correction (both engines find it unlikely, so its divergence alone would keep it)
        keep = (stat <= p.delta) & (log_ratio.abs() < p.log_ratio_clamp)
        ratio = clamp_exact(log_ratio, -p.log_ratio_clamp, p.log_ratio_clamp).exp()
        weight = torch.where(keep, ratio, torch.zeros_like(ratio))
    dropped = ~keep & inp.mask
    return lossplug.GateOutput(
        weight=weight.detach(),
        metrics={
            "mask_token_frac": lambda: inp.token_fraction(dropped),
            "divergence_mean": lambda: torch.where(inp.mask, stat, 0).sum() / inp.mask.sum().clamp(min=1),
        },
        details={**response_stats("ratio", ratio, inp.mask)},
        active=lambda: keep & inp.mask,
    )
