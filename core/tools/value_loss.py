"""PPO's clipped value loss (the critic side of PPO), and its clip fraction.

With ``V`` the current value prediction (carries the gradient), ``V_old`` the prediction of the critic that scored the
rollout, ``R = A_GAE + V_old`` the returns (``AdvantageResult.returns``) and ``ε ≥ 0`` the value clip range::

    V_clip = clip(V, V_old − ε, V_old + ε)
    ℓ_t    = ½ · max((V − R)², (V_clip − R)²)                               per action token
    loss   = Σ_{action tokens} ℓ_t / N                                       reduction "token" (default)
           = Σ_i (Σ_t ℓ_it / |o_i|) / S                                      reduction "response"
           = Σ_i Σ_t ℓ_it / S                                                reduction "sequence_sum"
           = Σ_i Σ_t ℓ_it / (budget · S)                                     reduction "fixed"
           = Σ_i Σ_t ℓ_it                                                    reduction "token_sum"
    clip_frac = #{action tokens where (V_clip − R)² > (V − R)²} / #{action tokens of this micro-batch}

The reduction is any registered reduction plugin (the list above is the built-ins'), applied by
:func:`lossplug.reduce` exactly as the policy loss applies it. ``N`` and ``S`` are the population of the whole
optimizer step when a :class:`~lossplug.Normalizer` (or a global ``action_tokens`` count) is given — then the loss of
a micro-batch is its *share* and the sum over all micro-batches and ranks equals the full-batch loss exactly — else
this micro-batch's own action tokens / responses.

Gradient contract (why the ``max``: the three cases below), per token, of ``ℓ_t`` with respect to ``V``:

1. ``V`` inside ``[V_old − ε, V_old + ε]``: ``V_clip = V`` and ``∂ℓ/∂V = ½ · 2(V − R) = V − R``;
2. ``V`` outside the band and the unclipped branch is the larger: same, ``V − R``;
3. ``V`` outside the band and the clipped branch is strictly larger: ``ℓ = ½(V_clip − R)²`` with ``V_clip`` a
   constant of ``V`` there, so ``∂ℓ/∂V = 0`` — the critic has already moved closer to ``R`` than the band allows,
   and stops.

The branch is chosen with ``torch.where(clipped, clipped_branch, raw_branch)`` (``clipped`` = strictly larger, the
same rule as the clip fraction), so ties take the raw branch and its gradient; the value equals ``torch.max``
exactly. ``V_old`` and ``R`` are treated as constants (no gradient flows into them).

Matches verl 0.9.1 ``compute_value_loss`` (loss, gradient, clip fraction) under every ``loss_agg_mode``, with the
reduction the verl adapter pairs with it (``token-mean`` ``token``, ``seq-mean-token-mean`` ``response``,
``seq-mean-token-sum`` ``sequence_sum``, ``seq-mean-token-sum-norm`` ``fixed`` with budget ``loss_scale_factor``,
``token-sum`` ``token_sum``) and verl's global counts in the ``Normalizer``; verl multiplies by ``dp_size`` to cancel
DDP gradient averaging, which is the adapter's business, not this function's. One deliberate difference, on a
measure-zero set: exactly at the band's edges ``V = V_old ± ε`` the clip is ``torch.clamp`` (edges inside the band,
gradient ``V − R``, case 1 above), where verl's ``max(min(·))`` and ``torch.max`` split tied gradients
(``0.75·(V − R)`` there). Non-action positions may hold anything (NaN, inf): they are replaced by 0 before any
arithmetic, so they reach neither the loss nor the gradient.

Arguments are checked with :class:`lossplug.contracts.checks.Checks`, like every contract: every bad input raises a
:class:`~lossplug.BatchValidationError` (a :class:`~lossplug.LossplugError`) naming the field, the rule and the
rows/positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lossplug.contracts import LossplugError, Normalizer
from lossplug.contracts.checks import Checks
from lossplug.ops import zero_off

Tensor = torch.Tensor

__all__ = ["ValueLossOutput", "value_loss", "value_clip_fraction"]


@dataclass(frozen=True)
class ValueLossOutput:
    """The clipped value loss of one micro-batch.

    ``loss`` is the scalar to minimise (carries the gradient to ``values``); ``clip_frac`` is detached;
    ``per_token`` is ``ℓ_t`` (zero off actions, carries the gradient); ``clipped`` marks the action tokens where the
    clipped branch is strictly larger (zero gradient there); ``metrics`` are detached 0-d tensors.
    """

    loss: Tensor
    clip_frac: Tensor
    per_token: Tensor
    clipped: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    action_mask: Tensor,
    *,
    clip_eps: float | None = 0.2,
    reduction: str | Mapping[str, Any] = "token",
    normalizer: Normalizer | None = None,
    action_tokens: int | None = None,
    validate: bool = True,
) -> ValueLossOutput:
    """PPO clipped value loss ``½·max((V−R)², (clip(V, V_old±ε)−R)²)`` reduced over action tokens.

    ``values`` ``[B, T]`` are the current predictions ``V`` (gradient), ``old_values`` the rollout critic's ``V_old``,
    ``returns`` ``R = A_GAE + V_old``, ``action_mask`` ``[B, T]`` bool. ``clip_eps=None`` disables clipping
    (plain ``½(V−R)²``). ``reduction`` is any registered reduction, named as a recipe names one (``"token"``,
    ``"response"``, ``"sequence_sum"``, ``"token_sum"``, ``{"name": "fixed", "budget": 512}``…): the same plugin the
    policy loss uses, through :func:`lossplug.reduce`. The population: ``normalizer`` (the step's
    :class:`~lossplug.Normalizer`) or ``action_tokens`` (only the global token count, e.g. verl's
    ``batch_num_tokens``; token reduction only); neither: this micro-batch. ``validate=False`` skips every check
    (and its one host sync).
    """
    if validate:
        _check_value_args(values, old_values, returns, action_mask, clip_eps, reduction, normalizer, action_tokens)
    mask = action_mask
    v = zero_off(values, mask)
    v_old = zero_off(old_values, mask).detach()
    ret = zero_off(returns, mask).detach()
    raw = (v - ret) ** 2
    if clip_eps is None:
        per_token = 0.5 * raw
        clipped = torch.zeros_like(mask)
    else:
        v_clip = torch.clamp(v, v_old - clip_eps, v_old + clip_eps)
        cl = (v_clip - ret) ** 2
        clipped = (cl > raw) & mask
        per_token = 0.5 * torch.where(clipped, cl, raw)
    per_token = zero_off(per_token, mask)

    from lossplug.pipeline import reduce  # the pipeline resolves plugins; a tool stays importable without them

    n_local = mask.sum()
    if action_tokens is not None:  # a token count alone: the token mean reads nothing else
        normalizer = Normalizer(action_tokens=action_tokens, sequences=mask.shape[0])
    loss = reduce(per_token, mask, normalizer=normalizer, reduction=reduction)

    with torch.no_grad():
        n = n_local.clamp(min=1)
        clip_frac = clipped.sum().to(per_token.dtype) / n
        metrics = {
            "value/loss": loss.detach(),
            "value/clip_frac": clip_frac,
            "value/vpred_mean": v.detach().sum() / n,
            "value/error": raw.detach().sum() / n,
        }
    return ValueLossOutput(loss=loss, clip_frac=clip_frac, per_token=per_token, clipped=clipped, metrics=metrics)


def value_clip_fraction(
    values: Tensor, old_values: Tensor, returns: Tensor, action_mask: Tensor, *, clip_eps: float, validate: bool = True
) -> Tensor:
    """Fraction of this micro-batch's action tokens where ``(clip(V, V_old±ε) − R)² > (V − R)²`` (detached)."""
    with torch.no_grad():
        return value_loss(
            values.detach(), old_values, returns, action_mask, clip_eps=clip_eps, validate=validate
        ).clip_frac


def _check_value_args(
    values: Any,
    old_values: Any,
    returns: Any,
    action_mask: Any,
    clip_eps: Any,
    reduction: Any,
    normalizer: Any,
    action_tokens: Any,
    contract: str = "value_loss",
) -> None:
    c = Checks(contract)
    aligned = c.tensor("values", values, ndim=(2,))
    shape = tuple(values.shape) if aligned else None
    like = "values"
    for name, t in (("old_values", old_values), ("returns", returns)):
        aligned &= c.tensor(name, t, shape=shape, like=like)
    aligned &= c.tensor("action_mask", action_mask, kind="bool", shape=shape, like=like)
    if clip_eps is not None:
        c.number("clip_eps", clip_eps, ge=0.0, allow_inf=True)
    reduction_name = _reduction_name(c, reduction)
    if normalizer is not None and not isinstance(normalizer, Normalizer):
        c.fail("normalizer", f"must be a lossplug.Normalizer, got {type(normalizer).__name__}")
        normalizer = None
    if action_tokens is not None:
        if normalizer is not None:
            c.fail("action_tokens", "give either normalizer or action_tokens, not both")
        elif reduction_name != "token":
            c.fail("action_tokens", "is a token count: it only fits reduction 'token' (use a Normalizer)")
        else:
            c.number("action_tokens", action_tokens, gt=0, integer=True)
    if not aligned:
        c.raise_if_any()
        return
    mask = action_mask
    c.when_any(~mask.any(-1), "action_mask", "every response needs at least one action token")
    for name, t in (("values", values), ("old_values", old_values), ("returns", returns)):
        c.when_any(mask & ~torch.isfinite(t.detach()), name, "must be finite on action positions", noun="positions")
    population = normalizer.action_tokens if normalizer is not None else action_tokens
    if isinstance(population, int) and population > 0:
        c.when(
            mask.sum() > population,
            "normalizer" if normalizer is not None else "action_tokens",
            f"the global population ({population} action tokens) is smaller than this micro-batch alone; "
            "it must count the whole optimizer step (all micro-batches and ranks)",
        )
    if normalizer is not None and mask.shape[0] > normalizer.sequences:
        c.fail(
            "normalizer",
            f"the global population ({normalizer.sequences} sequences) is smaller than this "
            f"micro-batch ({mask.shape[0]} sequences)",
        )
    c.raise_if_any()


def _reduction_name(c: Checks, reduction: Any) -> str | None:
    """The registered reduction's name, or a violation that says what is registered."""
    from lossplug.pipeline import compile_reduction

    try:
        return compile_reduction(reduction, "reduction").plugin.name
    except LossplugError as err:
        c.fail(
            "reduction",
            f"must be 'token' or 'response' or another registered reduction, got {reduction!r} "
            f"({str(err).split(': ', 1)[-1]})",
        )
        return None
