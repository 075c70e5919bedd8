"""GMPO: the geometric mean of the token ratios, clipped per token, as one sequence ratio.

Per response ``i`` with action tokens ``t`` (``n_i`` of them), ``log r_t = logp_t − old_logp_t`` and ``s_t =
sign(A_t)``, each token's log-ratio is clipped on the side its advantage pushes (the clip range is in log space)::

    ℓ_t = s_t · min(s_t · log r_t, s_t · clip(log r_t, −eps_low, eps_high))
    R_i = exp(Σ_t ℓ_t / n_i)         Ā_i = Σ_t A_t / n_i
    J_it = Ā_i · R_i                                 (the same value on every action token of response i)

For ``A > 0`` a log-ratio above ``eps_high`` is cut (its gradient is 0), for ``A < 0`` one below ``−eps_low``; a token
with ``A = 0`` contributes 0 to the mean (but counts in ``n_i``). ``R_i`` is the geometric mean of the (clipped)
token ratios — bounded by the product's ``n_i``-th root, hence far less extreme than the arithmetic mean GRPO
averages. ``∂J_it/∂logp_u = Ā_i · R_i / n_i`` for each unclipped token ``u`` of the response.

Reduce with ``response``: Σ_t J_it / n_i = Ā_i·R_i, and the mean over responses is GMPO's ``mean_i Ā_i·R_i``.
(verl divides by ``n_i + 1e-8`` with ``n_i`` the integer sum of a bool mask: the sum is float32, where ``n_i + 1e-8 =
n_i`` exactly, so its guard changes nothing for a non-empty response.) The mean log-ratio is
clamped to ``± log_ratio_clamp`` before exp (verl clamps nothing; the clamp only binds where verl's ratio is beyond
e^±20).

Detach/gradient contract: the advantage and ``old_logp`` are constants; gradient flows through ``logp`` only.

Paper: Zhao et al., 2025, *Geometric-Mean Policy Optimization*, arXiv:2507.20673.

Reference: verl ``compute_policy_loss_geo_mean`` (``loss_mode=geo_mean``; ``clip_ratio_low/high``). verl averages
over the rows of each micro-batch (``torch.mean``) and ignores ``loss_agg_mode`` and ``global_batch_info``; the
``response`` reduction over the step's population equals it when every rank holds one micro-batch of the same number
of non-empty responses, and is the data-parallel-exact form otherwise.
"""

from __future__ import annotations

import functools

import torch
from pydantic import Field

import lossplug
from lossplug.ops import any_rows, clamp_exact, response_stats


class GMPOParams(lossplug.Params):
    eps_low: float = Field(
        0.2, gt=0, description="log-ratios below −eps_low are cut when A < 0 (verl: clip_ratio_low, 0.2; paper: 0.4)"
    )
    eps_high: float = Field(
        0.2, gt=0, description="log-ratios above eps_high are cut when A > 0 (verl: clip_ratio_high, 0.2; paper: 0.4)"
    )
    log_ratio_clamp: float = Field(20.0, gt=0, le=80, description="the mean log-ratio is clamped to ± this before exp")


@lossplug.gate("gmpo", params=GMPOParams, requires=("old_logp",), level="sequence")
def gmpo(inp: lossplug.GateInput, p: GMPOParams) -> lossplug.GateOutput:
    """GMPO: mean_t(A)·exp(mean_t of the sign-aware clipped log-ratios), one value per response."""
    log_ratio = inp.update_log_ratio()
    adv = inp.advantage  # [B, T], zero off the actions
    sign = torch.sign(adv)
    clipped = log_ratio.clamp(-p.eps_low, p.eps_high)
    kept = sign * torch.minimum(sign * log_ratio, sign * clipped)
    denominator = inp.lengths.clamp(min=1).to(log_ratio.dtype)
    mean_log_ratio = kept.sum(-1) / denominator
    seq_ratio = clamp_exact(mean_log_ratio, -p.log_ratio_clamp, p.log_ratio_clamp).exp()
    seq_adv = adv.sum(-1) / denominator
    objective = (seq_adv * seq_ratio).unsqueeze(-1).expand(inp.mask.shape)

    @functools.cache
    def cut() -> torch.Tensor:
        return log_ratio.detach() != clipped.detach()

    def active() -> torch.Tensor:
        # a token is cut on the side its advantage pushes (as the clip fractions count it); a response still carries
        # gradient if any of its action tokens is not cut (gspo's convention for a sequence ratio)
        pushed_cut = cut() & (((log_ratio.detach() > 0) & (adv > 0)) | ((log_ratio.detach() < 0) & (adv < 0)))
        return any_rows(~pushed_cut & inp.mask)

    return lossplug.GateOutput(
        objective=objective,
        metrics={
            # verl's pg_clipfrac (cut where A > 0) and pg_clipfrac_lower (cut where A < 0), over the action tokens
            "clip_frac_high": lambda: inp.token_fraction(cut(), adv > 0),
            "clip_frac_low": lambda: inp.token_fraction(cut(), adv < 0),
        },
        details=response_stats("seq_ratio", seq_ratio.detach(), inp.lengths > 0),
        active=active,
    )
