"""verl's off-policy diagnostics of the rollout engine against the trainer, as a correction that changes nothing.

With ``ℓ^old`` the training engine's log-probs (``old_logp``), ``ℓ^beh`` the rollout engine's (``behavior_logp``),
``log ρ_t = ℓ^old_t − ℓ^beh_t``, ``L_i`` the action tokens of response ``i``, ``N`` those of the batch, means over
the batch's responses (``mean_i``) and over its action tokens (``E_t``)::

    training_log_ppl = mean_i(−Σ_t ℓ^old_it / L_i)          training_ppl = mean_i exp(−Σ_t ℓ^old_it / L_i)
    rollout_log_ppl, rollout_ppl                              the same with ℓ^beh
    kl     = E_t[ℓ^beh − ℓ^old]                               (k1 estimate of KL(π_behaviour ‖ π_old))
    k3_kl  = E_t[ρ − log ρ − 1]
    log_ppl_diff_i = Σ_t ℓ^beh_it / L_i − Σ_t ℓ^old_it / L_i  → log_ppl_diff (mean), log_ppl_abs_diff (mean of |·|),
                                                                log_ppl_diff_max, log_ppl_diff_min
    ppl_ratio  = mean_i exp(log_ppl_diff_i)
    chi2_token = E_t[ρ²] − 1                                  (ρ with log ρ clamped to ±20)
    chi2_seq   = mean_i exp(2 · clamp(Σ_t log ρ_it, ±20)) − 1

The unclamped exponentials (the perplexities, ``ppl_ratio``, ``k3_kl``) are computed in float64, so that they stay
finite where verl's float32 ones overflow to inf (a mean log-prob below −88.7 per token, a token log-ratio above
88.7; float64 holds up to e^709), and equal verl's for float64 log-probs.

The weight is 1 for every response (``[B]``): adding the gate to a recipe changes neither the loss nor its gradient;
it only reports these metrics (``metrics``, under these names) for the batch it is given — in TRL or plain PyTorch
as in verl, which logs them as ``rollout_corr/<name>`` over its whole rollout batch.

Paper: Liu, Li, Fu, Wang, Liu, Shen, 2025, *When Speed Kills Stability: Demystifying RL Collapse from the
Training-Inference Mismatch*, https://richardli.xyz/rl-collapse (the mismatch diagnostics).

Reference: verl 0.9.1 ``rollout_corr_helper.compute_offpolicy_metrics``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

import lossplug

from . import _rollout_stats as rs

Tensor = torch.Tensor


@lossplug.gate("offpolicy_metrics", requires=("old_logp", "behavior_logp"), role="correction", level="sequence")
def offpolicy_metrics(inp: lossplug.GateInput, p: lossplug.NoParams) -> lossplug.GateOutput:
    """Off-policy diagnostics (verl's compute_offpolicy_metrics): perplexities of both engines, kl, k3_kl,
    log_ppl_diff, ppl_ratio, chi2_token, chi2_seq; weight 1 (the loss is unchanged)."""
    with torch.no_grad():
        old = cast(Tensor, inp.old_logp)
        behavior = cast(Tensor, inp.behavior_logp)
        log_ratio = inp.engine_log_ratio()
        weight = torch.ones(inp.mask.shape[0], dtype=inp.compute_dtype, device=inp.mask.device)

    def mean_old() -> Tensor:
        return rs.row_mean(inp, old)

    def mean_behavior() -> Tensor:
        return rs.row_mean(inp, behavior)

    def log_ppl_diff() -> Tensor:
        return mean_behavior() - mean_old()

    def chi2_seq() -> Tensor:
        summed = log_ratio.sum(-1).clamp(min=-rs.SAFETY_BOUND, max=rs.SAFETY_BOUND)
        return torch.exp(2.0 * summed).mean() - 1.0

    metrics: dict[str, Callable[[], Tensor]] = {
        "training_ppl": lambda: torch.exp(-rs.wide(mean_old())).mean(),
        "training_log_ppl": lambda: (-mean_old()).mean(),
        "kl": lambda: rs.token_mean(inp, -log_ratio),
        "k3_kl": lambda: rs.token_mean(inp, torch.exp(rs.wide(log_ratio)) - rs.wide(log_ratio) - 1),
        "rollout_ppl": lambda: torch.exp(-rs.wide(mean_behavior())).mean(),
        "rollout_log_ppl": lambda: (-mean_behavior()).mean(),
        "log_ppl_diff": lambda: log_ppl_diff().mean(),
        "log_ppl_abs_diff": lambda: log_ppl_diff().abs().mean(),
        "log_ppl_diff_max": lambda: log_ppl_diff().max(),
        "log_ppl_diff_min": lambda: log_ppl_diff().min(),
        "ppl_ratio": lambda: torch.exp(rs.wide(log_ppl_diff())).mean(),
        "chi2_token": lambda: (
            rs.token_mean(inp, log_ratio.clamp(min=-rs.SAFETY_BOUND, max=rs.SAFETY_BOUND).exp().square()) - 1.0
        ),
        "chi2_seq": chi2_seq,
    }
    # every response stays active (weight 1): reported like any sequence-level correction's cut, here none
    return lossplug.GateOutput(weight=weight, metrics=metrics, active=lambda: weight > 0)
