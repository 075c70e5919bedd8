"""M2PO: mask the tokens with the largest squared engine log-ratio until the batch's second moment is below τ.

With ``δ_t = old_logp_t − behavior_logp_t`` (log π_prox/π_behave: the policy the update starts from against the
stale one that sampled the token) and ``m_t = δ_t²`` on the action tokens of the micro-batch::

    M2 = mean_t m_t                     (the second moment of the log-ratio over the micro-batch's action tokens)
    sort m descending; drop the k largest, k the smallest count with mean(m without them) < τ
    w_t = 0 for the dropped tokens, else 1   (· n / n_kept with renormalize: true, AReaL's denominator)

If no suffix reaches ``M2 < τ`` every token but the one with the smallest ``m`` is dropped; a micro-batch whose
``M2`` is already below τ keeps every token (at π_prox = π_behave, ``m = 0``: weight 1 everywhere). Unlike a
per-token clip, M2PO bounds a *batch* statistic: a few extreme tokens are dropped, the many moderately stale ones
are all kept.

**Population**: the statistic, the sort and ``n`` are over the action tokens of the batch the gate is given — in
a trainer, each micro-batch on its own, as AReaL masks inside its loss function (``grpo_loss_fn``), per
micro-batch. A split into other micro-batches drops other tokens: the gate is not additive over micro-batches by
design.

By default the weight is a plain 0/1 mask, like every lossplug rejection: the dropped tokens still count in the
reduction's denominator. ``renormalize: true`` is AReaL's convention: AReaL counts the loss mask *after* M2PO in the
micro-batch's token mean (``ppo_actor_loss_fn``'s ``loss_mask_count``) while weighting micro-batches by their token
count before it, so the kept tokens' weights are multiplied by ``n / n_kept`` (the micro-batch's action tokens over
the kept ones) — with the ``token`` reduction this reproduces AReaL's loss exactly. That factor can reach ``n``: in
float16, times a large advantage, the gradient can leave the format's range.

A correction (``role="correction"``): its weight, computed under ``no_grad`` from detached log-probs, multiplies
the update gate's objective (``ppo_clip`` for AReaL's PPO, ``decoupled_ppo`` for its decoupled loss — which
takes ``m2_threshold`` itself when its proximal log-probs are approximated).

Paper: Zheng et al., 2025, *Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?*,
arXiv:2510.01161 (M2PO).

Reference: AReaL 1.0.4 ``areal/trainer/ppo/actor.py`` ``_apply_m2po_masking`` / ``_get_m2po_loss_mask``
(``actor.m2_threshold``; ``old_logp`` there is the behaviour policy's, ``prox_logp`` the proximal one).
"""

from __future__ import annotations

import torch
from pydantic import Field

import lossplug


class M2POParams(lossplug.Params):
    threshold: float = Field(
        0.04,
        gt=0,
        allow_inf_nan=False,
        description="τ: the largest squared log-ratios are dropped until their mean over the micro-batch is below "
        "τ (AReaL's m2_threshold; the paper uses 0.04)",
    )
    renormalize: bool = Field(
        False,
        description="multiply the kept tokens' weights by n / n_kept, the micro-batch's action tokens over the kept "
        "ones, so that a token mean divides by the kept tokens as AReaL does; false: weight 0/1",
    )


def second_moment_keep(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which action tokens M2PO keeps, ``[B, T]`` bool (False off the actions): the largest ``log_ratio²`` are
    dropped until the mean of the rest is below ``threshold`` (all but the smallest when none is). One pass of
    tensor operations, no host synchronisation: the tokens off the actions sort after every action token."""
    flat_mask = mask.reshape(-1)
    n = torch.count_nonzero(flat_mask)
    keyed = torch.where(flat_mask, log_ratio.reshape(-1).square(), -1.0)  # m ≥ 0 on the actions
    sorted_m2, order = torch.sort(keyed, descending=True, stable=True)
    position = torch.arange(sorted_m2.numel(), device=sorted_m2.device)
    valid = position < n
    # suffix sums from the smallest value up, as AReaL's flip-cumsum-flip over the action tokens (adding the
    # trailing zeros first changes no rounding)
    suffix = torch.where(valid, sorted_m2, 0).flip(0).cumsum(0).flip(0)
    suffix_mean = suffix / (n - position).clamp(min=1).to(suffix.dtype)
    below = valid & (suffix_mean < threshold)
    dropped = torch.where(below.any(), below.int().argmax(), (n - 1).clamp(min=0))
    keep_sorted = valid & (position >= dropped)
    keep = torch.empty_like(flat_mask).scatter_(0, order, keep_sorted)
    return keep.view_as(mask)


def m2po_weight(
    inp: lossplug.GateInput, log_ratio: torch.Tensor, threshold: float, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The M2PO weight ``[B, T]`` (detached) and the kept tokens, for the log-ratio ``log_ratio`` ``[B, T]``."""
    with torch.no_grad():
        keep = second_moment_keep(log_ratio.detach(), inp.mask, threshold)
        weight = keep.to(log_ratio.dtype)
        if renormalize:
            kept = torch.count_nonzero(keep).clamp(min=1)
            weight = weight * (inp.action_tokens.to(weight.dtype) / kept.to(weight.dtype))
    return weight.detach(), keep


@lossplug.gate("m2po", params=M2POParams, requires=("old_logp", "behavior_logp"), role="correction")
def m2po(inp: lossplug.GateInput, p: M2POParams) -> lossplug.GateOutput:
    """M2PO: weight 0 on the largest (old_logp − behavior_logp)² until their micro-batch mean is below τ, else 1."""
    log_ratio = inp.engine_log_ratio()
    weight, keep = m2po_weight(inp, log_ratio, p.threshold, p.renormalize)

    def second_moment(where: torch.Tensor) -> torch.Tensor:
        return torch.where(where, log_ratio.square(), 0).sum() / torch.count_nonzero(where).clamp(min=1)

    return lossplug.GateOutput(
        weight=weight,
        metrics={"masked_frac": lambda: inp.token_fraction(~keep)},
        details={"m2": lambda: second_moment(inp.mask), "m2_kept": lambda: second_moment(keep)},
        active=lambda: keep,
    )
