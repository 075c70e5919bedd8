"""Outlier rejection on the train–inference mismatch: a response any of whose tokens has an extreme engine ratio is
dropped whole.

A detached correction on the **engine ratio** (``log ρ_t = old_logp_t − behavior_logp_t``: the training engine's
log-prob of the sampled token against the rollout engine's). Per response ``i``::

    w_i = 1   if  low ≤ ρ_it ≤ high  for every action token t of the response
    w_i = 0   otherwise                                   (either bound may be null)

broadcast to the response's tokens (``[B, T]``, token level). Unlike a bound on a sequence statistic (the product or
the geometric mean of the ratios, :mod:`rollout_rs <lossplug.plugins.gates.rollout_rejection>`), one token far out
of range — a token the rollout engine found ``10⁴`` times less likely than the trainer does — rejects the response,
however ordinary the rest of it is; ``rollout_rs``'s per-response maxima are k2/k3 statistics, symmetric in
``log ρ``, where these bounds are not (SkyRL suggests ``1e-4`` and ``100``). The weight is 0 or 1: a dropped
response stays in the reduction's population, as SkyRL's (whose reduction is folded into the advantages before the
mask is applied). Gradient flows only through the update gate's ``logp``.

Numerics: ``ρ_t = exp(clamp(log ρ_t, ±log_ratio_clamp))`` (SkyRL's ``safe_exp_delta``, clamp 20) is compared with
the bounds, so a bound beyond ``e^{±20}`` never binds.

Paper: Yao et al., 2025, *Your Efficient RL Framework Secretly Brings You Off-Policy RL Training*,
https://fengyao.notion.site/off-policy-rl (the engine mismatch); Liu et al., 2025, *When Speed Kills Stability:
Demystifying RL Collapse from the Training-Inference Mismatch*, https://richardli.xyz/rl-collapse (rejecting
responses with extreme token ratios).

Reference: SkyRL 0.3.0 (``pip download --no-deps skyrl==0.3.0``),
``skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py`` ``compute_outlier_token_mask``
(``off_policy_correction.outlier_token_is_threshold_low`` / ``_high``, default off; applied to ``loss_mask``).
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.ops import clamp_exact, response_stats


class OutlierMaskParams(lossplug.Params):
    low: float | None = Field(
        1e-4, gt=0, description="a response with a token ratio below this is dropped (SkyRL's suggestion; null: none)"
    )
    high: float | None = Field(
        100.0, gt=0, description="a response with a token ratio above this is dropped (SkyRL's suggestion; null: none)"
    )
    log_ratio_clamp: float = Field(
        20.0, gt=0, le=80, description="the engine log-ratio is clamped to ± this before exp (SkyRL: 20)"
    )

    @model_validator(mode="after")
    def _a_bound(self) -> OutlierMaskParams:
        if self.low is None and self.high is None:
            raise ValueError("set low, high or both: without a bound the gate drops nothing")
        if self.low is not None and self.high is not None and not self.low <= self.high:
            raise ValueError(f"low ({self.low}) must not be above high ({self.high})")
        return self


@lossplug.gate(
    "outlier_sequence_mask",
    params=OutlierMaskParams,
    requires=("old_logp", "behavior_logp"),
    role="correction",
    level="token",
)
def outlier_sequence_mask(inp: lossplug.GateInput, p: OutlierMaskParams) -> lossplug.GateOutput:
    """Outlier mask: detached weight 1 on a response whose every token has low ≤ ρ_t ≤ high, else 0;
    ρ_t = π_old/π_behaviour."""
    with torch.no_grad():
        ratio = clamp_exact(inp.engine_log_ratio(), -p.log_ratio_clamp, p.log_ratio_clamp).exp()
        over = (ratio > p.high) & inp.mask if p.high is not None else torch.zeros_like(inp.mask)
        under = (ratio < p.low) & inp.mask if p.low is not None else torch.zeros_like(inp.mask)
        keep = ~(over | under).any(-1)  # [B]
        weight = keep.unsqueeze(-1).expand_as(ratio).to(ratio.dtype)
    return lossplug.GateOutput(
        weight=weight.detach(),
        metrics={
            # SkyRL's outlier_seq_masked_ratio / _over_high_ratio / _under_low_ratio
            "mask_frac": lambda: inp.response_fraction(~keep),
            "over_high_frac": lambda: inp.response_fraction(over.any(-1)),
            "under_low_frac": lambda: inp.response_fraction(under.any(-1)),
        },
        details={**response_stats("ratio", ratio, inp.mask)},
        active=lambda: keep.unsqueeze(-1) & inp.mask,
    )
