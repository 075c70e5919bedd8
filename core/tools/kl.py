"""KL estimators against the frozen reference policy, verl's ``kl_penalty`` modes, and the KL coefficient controllers.

Per action token, with ``logp`` the current policy's log-prob of the sampled token (carries the gradient), ``ref`` the
reference policy's and ``δ = ref − logp`` (Schulman, "Approximating KL divergence", 2020; tokens sampled from the
current policy ``π``)::

    k1 = logp − ref = −δ                    E_π[k1] = KL(π‖π_ref), unbiased; may be negative per token
    k2 = ½ (logp − ref)²                    ≥ 0, biased; ∂k2/∂logp = logp − ref
    k3 = exp(δ) − δ − 1                     ≥ 0, E_π[k3] = KL(π‖π_ref), unbiased, low variance ("low_var_kl")

Gradient contract (lossplug's ``k1``/``k2``/``k3``): the gradient flows through ``logp`` only — ``ref_logp`` is
detached. ``∂k1/∂logp = 1``, ``∂k2/∂logp = logp − ref``, ``∂k3/∂logp = 1 − exp(δ)``.

``k3`` is computed in log space from the log-ratio: ``δ`` is clamped *above* at ``max_log_ratio`` (20 by default,
the same bound verl uses) so ``exp`` cannot overflow — ``δ = ±100`` gives finite values; the gradient is zero where
the clamp is active. Below, nothing is clamped (``exp(−100)`` is harmless), so ``k3(δ = −100) = 99`` exactly.
``expm1(δ) − δ`` is used instead of ``exp(δ) − δ − 1`` (same value, less cancellation near ``δ = 0``), and the result
is clamped at 0 against rounding. float16/bfloat16 inputs are computed and returned in float32 (``exp(20)`` does not
fit in float16).

:func:`kl_penalty` reproduces verl 0.9.1's ``kl_penalty`` **exactly**, clamps included, mode by mode::

    "kl", "k1"          logp − ref
    "abs"               |logp − ref|
    "mse", "k2"         ½ (logp − ref)²
    "low_var_kl", "k3"  clamp(exp(δ') − δ' − 1, −10, 10),  δ' = clamp(δ, −20, 20)
    "<mode>+"           straight-through: the value of <mode>, the gradient of k2 (unbiased KL gradient)

Note verl's ``low_var_kl`` differs from lossplug's :func:`k3`: it clamps the log-ratio on both sides and the
*estimate* at 10 (so it saturates — biased — for |δ| ≳ 2.4), where :func:`k3` keeps the exact value up to
``max_log_ratio``; and its naive ``exp(δ) − δ − 1`` can round slightly below 0 in float32 (``δ = 4e-8`` gives
``−6e-8``), where :func:`k3` is ``≥ 0`` by construction.

KL in the reward (TRL ≤ 0.11's ``compute_rewards``, verl's ``apply_kl_penalty``): :func:`kl_shaped_rewards` gives per
action token ``r_t = −β · kl_t``, plus the sequence score at the last action token (scores ``[B]``) — or plus
token-level scores ``[B, T]`` as given (verl's ``token_level_scores``). Its ``kl_mean`` is verl's ``current_kl``
(mean over responses of each response's token-mean KL), the number a controller's ``update`` takes. Rewards are
data: no gradient.

Controllers (the coefficient β of the penalty ``−β·KL``):

* :class:`AdaptiveKLController` — PPO-Penalty (arXiv:1707.06347, §4): after an update with measured KL
  ``d``, ``β ← β / 2`` if ``d < d_targ / 1.5``, ``β ← β · 2`` if ``d > 1.5 · d_targ``, else unchanged.
* :class:`ProportionalKLController` — verl's (and TRL's) ``AdaptiveKLController`` (Ziegler et al. 2019):
  ``e = clip(d / d_targ − 1, −0.2, 0.2)``, ``β ← β · (1 + e · n_steps / horizon)``.
* :class:`FixedKLController` — constant β.

All three expose ``.value`` and ``.update(current_kl, n_steps)`` like verl's, so either can be handed to verl's
``apply_kl_penalty``; and they are :class:`lossplug.control.Controller` s — ``coefficient``, ``state_dict()`` /
``load_state_dict()`` — the state mechanism the adaptive regularizers share (save and restore them with a checkpoint
the same way, see :mod:`lossplug.control`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lossplug.contracts import LossplugError
from lossplug.contracts.checks import Checks
from lossplug.contracts.errors import did_you_mean
from lossplug.ops import last_true, zero_off

Tensor = torch.Tensor

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "KL_PENALTY_MODES",
    "KLShapedRewards",
    "ProportionalKLController",
    "k1",
    "k2",
    "k3",
    "kl_penalty",
    "kl_shaped_rewards",
]

_BASE_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
#: every mode name verl 0.9.1's ``kl_penalty`` accepts ("full" is declared there but raises NotImplementedError)
KL_PENALTY_MODES: tuple[str, ...] = _BASE_MODES + tuple(m + "+" for m in _BASE_MODES)


def _check(contract: str, logp: Any, ref_logp: Any, action_mask: Any) -> None:
    c = Checks(contract)
    ok = c.tensor("logp", logp)
    shape = tuple(logp.shape) if ok else None
    ok &= c.tensor("ref_logp", ref_logp, shape=shape, like="logp")
    if action_mask is not None:
        ok &= c.tensor("action_mask", action_mask, kind="bool", shape=shape, like="logp")
    if ok:
        where = action_mask if action_mask is not None else torch.ones_like(logp, dtype=torch.bool)
        noun = "positions" if logp.ndim >= 2 else "rows"
        c.when_any(where & ~torch.isfinite(logp.detach()), "logp", "must be finite on action positions", noun=noun)
        c.when_any(
            where & ~torch.isfinite(ref_logp.detach()), "ref_logp", "must be finite on action positions", noun=noun
        )
    c.raise_if_any()


def _prepare(
    logp: Tensor, ref_logp: Tensor, action_mask: Tensor | None, detach_ref: bool = True
) -> tuple[Tensor, Tensor]:
    if action_mask is not None:
        logp, ref_logp = zero_off(logp, action_mask), zero_off(ref_logp, action_mask)
    return logp, (ref_logp.detach() if detach_ref else ref_logp)


def _finish(kl: Tensor, action_mask: Tensor | None) -> Tensor:
    return kl if action_mask is None else zero_off(kl, action_mask)


def k1(logp: Tensor, ref_logp: Tensor, action_mask: Tensor | None = None, *, validate: bool = True) -> Tensor:
    """``logp − ref`` per token (zero off ``action_mask`` when given); unbiased, may be negative."""
    if validate:
        _check("k1", logp, ref_logp, action_mask)
    lp, ref = _prepare(logp, ref_logp, action_mask)
    return _finish(lp - ref, action_mask)


def k2(logp: Tensor, ref_logp: Tensor, action_mask: Tensor | None = None, *, validate: bool = True) -> Tensor:
    """``½ (logp − ref)²`` per token (zero off ``action_mask`` when given); ≥ 0."""
    if validate:
        _check("k2", logp, ref_logp, action_mask)
    lp, ref = _prepare(logp, ref_logp, action_mask)
    return _finish(0.5 * (lp - ref).square(), action_mask)


def k3(
    logp: Tensor,
    ref_logp: Tensor,
    action_mask: Tensor | None = None,
    *,
    max_log_ratio: float = 20.0,
    validate: bool = True,
) -> Tensor:
    """``exp(δ) − δ − 1`` with ``δ = min(ref − logp, max_log_ratio)`` per token; ≥ 0 and finite for any finite input."""
    if validate:
        _check("k3", logp, ref_logp, action_mask)
        c = Checks("k3")
        c.number("max_log_ratio", max_log_ratio, gt=0.0)
        c.raise_if_any()
    lp, ref = _prepare(logp, ref_logp, action_mask)
    if lp.dtype in (torch.float16, torch.bfloat16):
        lp, ref = lp.float(), ref.float()
    delta = (ref - lp).clamp(max=max_log_ratio)
    return _finish((torch.expm1(delta) - delta).clamp(min=0.0), action_mask)


def _verl_forward(logp: Tensor, ref: Tensor, mode: str) -> Tensor:
    if mode in ("kl", "k1"):
        return logp - ref
    if mode == "abs":
        return (logp - ref).abs()
    if mode in ("mse", "k2"):
        return 0.5 * (logp - ref).square()
    # low_var_kl / k3, with verl's two clamps
    kl = torch.clamp(ref - logp, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def kl_penalty(
    logp: Tensor,
    ref_logp: Tensor,
    mode: str = "low_var_kl",
    action_mask: Tensor | None = None,
    *,
    validate: bool = True,
) -> Tensor:
    """verl 0.9.1's ``kl_penalty(logprob, ref_logprob, kl_penalty)``, value and gradient, for every mode in
    :data:`KL_PENALTY_MODES`; zero off ``action_mask`` when one is given (verl leaves masking to ``agg_loss``).

    Like verl, the gradient also reaches ``ref_logp`` if it requires grad (it normally is a frozen constant).
    """
    if validate:
        if not isinstance(mode, str) or mode not in KL_PENALTY_MODES:
            hint = did_you_mean(mode, KL_PENALTY_MODES) if isinstance(mode, str) else ""
            raise LossplugError(
                f"kl_penalty: mode: unknown KL penalty {mode!r}{hint}; known modes: {', '.join(KL_PENALTY_MODES)}"
            )
        _check("kl_penalty", logp, ref_logp, action_mask)
    lp, ref = _prepare(logp, ref_logp, action_mask, detach_ref=False)
    straight_through = mode.endswith("+")
    base = mode[:-1] if straight_through else mode
    forward = _verl_forward(lp, ref, base)
    if straight_through:  # (for "k2+"/"mse+" this changes nothing: value and gradient are already k2's)
        backward = 0.5 * (lp - ref).square()
        forward = backward - backward.detach() + forward.detach()
    return _finish(forward, action_mask)


@dataclass(frozen=True)
class KLShapedRewards:
    """``rewards`` ``[B, T]`` (score + ``non_score_rewards``), ``non_score_rewards = −β·kl``, the per-token ``kl``
    (all zero off actions) and ``kl_mean`` (0-d: mean over responses of the token-mean KL, for a controller)."""

    rewards: Tensor
    non_score_rewards: Tensor
    kl: Tensor
    kl_mean: Tensor


def kl_shaped_rewards(
    scores: Tensor,
    logp: Tensor,
    ref_logp: Tensor,
    action_mask: Tensor,
    *,
    kl_coef: float,
    mode: str = "kl",
    validate: bool = True,
) -> KLShapedRewards:
    """Per-token rewards with the KL penalty folded in (TRL ≤ 0.11's ``compute_rewards``; verl's ``apply_kl_penalty``).

    ``scores`` ``[B]`` (one reward-model score per response, added at its last action token) or ``[B, T]``
    (token-level scores, added as they are). ``logp`` is the rollout policy's log-prob (verl: ``old_log_probs``),
    ``mode`` any of :data:`KL_PENALTY_MODES` (``"kl"`` = k1, TRL's default). Detached. ``validate=False`` skips the
    input checks, for inputs a :class:`~lossplug.PolicyBatch` contract already checked (the ``kl_in_reward``
    shaper's).
    """
    with torch.no_grad():
        if validate:
            _check_shaped_inputs(scores, logp, ref_logp, action_mask, kl_coef)
            kl = kl_penalty(logp.detach(), ref_logp.detach(), mode, action_mask)
        else:  # (values only: the estimate on every position, then 0 off the actions — one masking, not three)
            kl = torch.where(action_mask, _verl_forward(logp.detach(), ref_logp.detach(), mode.removesuffix("+")), 0.0)
        non_score = -kl_coef * kl
        if scores.ndim == 1:  # the score on the last action token: −β·kl + s there, exactly verl's s − β·kl
            last = last_true(action_mask).unsqueeze(-1)
            rewards = non_score.scatter_add(-1, last, scores.unsqueeze(-1).to(kl.dtype))
        else:
            rewards = non_score + torch.where(action_mask, scores.to(kl.dtype), 0.0)
        per_response = kl.sum(-1) / action_mask.sum(-1).clamp(min=1)
        kl_mean = per_response.mean()
    return KLShapedRewards(rewards=rewards, non_score_rewards=non_score, kl=kl, kl_mean=kl_mean)


def _check_shaped_inputs(scores: Any, logp: Any, ref_logp: Any, action_mask: Any, kl_coef: Any) -> None:
    c = Checks("kl_shaped_rewards")
    ok = c.tensor("scores", scores, ndim=(1, 2))
    c.number("kl_coef", kl_coef, ge=0.0)
    if ok and isinstance(logp, Tensor) and logp.ndim == 2:
        want = (logp.shape[0],) if scores.ndim == 1 else tuple(logp.shape)
        if tuple(scores.shape) != want:
            c.fail("scores", f"must be [B] or [B, T] aligned with logp {list(logp.shape)}, got {list(scores.shape)}")
        else:
            rows = (
                ~action_mask.any(-1)
                if isinstance(action_mask, Tensor)
                and action_mask.dtype == torch.bool
                and tuple(action_mask.shape) == tuple(logp.shape)
                else None
            )
            if rows is not None:
                c.when_any(
                    rows,
                    "action_mask",
                    "every response needs at least one action token (its score goes on the last one)",
                )
            finite_where = action_mask if scores.ndim == 2 and rows is not None else None
            bad = ~torch.isfinite(scores) if finite_where is None else finite_where & ~torch.isfinite(scores)
            c.when_any(
                bad,
                "scores",
                "must be finite" + (" on action positions" if finite_where is not None else ""),
                noun="rows" if scores.ndim == 1 else "positions",
            )
    c.raise_if_any()


# ---------------------------------------------------------------------------------------------------------------------
# KL coefficient controllers


def _as_kl(current_kl: Any, who: str) -> float:
    if isinstance(current_kl, torch.Tensor):
        if current_kl.numel() != 1:
            raise LossplugError(f"{who}: current_kl must be a scalar, got a tensor of shape {list(current_kl.shape)}")
        current_kl = current_kl.item()
    # numpy is no dependency of lossplug, but a KL measured with it (np.float32, np.int64…) is a number all the same.
    # A numpy scalar can only exist once numpy is imported, so looking it up in sys.modules recognises exactly the
    # np.generic instances without importing it.
    np = sys.modules.get("numpy")
    if np is not None and isinstance(current_kl, np.generic):
        current_kl = current_kl.item()
    c = Checks(who)
    c.number("current_kl", current_kl)
    c.raise_if_any()
    return float(current_kl)


class AdaptiveKLController:
    """PPO-Penalty's adaptive β (PPO paper, §4): halve when ``d < target / tolerance``, double when ``d > target ·
    tolerance`` (``tolerance = 1.5``, ``factor = 2`` in the paper). ``n_steps`` is accepted and ignored, for verl's
    ``update(current_kl, n_steps)`` call."""

    def __init__(
        self,
        init_kl_coef: float,
        target_kl: float,
        *,
        tolerance: float = 1.5,
        factor: float = 2.0,
        min_kl_coef: float = 0.0,
        max_kl_coef: float = float("inf"),
    ):
        c = Checks("AdaptiveKLController")
        c.number("init_kl_coef", init_kl_coef, gt=0.0)
        c.number("target_kl", target_kl, gt=0.0)
        c.number("tolerance", tolerance, gt=1.0)
        c.number("factor", factor, gt=1.0)
        c.number("min_kl_coef", min_kl_coef, ge=0.0)
        c.number("max_kl_coef", max_kl_coef, gt=0.0, allow_inf=True)
        c.raise_if_any()
        if min_kl_coef > max_kl_coef:
            raise LossplugError(
                f"AdaptiveKLController: min_kl_coef ({min_kl_coef}) must be <= max_kl_coef ({max_kl_coef})"
            )
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.tolerance, self.factor = float(tolerance), float(factor)
        self.min_kl_coef, self.max_kl_coef = float(min_kl_coef), float(max_kl_coef)

    def update(self, current_kl: float | Tensor, n_steps: int | None = None) -> float:
        """Apply the rule for the measured KL ``d = current_kl``; return the new β."""
        d = _as_kl(current_kl, "AdaptiveKLController.update")
        if d < self.target / self.tolerance:
            self.value /= self.factor
        elif d > self.target * self.tolerance:
            self.value *= self.factor
        self.value = min(max(self.value, self.min_kl_coef), self.max_kl_coef)
        return self.value

    @property
    def coefficient(self) -> float:
        """The coefficient in force (``value``): a :class:`lossplug.control.Controller`."""
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.value = float(state["value"])


class ProportionalKLController:
    """verl's / TRL's ``AdaptiveKLController`` (Ziegler et al. 2019, arXiv:1909.08593), numerically identical:
    ``β ← β · (1 + clip(d / target − 1, −0.2, 0.2) · n_steps / horizon)``.

    Deliberate difference: where ``n_steps / horizon`` is large enough to make the multiplier ``≤ 0`` (``n_steps ≥
    5 · horizon`` with the KL far below target) verl silently turns β non-positive; this raises instead."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        c = Checks("ProportionalKLController")
        c.number("init_kl_coef", init_kl_coef, gt=0.0)
        c.number("target_kl", target_kl, gt=0.0)
        c.number("horizon", horizon, gt=0.0)
        c.raise_if_any()
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float | Tensor, n_steps: int) -> float:
        d = _as_kl(current_kl, "ProportionalKLController.update")
        c = Checks("ProportionalKLController.update")
        c.number("n_steps", n_steps, ge=0)
        c.raise_if_any()
        # d is a finite float (checked), so min/max clip exactly as np.clip did
        proportional_error = min(max(d / self.target - 1, -0.2), 0.2)
        mult = 1 + proportional_error * n_steps / self.horizon
        if mult <= 0:
            raise LossplugError(
                f"ProportionalKLController.update: n_steps: {n_steps} steps over horizon {self.horizon} with KL {d} "
                f"(target {self.target}) would make the coefficient non-positive (multiplier {float(mult):.3g}); "
                "use a horizon of at least n_steps / 5"
            )
        self.value = float(self.value * mult)
        return self.value

    @property
    def coefficient(self) -> float:
        """The coefficient in force (``value``): a :class:`lossplug.control.Controller`."""
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.value = float(state["value"])


class FixedKLController:
    """A constant β (verl's ``FixedKLController``)."""

    def __init__(self, kl_coef: float):
        c = Checks("FixedKLController")
        c.number("kl_coef", kl_coef, ge=0.0)
        c.raise_if_any()
        self.value = float(kl_coef)

    def update(self, current_kl: float | Tensor | None = None, n_steps: int | None = None) -> float:
        return self.value

    @property
    def coefficient(self) -> float:
        """The coefficient in force (``value``): a :class:`lossplug.control.Controller`."""
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.value = float(state["value"])
