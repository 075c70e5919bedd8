"""Off-policy sequence masking (DeepSeek-V3.2): drop a negative-advantage response that drifted too far.

For each response, the mean over its action tokens of the k1 estimate of KL(π_sampling ‖ π_θ) on the sampled tokens,
with ``π_sampling`` the policy that generated it (the rollout engine's ``behavior_logp`` when the batch has them,
else ``old_logp``) and ``π_θ`` the **current** policy (``logp``, detached)::

    D_i = Σ_t (logp_sampling,it − logp_it) / |y_i|
    w_i = 1  if A_i ≥ 0 or D_i ≤ threshold,   else 0

``w`` is a detached 0/1 weight (``role="correction"``) that multiplies the update gate's objective: responses with
a non-negative advantage are always kept — only negative-advantage responses that are far off-policy are dropped,
since those are the ones whose updates destabilise training. The weight is one value per response, broadcast to its
tokens (``[B, T]``, token level): with a per-token advantage ``[B, T]`` the rule ``A_it ≥ 0 or D_i ≤ threshold`` is
applied per token, as TRL's mask broadcasts ``A ≥ 0`` at the advantage's shape.

Why a correction and not part of the update gate: the drift is measured against the current ``logp``, which a
correction reads (detached) like any gate; the weight carries no gradient, so it composes with every update gate
exactly as TRL multiplies its per-token loss by the mask. With ``logp = old_logp`` (the first step on fresh samples
without a rollout engine) ``D_i`` is 0 and nothing is dropped, as in TRL.

``sampling_logp``: which batch field holds the sampling policy's log-probs — ``behavior_logp`` (TRL with vLLM: its
``sampling_per_token_logps``) or ``old_logp`` (TRL without vLLM).

Paper: DeepSeek-AI, 2025, *DeepSeek-V3.2: Pushing the Frontier of Open Large Language Models*, arXiv:2512.02556
(off-policy sequence masking, its Equation 9).

Reference: TRL ``GRPOTrainer.get_off_policy_mask`` (``off_policy_mask_threshold``).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

import lossplug


class OffPolicyMaskParams(lossplug.Params):
    threshold: float = Field(
        0.5, ge=0, description="δ: a response with A < 0 and mean KL above δ is dropped (TRL off_policy_mask_threshold)"
    )
    sampling_logp: Literal["behavior_logp", "old_logp"] = Field(
        "behavior_logp",
        description="the log-probs of the policy that sampled the response: behavior_logp (TRL with vLLM) or "
        "old_logp (TRL without vLLM)",
    )


def _requires(p: OffPolicyMaskParams) -> tuple[str, ...]:
    return (p.sampling_logp,)


@lossplug.gate("off_policy_mask", params=OffPolicyMaskParams, requires=_requires, role="correction", level="token")
def off_policy_mask(inp: lossplug.GateInput, p: OffPolicyMaskParams) -> lossplug.GateOutput:
    """Detached weight 1 if A ≥ 0 or mean_t(logp_sampling − logp) ≤ threshold, else 0 (per response).

    Paper: DeepSeek-AI, 2025, *DeepSeek-V3.2*, arXiv:2512.02556 (off-policy sequence masking).

    Reference: TRL ``GRPOTrainer.get_off_policy_mask``.
    """
    with torch.no_grad():
        sampling = getattr(inp, p.sampling_logp)
        # both cleaned to 0 off the actions: the row sum is the sum over the action tokens
        drift = (sampling - inp.logp.detach()).sum(-1) / inp.lengths.clamp(min=1).to(sampling.dtype)  # [B]
        low_drift = (drift <= p.threshold).unsqueeze(-1)  # [B, 1]
        advantage = inp.broadcast_advantage()  # [B, 1], or [B, T] for token advantages
        keep = ((advantage >= 0) | low_drift).expand(inp.mask.shape)  # TRL's rule at the advantage's shape
        weight = keep.to(sampling.dtype)
    valid = inp.lengths > 0
    return lossplug.GateOutput(
        weight=weight.detach(),
        metrics={"drop_frac": lambda: inp.token_fraction(~keep)},
        details={"kl_mean": lambda: torch.where(valid, drift, 0).sum() / torch.count_nonzero(valid).clamp(min=1)},
        active=lambda: keep,
    )
