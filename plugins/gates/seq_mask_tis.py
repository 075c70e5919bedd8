"""seq-mask-tis: keep or drop a whole response by its geometric-mean engine ratio, weigh kept tokens by their own.

A detached correction of the train–inference mismatch on the **engine ratio** (``log ρ_t = old_logp_t −
behavior_logp_t``, as :mod:`tis <lossplug.plugins.gates.corrections>` and ``icepop``). Per response ``i`` and
action token ``t``::

    g_i  = exp(mean_t log ρ_it)                          (geometric mean of the response's token ratios)
    w_it = 1[low ≤ g_i ≤ high] · ρ_it                    (ρ_it not truncated)

The sequence statistic only *filters*: a response whose geometric-mean ratio leaves ``[low, high]`` gets weight 0
on every token; a kept response keeps the raw token ratios as its weights. The weight is ``[B, T]`` (token level)
and detached; gradient flows only through the update gate's ``logp``.

Numerics: the token ratio is ``exp`` of the log-ratio clamped to ``± log_ratio_clamp`` (20 by default); the mask
reads the unclamped mean. OpenRLHF exponentiates without a clamp (its weight overflows to inf past log ρ ≈ 88.7 in
float32, and ``0 · inf`` is NaN in a dropped response); NeMo-RL maps a non-finite weight to 0. Both agree with this
gate wherever ``|log ρ_t| ≤ log_ratio_clamp``.

Paper: Liu, Li, Fu, Wang, Liu, Shen, 2025, *When Speed Kills Stability: Demystifying RL Collapse from the
Training-Inference Mismatch*, https://richardli.xyz/rl-collapse (sequence-level masking by the geometric-mean
ratio).

Reference: OpenRLHF 0.11.0 (``pip download openrlhf==0.11.0``), ``openrlhf/models/loss.py`` ``PolicyLoss.forward``
(``vllm_is_correction_type="seq-mask-tis"``, ``vllm_is_truncated_threshold=[low, high]``; CLI
``--algo.advantage.is_correction_type seq-mask-tis``, ``--algo.advantage.is_correction_threshold`` default
``0.5 5.0``) — the same rule in OpenRLHF 0.11.2 as ``is_correction_level: seq``, ``is_correction_mode: mask``,
``is_correction_gating: ratio`` (``is_correction_threshold: [low, high]``), whose ``torch.where`` gives 0, not NaN,
in a dropped response; NeMo-RL (NVIDIA-NeMo/RL, commit 7ea279ab) ``nemo_rl/algorithms/loss/loss_functions.py``
``ClippedPGLossFn`` (``truncated_importance_sampling_type: seq-mask-tis``, ``truncated_importance_sampling_ratio_min``
= low, ``truncated_importance_sampling_ratio`` = high, with ``use_importance_sampling_correction: true``).
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.ops import clamp_exact, response_stats


class SeqMaskTISParams(lossplug.Params):
    low: float = Field(
        0.5, gt=0, description="responses whose geometric-mean engine ratio is below low are dropped (OpenRLHF: 0.5)"
    )
    high: float = Field(
        5.0, gt=0, description="responses whose geometric-mean engine ratio is above high are dropped (OpenRLHF: 5.0)"
    )
    log_ratio_clamp: float = Field(
        20.0, gt=0, le=80, description="the token engine log-ratio is clamped to ± this before exp (the weight only)"
    )

    @model_validator(mode="after")
    def _ordered(self) -> SeqMaskTISParams:
        if not self.low <= self.high:
            raise ValueError(f"low ({self.low}) must not be above high ({self.high})")
        return self


@lossplug.gate(
    "seq_mask_tis", params=SeqMaskTISParams, requires=("old_logp", "behavior_logp"), role="correction", level="token"
)
def seq_mask_tis(inp: lossplug.GateInput, p: SeqMaskTISParams) -> lossplug.GateOutput:
    """seq-mask-tis: detached weight 1[low ≤ exp(mean_t log ρ_t) ≤ high]·ρ_t, ρ_t = π_old/π_behaviour."""
    with torch.no_grad():
        log_ratio = inp.engine_log_ratio()  # 0 off the actions
        seq_log_ratio = log_ratio.sum(-1) / inp.lengths.clamp(min=1).to(log_ratio.dtype)  # [B]
        seq_ratio = seq_log_ratio.exp()  # the rule reads it unclamped (inf is above every high)
        keep = (seq_ratio >= p.low) & (seq_ratio <= p.high)  # [B]
        # for the metrics only: clamped like the token ratio, so that they stay finite
        seq_ratio_shown = clamp_exact(seq_log_ratio, -p.log_ratio_clamp, p.log_ratio_clamp).exp()
        token_ratio = clamp_exact(log_ratio, -p.log_ratio_clamp, p.log_ratio_clamp).exp()
        weight = torch.where(keep.unsqueeze(-1), token_ratio, torch.zeros_like(token_ratio))
    valid = inp.lengths > 0
    return lossplug.GateOutput(
        weight=weight.detach(),
        metrics={
            # NeMo-RL's is_oob_ratio for seq-mask-tis: the fraction of responses dropped
            "mask_frac": lambda: inp.response_fraction(~keep),
            "mask_token_frac": lambda: inp.token_fraction(~keep.unsqueeze(-1)),
        },
        details={
            **response_stats("seq_ratio", seq_ratio_shown, valid),
            **response_stats("ratio", token_ratio, inp.mask),
        },
        active=lambda: keep.unsqueeze(-1) & inp.mask,
    )
