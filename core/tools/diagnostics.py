"""PPO-epoch diagnostics (the statistics of TRL ≤ 0.11's ``PPOTrainer.loss``) and the ratio guard that skips a
runaway batch.

All statistics are over the action tokens of one micro-batch, detached (no gradient, no graph). With ``r = exp(logp
− old_logp)`` (log-ratio clamped to ±20 before ``exp``, as in the gates), advantages ``A`` and clip range
``[1 − ε_low, 1 + ε_high]``::

    approx_kl          ½ · mean((logp − old_logp)²)                       (TRL's approxkl: k2 vs the old policy)
    policy_kl          mean(old_logp − logp)                              (TRL's policykl: k1 of old vs current;
                                                                           verl's ``ppo_kl``)
    policy clip_frac   mean[ −A·clip(r) > −A·r ]                          (the clipped branch strictly larger)
    value clip_frac    mean[ (clip(V, V_old ± ε) − R)² > (V − R)² ]       (see :mod:`lossplug.tools.value_loss`)
    entropy            mean_t H(softmax(logits_t)),  H = −Σ_v q_v·log q_v,  log q = log_softmax(l)
                       (= logsumexp(l) − Σ q·l, verl/TRL's form; −inf logits — masked vocabulary — contribute 0)
    mean, var          masked mean and *unbiased* masked variance  Σ(x − x̄)²/(n − 1)  of returns and old values
                       (TRL's masked_var; fewer than 2 action tokens is an error, not a silent 0 or NaN)

Entropy from ``logits [B, T, V]`` visits only the action positions, ``chunk_tokens`` rows of ``V`` at a time (gathered
by index, so a non-contiguous or expanded ``logits`` is never copied whole): no extra ``[B, T, V]`` tensor is ever
materialised. Precomputed per-token entropies ``[B, T]`` are accepted instead.

Ratio guard (TRL ≤ 0.11's ``ratio_threshold``): if ``mean(r)`` over the micro-batch's action tokens exceeds
``threshold``, the batch is skipped — every loss is multiplied by 0 (the graph is kept, so distributed backward
passes stay in lock-step, and every gradient is exactly 0 as long as the loss graph holds no inf), a
:class:`RatioGuardWarning` is issued, and the metric ``ratio_guard/skipped`` is 1. Deciding needs one host sync.

Reference: TRL ≤ 0.11, ``trl/trainer/ppo_trainer.py`` (``PPOTrainer.loss``: the statistics and the ratio guard) and
``trl/core.py`` (``masked_mean``, ``masked_var``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lossplug.contracts import LossplugError
from lossplug.contracts.checks import Checks
from lossplug.ops import zero_off

from .value_loss import value_loss

Tensor = torch.Tensor

__all__ = [
    "RatioGuard",
    "RatioGuardWarning",
    "approx_kl",
    "entropy_from_logits",
    "masked_mean_var",
    "policy_kl",
    "policy_clip_fraction",
    "ppo_diagnostics",
    "ratio_guard",
]

LOG_RATIO_CLAMP = 20.0


def _check_token_args(c: Checks, named: Mapping[str, Tensor | None], action_mask: Any) -> bool:
    """Every given tensor in ``named`` is a float [B, T] aligned with the first; ``action_mask`` bool [B, T]."""
    shape, first, ok = None, "", True
    for name, t in named.items():
        if t is None:
            continue
        if shape is None:
            good = c.tensor(name, t, ndim=(2,))
            shape = tuple(t.shape) if good else None
            first = name
            ok &= good
        else:
            ok &= c.tensor(name, t, shape=shape, like=first)
    ok &= c.tensor(
        "action_mask", action_mask, kind="bool", shape=shape, ndim=None if shape else (2,), like=first if shape else ""
    )
    if ok:
        for name, t in named.items():
            if t is not None:
                c.when_any(
                    action_mask & ~torch.isfinite(t.detach()),
                    name,
                    "must be finite on action positions",
                    noun="positions",
                )
    return ok


def _log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    return zero_off(logp.detach() - old_logp.detach(), mask)


def _mean(x: Tensor, mask: Tensor) -> Tensor:
    return zero_off(x, mask).sum() / mask.sum().clamp(min=1)


def approx_kl(logp: Tensor, old_logp: Tensor, action_mask: Tensor, *, validate: bool = True) -> Tensor:
    """``½ · mean((logp − old_logp)²)`` over action tokens (TRL's ``approxkl``), detached."""
    if validate:
        c = Checks("approx_kl")
        _check_token_args(c, {"logp": logp, "old_logp": old_logp}, action_mask)
        c.raise_if_any()
    with torch.no_grad():
        return 0.5 * _mean(_log_ratio(logp, old_logp, action_mask).square(), action_mask)


def policy_kl(logp: Tensor, old_logp: Tensor, action_mask: Tensor, *, validate: bool = True) -> Tensor:
    """``mean(old_logp − logp)`` over action tokens (TRL's ``policykl``, verl's ``ppo_kl``), detached."""
    if validate:
        c = Checks("policy_kl")
        _check_token_args(c, {"logp": logp, "old_logp": old_logp}, action_mask)
        c.raise_if_any()
    with torch.no_grad():
        return _mean(-_log_ratio(logp, old_logp, action_mask), action_mask)


def _check_eps(c: Checks, eps_low: Any, eps_high: Any) -> None:
    if c.number("eps_low", eps_low, ge=0.0) and eps_low >= 1:
        c.fail("eps_low", f"must be < 1 (the lower clip bound 1 − eps_low must stay positive), got {eps_low}")
    if eps_high is not None:
        c.number("eps_high", eps_high, ge=0.0)


def _policy_clipped(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float | None
) -> Tensor:
    ratio = _log_ratio(logp, old_logp, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    adv = zero_off(advantages.detach(), mask)
    high = eps_low if eps_high is None else eps_high
    raw = -adv * ratio
    clipped = -adv * ratio.clamp(1 - eps_low, 1 + high)
    hit: Tensor = (clipped > raw) & mask
    return hit


def policy_clip_fraction(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    validate: bool = True,
) -> Tensor:
    """Share of action tokens where PPO's clipped loss ``−A·clip(r, 1−ε_low, 1+ε_high)`` is strictly larger than
    ``−A·r`` (TRL's ``pg_clipfrac``; ``eps_high`` defaults to ``eps_low``), detached. ``advantages`` is
    ``[B, T]`` or ``[B]``."""
    if advantages is not None and isinstance(advantages, Tensor) and advantages.ndim == 1 and logp.ndim == 2:
        advantages = advantages.unsqueeze(-1).expand_as(logp)
    if validate:
        c = Checks("policy_clip_fraction")
        _check_token_args(c, {"logp": logp, "old_logp": old_logp, "advantages": advantages}, action_mask)
        _check_eps(c, eps_low, eps_high)
        c.raise_if_any()
    with torch.no_grad():
        clipped = _policy_clipped(logp, old_logp, advantages, action_mask, eps_low, eps_high)
        return clipped.sum() / action_mask.sum().clamp(min=1)


def entropy_from_logits(
    logits: Tensor, action_mask: Tensor | None = None, *, chunk_tokens: int = 1024, validate: bool = True
) -> Tensor:
    """Per-token entropy ``[B, T]`` of ``softmax(logits)``, zero off ``action_mask``, detached, float32 or wider.

    Only action positions are visited, ``chunk_tokens`` at a time: peak extra memory is ``O(chunk_tokens · V)``,
    never ``O(B · T · V)``."""
    if validate:
        c = Checks("entropy_from_logits")
        ok = c.tensor("logits", logits, ndim=(3,))
        if action_mask is not None:
            c.tensor(
                "action_mask",
                action_mask,
                kind="bool",
                shape=tuple(logits.shape[:2]) if ok else None,
                ndim=None if ok else (2,),
                like="logits [B, T]",
            )
        c.number("chunk_tokens", chunk_tokens, ge=1, integer=True)
        c.raise_if_any()
    B, T, _ = logits.shape
    dtype = torch.promote_types(logits.dtype, torch.float32)
    out = torch.zeros(B, T, dtype=dtype, device=logits.device)
    with torch.no_grad():
        if action_mask is None:
            index = torch.ones(B, T, dtype=torch.bool, device=logits.device).nonzero()
        else:
            index = action_mask.nonzero()
        bad = []
        for start in range(0, index.shape[0], chunk_tokens):
            rows, cols = index[start : start + chunk_tokens].unbind(-1)
            chunk = logits[rows, cols].detach().to(dtype)  # [c, V]: the only copy, chunk-sized
            logq = torch.log_softmax(chunk, dim=-1)
            # −Σ q·log q; a −inf logit (a masked vocabulary entry) contributes 0, not 0·(−inf) = NaN
            h = -torch.where(torch.isneginf(logq), 0.0, logq.exp() * logq).sum(-1)
            out[rows, cols] = h
            bad.append(~torch.isfinite(h))
        if validate and bad:
            c = Checks("entropy_from_logits")
            nonfinite = torch.zeros(B, T, dtype=torch.bool, device=logits.device)
            nonfinite[index[:, 0], index[:, 1]] = torch.cat(bad)
            c.when_any(
                nonfinite,
                "logits",
                "must give a finite entropy on action positions (no NaN or +inf logits, not all −inf)",
                noun="positions",
            )
            c.raise_if_any()
    return out


def masked_mean_var(x: Tensor, action_mask: Tensor, *, name: str = "x") -> tuple[Tensor, Tensor]:
    """Masked mean and unbiased masked variance ``Σ(x − x̄)²/(n − 1)`` (TRL's ``masked_var``), detached.

    Fewer than two action tokens raise (the unbiased variance is undefined there; TRL's raises on an empty mask)."""
    c = Checks("masked_mean_var")
    _check_token_args(c, {name: x}, action_mask)
    c.raise_if_any()
    n = int(action_mask.sum())
    if n < 2:
        raise LossplugError(f"masked_mean_var: {name}: the unbiased variance needs at least 2 action tokens, got {n}")
    with torch.no_grad():
        x = zero_off(x.detach(), action_mask)
        mean = x.sum() / n
        var = zero_off((x - mean).square(), action_mask).sum() / (n - 1)
    return mean, var


def ppo_diagnostics(
    logp: Tensor,
    old_logp: Tensor,
    action_mask: Tensor,
    *,
    advantages: Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    logits: Tensor | None = None,
    entropy: Tensor | None = None,
    values: Tensor | None = None,
    old_values: Tensor | None = None,
    returns: Tensor | None = None,
    value_clip_eps: float | None = None,
    entropy_chunk_tokens: int = 1024,
) -> dict[str, Tensor]:
    """TRL ≤ 0.11's PPO-epoch statistics for one micro-batch, as detached 0-d tensors.

    Always: ``policy/approx_kl``, ``policy/policy_kl``, ``policy/ratio_mean``. With ``advantages``:
    ``policy/clip_frac``, ``policy/advantages_mean``. With ``logits`` or ``entropy``: ``policy/entropy``. With
    ``returns``: ``returns/mean``, ``returns/var``. With ``old_values`` (the rollout critic's ``V_old``, TRL's
    ``values``): ``value/mean``, ``value/var``. With ``values`` (current predictions, TRL's ``vpreds``) and
    ``returns``: ``value/vpred_mean``, ``value/error``; plus ``old_values`` and ``value_clip_eps``:
    ``value/clip_frac``.
    """
    if (
        advantages is not None
        and isinstance(advantages, Tensor)
        and advantages.ndim == 1
        and isinstance(logp, Tensor)
        and logp.ndim == 2
    ):
        advantages = advantages.unsqueeze(-1).expand_as(logp)
    _check_diagnostics_args(
        logp,
        old_logp,
        action_mask,
        advantages,
        eps_low,
        eps_high,
        logits,
        entropy,
        values,
        old_values,
        returns,
        value_clip_eps,
    )
    if int(action_mask.sum()) == 0:
        raise LossplugError("ppo_diagnostics: action_mask: the micro-batch needs at least one action token, got none")

    mask = action_mask
    out: dict[str, Tensor] = {}
    with torch.no_grad():
        log_ratio = _log_ratio(logp, old_logp, mask)
        out["policy/approx_kl"] = 0.5 * _mean(log_ratio.square(), mask)
        out["policy/policy_kl"] = _mean(-log_ratio, mask)
        out["policy/ratio_mean"] = _mean(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp(), mask)
        if advantages is not None:
            clipped = _policy_clipped(logp, old_logp, advantages, mask, eps_low, eps_high)
            out["policy/clip_frac"] = clipped.sum() / mask.sum()
            out["policy/advantages_mean"] = _mean(advantages.detach(), mask)
        if logits is not None:
            entropy = entropy_from_logits(logits, mask, chunk_tokens=entropy_chunk_tokens)
        if entropy is not None:
            out["policy/entropy"] = _mean(entropy.detach(), mask)
        if returns is not None:
            out["returns/mean"], out["returns/var"] = masked_mean_var(returns, mask, name="returns")
        if old_values is not None:
            out["value/mean"], out["value/var"] = masked_mean_var(old_values, mask, name="old_values")
        if values is not None and returns is not None:
            out["value/vpred_mean"] = _mean(values.detach(), mask)
            out["value/error"] = _mean((values.detach() - returns.detach()).square(), mask)
            if value_clip_eps is not None:
                vl = value_loss(
                    values.detach(),
                    old_values,  # type: ignore[arg-type]  # checked
                    returns,
                    mask,
                    clip_eps=value_clip_eps,
                    validate=False,
                )
                out["value/clip_frac"] = vl.clip_frac
    return out


def _check_diagnostics_args(
    logp: Tensor,
    old_logp: Tensor,
    action_mask: Tensor,
    advantages: Tensor | None,
    eps_low: float,
    eps_high: float | None,
    logits: Tensor | None,
    entropy: Tensor | None,
    values: Tensor | None,
    old_values: Tensor | None,
    returns: Tensor | None,
    value_clip_eps: float | None,
) -> None:
    """:func:`ppo_diagnostics`' arguments, every problem reported at once."""
    c = Checks("ppo_diagnostics")
    named = {
        "logp": logp,
        "old_logp": old_logp,
        "advantages": advantages,
        "entropy": entropy,
        "values": values,
        "old_values": old_values,
        "returns": returns,
    }
    ok = _check_token_args(c, named, action_mask)
    if advantages is not None:
        _check_eps(c, eps_low, eps_high)
    if logits is not None and entropy is not None:
        c.fail("entropy", "give either logits or precomputed entropy, not both")
    if logits is not None and ok:
        c.tensor("logits", logits, ndim=(3,))
        if isinstance(logits, Tensor) and tuple(logits.shape[:2]) != tuple(logp.shape):
            c.fail("logits", f"must be [B, T, V] aligned with logp {list(logp.shape)}, got {list(logits.shape)}")
    if value_clip_eps is not None:
        c.number("value_clip_eps", value_clip_eps, ge=0.0, allow_inf=True)
        if values is None or old_values is None or returns is None:
            c.fail("value_clip_eps", "the value clip fraction needs values, old_values and returns")
    c.raise_if_any()


# ---------------------------------------------------------------------------------------------------------------------
# Ratio guard


class RatioGuardWarning(UserWarning):
    """The mean update ratio of a micro-batch exceeded the guard's threshold: the batch was skipped."""


LossLike = Tensor | Mapping[str, Tensor]


@dataclass(frozen=True)
class RatioGuard:
    """``loss``: the input loss (or dict of losses), multiplied by 0 when ``skipped``; ``mean_ratio`` (detached);
    ``metrics``: ``ratio_guard/skipped`` (1.0 or 0.0) and ``ratio_guard/mean_ratio``."""

    loss: LossLike
    skipped: bool
    mean_ratio: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


def ratio_guard(
    loss: LossLike,
    logp: Tensor,
    old_logp: Tensor,
    action_mask: Tensor,
    *,
    threshold: float = 10.0,
    validate: bool = True,
) -> RatioGuard:
    """Skip the batch (loss × 0, warning, ``skipped=1``) when ``mean(exp(logp − old_logp))`` over action tokens
    exceeds ``threshold`` (TRL ≤ 0.11's ``ratio_threshold``, default 10)."""
    if validate:
        c = Checks("ratio_guard")
        _check_token_args(c, {"logp": logp, "old_logp": old_logp}, action_mask)
        c.number("threshold", threshold, gt=0.0)
        losses = loss.items() if isinstance(loss, Mapping) else [("loss", loss)]
        for name, value in losses:
            if not isinstance(value, Tensor) or value.numel() != 1:
                what = list(value.shape) if isinstance(value, Tensor) else type(value).__name__
                c.fail(name, f"must be a scalar loss tensor, got {what}")
        c.raise_if_any()
        if int(action_mask.sum()) == 0:
            raise LossplugError("ratio_guard: action_mask: the micro-batch needs at least one action token, got none")
    with torch.no_grad():
        log_ratio = _log_ratio(logp, old_logp, action_mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        mean_ratio = _mean(log_ratio.exp(), action_mask)
    mean_value = float(mean_ratio)
    skipped = mean_value > threshold
    if skipped:
        warnings.warn(
            f"ratio_guard: the mean update ratio of the batch ({mean_value:.2f}) exceeds the threshold "
            f"{threshold:.2f}; skipping the batch (loss multiplied by 0)",
            RatioGuardWarning,
            stacklevel=2,
        )
        loss = {k: v * 0.0 for k, v in loss.items()} if isinstance(loss, Mapping) else loss * 0.0
    metrics = {
        "ratio_guard/skipped": torch.tensor(1.0 if skipped else 0.0, device=mean_ratio.device),
        "ratio_guard/mean_ratio": mean_ratio,
    }
    return RatioGuard(loss=loss, skipped=skipped, mean_ratio=mean_ratio, metrics=metrics)
