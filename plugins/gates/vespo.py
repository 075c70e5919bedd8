"""VESPO: a detached gamma-shaped weight of the sequence importance ratio times the policy log-prob.

With ``log r_it = logp_it − old_logp_it`` per action token, the sequence importance ratio is the *product* of the
token ratios (not GSPO's geometric mean), in log space with TRL's clamps::

    log w_i = clamp( Σ_t clamp(log r_it, −20, 20), log 1e-8, 20 )

and the weight is the gamma density normalised so that ``φ(1) = 1`` (``k, λ`` chosen by the advantage's sign:
``k_pos, λ_pos`` where ``A ≥ 0``, ``k_neg, λ_neg`` where ``A < 0``; ``λ`` floored at 1e-4)::

    φ(w) = e^λ · w^k · e^(−λ·w) = exp(λ + k·log w − λ·w)          (NaN/±inf → 0)
    J_it = sg(φ(w_i)) · A_it · logp_it                          ∂J/∂logp_it = φ(w_i) · A_it

``φ`` rises like ``w^k`` below 1 and decays like ``e^(−λw)`` above: far-off-policy responses are damped smoothly on
both sides instead of being clipped. ``φ`` is a detached coefficient (computed under ``no_grad``, ``.detach()``-ed):
gradient flows through each token's own ``logp`` only, as in CISPO.

**Engine correction folded in** (``engine_correction``). TRL does not multiply VESPO's loss by the vLLM importance
ratio as it does for the other losses: it folds the token ratio ``ρ_t = π_old/π_behaviour`` (after TRL's truncation
or masking) into the sequence ratio, ``log w_i += Σ_t clamp(log ρ̃_t, log 1e-8, 20)``, so that ``w_i`` is the ratio
against the policy that sampled the response. ``engine_correction``:

* ``none`` — no engine term (TRL without vLLM, or ``vllm_importance_sampling_correction=False``);
* ``token_truncate`` — ``ρ̃_t = clamp(ρ_t, engine_ratio_min, engine_ratio_max)``;
* ``token_mask`` — ``ρ̃_t = ρ_t`` inside ``[engine_ratio_min, engine_ratio_max]``, else 0 (log 0 → log 1e-8).

(TRL refuses the sequence modes with VESPO.) ``ρ_t = exp(old_logp_t − behavior_logp_t)`` is not clamped before
``exp``, exactly as TRL computes it. A recipe with ``vespo`` and an engine correction must not add a ``tis``/``icepop``
correction gate as well: TRL applies the engine ratio once, here. TRL sums ``log ρ̃`` over every position of the
padded row, where its ratio is 1; the bounds must therefore contain 1 (checked), and then the sum over the action
tokens is TRL's sum.

Paper: *VESPO: Variational Sequence-Level Soft Policy Optimization*, 2026, arXiv:2602.10693.

Reference: TRL ``GRPOTrainer.get_gamma_weights`` and ``_compute_loss`` (``loss_type="vespo"``, defaults
``vespo_k_pos=2``, ``vespo_lambda_pos=3``, ``vespo_k_neg=3``, ``vespo_lambda_neg=2``).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.ops import any_rows, response_stats

#: TRL's clamps: the token log-ratio to ±20, the log weights to [log 1e-8, 20]
TOKEN_LOG_RATIO_CLAMP = 20.0
LOG_WEIGHT_MIN = math.log(1e-8)
LOG_WEIGHT_MAX = 20.0


class VESPOParams(lossplug.Params):
    k_pos: float = Field(2.0, description="power exponent k of φ for A ≥ 0 (TRL vespo_k_pos: 2.0)")
    lambda_pos: float = Field(
        3.0, description="decay rate λ of φ for A ≥ 0, floored at 1e-4 (TRL vespo_lambda_pos: 3.0)"
    )
    k_neg: float = Field(3.0, description="power exponent k of φ for A < 0 (TRL vespo_k_neg: 3.0)")
    lambda_neg: float = Field(
        2.0, description="decay rate λ of φ for A < 0, floored at 1e-4 (TRL vespo_lambda_neg: 2.0)"
    )
    engine_correction: Literal["none", "token_truncate", "token_mask"] = Field(
        "none",
        description="fold the engine ratio π_old/π_behaviour into w (TRL with vLLM importance sampling: its "
        "vllm_importance_sampling_mode); none: no engine term",
    )
    engine_ratio_min: float | None = Field(
        None, ge=0, description="lower bound of the engine ratio (TRL vllm_importance_sampling_clip_min); null: none"
    )
    engine_ratio_max: float | None = Field(
        3.0,
        gt=0,
        description="upper bound of the engine ratio (TRL vllm_importance_sampling_clip_max: 3.0); null: none",
    )

    @model_validator(mode="after")
    def _bounds_contain_one(self) -> VESPOParams:
        if self.engine_correction == "none":
            return self
        low, high = self.engine_ratio_min, self.engine_ratio_max
        if self.engine_correction == "token_truncate" and low is None and high is None:
            raise ValueError("engine_correction token_truncate needs engine_ratio_min or engine_ratio_max")
        if (low is not None and low > 1) or (high is not None and high < 1):
            raise ValueError(
                f"the engine ratio bounds [{low}, {high}] must contain 1: TRL sums the engine term over every "
                "padded position, where its ratio is 1, so bounds excluding 1 make the weight depend on the padding"
            )
        return self


def _requires(p: VESPOParams) -> tuple[str, ...]:
    return ("old_logp",) if p.engine_correction == "none" else ("old_logp", "behavior_logp")


def _engine_log_ratio(inp: lossplug.GateInput, p: VESPOParams) -> torch.Tensor:
    """Σ_t clamp(log ρ̃_t, log 1e-8, 20) ``[B, 1]``: TRL's truncated or masked engine ratio, in log space."""
    ratio = inp.engine_log_ratio().exp()  # 1 off the actions (both log-probs are cleaned to 0 there)
    if p.engine_correction == "token_truncate":
        ratio = ratio.clamp(min=p.engine_ratio_min, max=p.engine_ratio_max)
    else:
        low = p.engine_ratio_min if p.engine_ratio_min is not None else -math.inf
        high = p.engine_ratio_max if p.engine_ratio_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    return ratio.log().clamp(LOG_WEIGHT_MIN, LOG_WEIGHT_MAX).sum(-1, keepdim=True)


@lossplug.gate("vespo", params=VESPOParams, requires=_requires, level="sequence")
def vespo(inp: lossplug.GateInput, p: VESPOParams) -> lossplug.GateOutput:
    """VESPO: sg(φ(w))·A·logp, φ(w) = exp(λ + k·log w − λ·w), w = Π_t r_t (× the engine ratio when folded in).

    Paper: *VESPO: Variational Sequence-Level Soft Policy Optimization*, 2026, arXiv:2602.10693.

    Reference: TRL ``GRPOTrainer.get_gamma_weights`` (``loss_type="vespo"``).
    """
    adv = inp.broadcast_advantage()
    with torch.no_grad():
        log_ratio = inp.update_log_ratio().detach()  # 0 off the actions
        seq_log_ratio = log_ratio.clamp(-TOKEN_LOG_RATIO_CLAMP, TOKEN_LOG_RATIO_CLAMP).sum(-1, keepdim=True)
        if p.engine_correction != "none":
            seq_log_ratio = seq_log_ratio + _engine_log_ratio(inp, p)
        log_w = seq_log_ratio.clamp(LOG_WEIGHT_MIN, LOG_WEIGHT_MAX)  # [B, 1]
        w = log_w.exp()
        nonneg = adv >= 0
        # k and λ in the compute dtype (TRL's torch.where of Python floats takes torch's default dtype)
        k = torch.full(nonneg.shape, p.k_neg, dtype=log_w.dtype, device=log_w.device).masked_fill(nonneg, p.k_pos)
        lam = (
            torch.full(nonneg.shape, p.lambda_neg, dtype=log_w.dtype, device=log_w.device)
            .masked_fill(nonneg, p.lambda_pos)
            .clamp(min=1e-4)
        )
        phi = torch.exp(lam + k * log_w - lam * w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    objective = phi.detach() * adv * inp.logp

    valid = inp.lengths > 0

    def phi_mean() -> torch.Tensor:
        # TRL's vespo/phi_seq_mean: over the responses ([B, 1] φ) or the action tokens ([B, T] φ, token advantages)
        if phi.shape[-1] == 1:
            return torch.where(valid, phi[:, 0], 0).sum() / torch.count_nonzero(valid).clamp(min=1)
        return inp.masked_mean(phi)

    return lossplug.GateOutput(
        objective=objective,
        metrics={"phi_mean": phi_mean},
        details=response_stats("seq_ratio", w.squeeze(-1), valid),
        active=lambda: any_rows((phi > 0).expand(inp.mask.shape) & inp.mask),  # per response
    )
