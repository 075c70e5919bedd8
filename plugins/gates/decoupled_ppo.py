"""Decoupled PPO: the behaviour, proximal and current policies kept apart — PPO's clip on π_θ/π_prox, weighted by
the detached π_prox/π_behave.

Objective per action token, with advantage ``A``, ``r = exp(logp − prox)`` (log-ratio clamped to
``± log_ratio_clamp``) and ``w = exp(prox − behavior_logp)``::

    J = sg(w) · min(r·A, clip(r, 1 − eps_low, 1 + eps_high)·A)        (dual-clip max(·, c·A) for A < 0, as ppo_clip)

The trust region is centred on the *proximal* policy π_prox — the one the update starts from — not on the stale
behaviour policy that sampled the token; the importance weight ``w`` corrects for the staleness and carries no
gradient. ``behavior_weight: false`` drops ``w`` (AReaL 1.0.4 with ``rejection_sampling: null``, which multiplies
no weight), ``weight_cap`` / ``weight_floor`` bound it (AReaL's ``rejection_sampling`` at level ``token``, metric
``ratio``: ``weight_action: mask`` sets ``w = 0`` outside ``[floor, cap]`` — the former ``behav_imp_weight_cap`` —
``clamp`` truncates it). The log of ``w`` is clamped to ``± log_ratio_clamp`` like the ratio's.

``prox_logp`` says where π_prox comes from:

* ``recompute``: it is ``old_logp``, a forward pass of the training engine before the update (AReaL's default);
* ``loglinear`` / ``linear``: approximated without that forward pass from the token versions, with
  ``v_θ = policy_version`` (the version the update starts from, AReaL's ``current_version``), ``v_prox = v_θ − 1``
  and ``v_behave = behavior_version``::

      α = clamp((v_prox − v_behave) / (v_θ − v_behave), 0, 1)      (0 where v_θ = v_behave)
      loglinear:  prox = behavior_logp + α · (sg(logp) − behavior_logp)
      linear:     prox = log((1 − α)·exp(behavior_logp) + α·exp(sg(logp)) + 1e-10)

  so a token sampled by the newest weights (``v_behave = v_θ``) or by the version just before them has π_prox =
  π_behave (``w = 1``), an older one is interpolated towards the current policy. This is AReaL's labelling: the
  update starts from the weights of version ``v_θ`` (AReaL's ``engine.get_version()``, which is also what the
  rollout stamps on tokens sampled by those weights) and its proximal policy is taken one version behind them;
* ``rollout``: ``prox = behavior_logp`` (``w = 1``, the ratio is ``π_θ/π_behave``).

``m2_threshold`` applies M2PO's mask (the ``m2po`` gate, renormalised as AReaL does) on ``(prox − behavior_logp)²``
of the micro-batch — as AReaL's ``grpo_loss_fn`` does with the resolved (possibly approximated) π_prox.

Detach/gradient contract: ``w``, π_prox (approximations read ``logp`` detached), ``old_logp``, ``behavior_logp``
and the advantage are constants; gradient flows through ``logp`` in ``r`` only.

Paper: Fu et al., 2025, *AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning*,
arXiv:2505.24298 (the decoupled PPO objective); Hilton et al., 2021, *Batch size-invariance for policy
optimization*, arXiv:2110.00641 (the proximal policy).

Reference: AReaL 1.0.4 ``areal/utils/functional/functional.py`` ``ppo_actor_loss_fn`` / ``apply_rejection_sampling``
(``actor.use_decoupled_loss``, ``eps_clip``, ``eps_clip_higher``, ``c_clip``, ``rejection_sampling``) and
``areal/trainer/ppo/actor.py`` ``compute_prox_logp_approximations`` (``actor.prox_logp_method``; AReaL's
``logprobs`` are the behaviour policy's, ``prox_logp`` the proximal one's); AReaL's
``docs/en/algorithms/prox_approx.md``.
"""

from __future__ import annotations

import functools
from typing import Literal, cast

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.ops import clamp_exact

from .m2po import m2po_weight

Tensor = torch.Tensor


class DecoupledPPOParams(lossplug.Params):
    eps_low: float = Field(0.2, gt=0, lt=1, description="lower clip of r = π_θ/π_prox for A < 0 (AReaL's eps_clip)")
    eps_high: float = Field(0.2, gt=0, description="upper clip of r for A > 0 (AReaL's eps_clip_higher, else eps_clip)")
    dual_clip_c: float | None = Field(None, gt=1, description="dual-clip bound c·A for A < 0 (AReaL's c_clip)")
    log_ratio_clamp: float = Field(
        20.0, gt=0, le=80, description="the log of r and of w is clamped to ± this before exp"
    )
    prox_logp: Literal["recompute", "loglinear", "linear", "rollout"] = Field(
        "recompute",
        description="π_prox: old_logp (recompute), approximated from the token versions (loglinear, linear), or "
        "behavior_logp (rollout); AReaL's prox_logp_method",
    )
    behavior_weight: bool = Field(
        True, description="multiply by w = π_prox/π_behave; false: no weight (AReaL 1.0.4 without rejection_sampling)"
    )
    weight_cap: float | None = Field(
        None, gt=0, description="upper bound of w (AReaL's rejection_sampling.upper, level token, metric ratio)"
    )
    weight_floor: float | None = Field(
        None, gt=0, description="lower bound of w, with weight_cap (AReaL's rejection_sampling.lower)"
    )
    weight_action: Literal["mask", "clamp"] = Field(
        "mask",
        description="w outside [weight_floor, weight_cap]: set to 0 (mask, AReaL's behav_imp_weight_cap) or clamped "
        "into it (clamp)",
    )
    m2_threshold: float | None = Field(
        None, gt=0, description="M2PO's τ on (prox − behavior_logp)² per micro-batch (AReaL's m2_threshold)"
    )

    @model_validator(mode="after")
    def _bounds(self) -> DecoupledPPOParams:
        if self.weight_floor is not None and self.weight_cap is None:
            raise ValueError("weight_floor needs weight_cap (AReaL's rejection_sampling always has an upper bound)")
        if self.weight_floor is not None and self.weight_cap is not None and self.weight_floor > self.weight_cap:
            raise ValueError(f"weight_floor ({self.weight_floor}) must not exceed weight_cap ({self.weight_cap})")
        if self.weight_cap is not None and not self.behavior_weight:
            raise ValueError("weight_cap bounds the behaviour weight: it needs behavior_weight: true")
        return self


def _requires(p: DecoupledPPOParams) -> tuple[str, ...]:
    if p.prox_logp in ("loglinear", "linear"):
        return ("behavior_logp", "behavior_version", "policy_version")
    if p.prox_logp == "rollout":
        return ("behavior_logp",)
    reads_behaviour = p.behavior_weight or p.m2_threshold is not None
    return ("old_logp", "behavior_logp") if reads_behaviour else ("old_logp",)


def version_alpha(inp: lossplug.GateInput) -> Tensor:
    """AReaL's interpolation factor ``α = clamp((v_prox − v_behave)/(v_θ − v_behave), 0, 1)`` per token ``[B, T]``
    (or a ``[B, 1]`` column for a ``[B]`` behavior_version), 0 where ``v_θ = v_behave``; ``v_θ`` is the row's
    ``policy_version``, ``v_prox = v_θ − 1``."""
    batch = inp.batch
    behavior, policy = batch.behavior_version, batch.policy_version
    if behavior is None or policy is None:  # declared in requires=: such a batch fails validation
        raise lossplug.LossplugError("decoupled_ppo's version approximation needs behavior_version and policy_version")
    v_behave = (behavior if behavior.ndim == 2 else behavior.unsqueeze(-1)).to(inp.compute_dtype)
    v_theta = policy.unsqueeze(-1).to(inp.compute_dtype)
    version_diff = v_theta - v_behave
    alpha = torch.where(version_diff > 0, (v_theta - 1 - v_behave) / version_diff.clamp(min=1), 0.0)
    return alpha.clamp(0.0, 1.0)


def proximal_logp(inp: lossplug.GateInput, p: DecoupledPPOParams) -> Tensor:
    """π_prox's log-probs ``[B, T]``, detached, 0 off the actions."""
    if p.prox_logp == "recompute":
        return cast(Tensor, inp.old_logp)  # declared in requires=: a batch without it fails validation
    behave = cast(Tensor, inp.behavior_logp)
    if p.prox_logp == "rollout":
        return behave
    with torch.no_grad():
        alpha, theta = version_alpha(inp), inp.logp.detach()
        if p.prox_logp == "loglinear":
            prox = behave + alpha * (theta - behave)
        else:
            prox = torch.log((1 - alpha) * behave.exp() + alpha * theta.exp() + 1e-10)
        return torch.where(inp.mask, prox, 0.0)


def behaviour_weight(inp: lossplug.GateInput, p: DecoupledPPOParams, prox: Tensor) -> tuple[Tensor, Tensor | None]:
    """``w = π_prox/π_behave`` bounded as the parameters say (1 without behavior_weight), detached, and the tokens
    it rejected (mask action) or None."""
    if not p.behavior_weight or p.prox_logp == "rollout":
        return torch.ones((), dtype=prox.dtype), None
    with torch.no_grad():
        log_w = clamp_exact(prox - cast(Tensor, inp.behavior_logp), -p.log_ratio_clamp, p.log_ratio_clamp)
        w = log_w.exp()
        if p.weight_cap is None:
            return w, None
        if p.weight_action == "clamp":
            return w.clamp(min=p.weight_floor or 0.0, max=p.weight_cap), None
        rejected = w > p.weight_cap
        if p.weight_floor is not None:
            rejected |= w < p.weight_floor
        return torch.where(rejected, 0.0, w), rejected


@lossplug.gate("decoupled_ppo", params=DecoupledPPOParams, requires=_requires)
def decoupled_ppo(inp: lossplug.GateInput, p: DecoupledPPOParams) -> lossplug.GateOutput:
    """Decoupled PPO: sg(π_prox/π_behave) · min(r·A, clip(r, 1−eps_low, 1+eps_high)·A), r = π_θ/π_prox."""
    adv = inp.broadcast_advantage()
    prox = proximal_logp(inp, p)
    ratio = clamp_exact(inp.logp - prox, -p.log_ratio_clamp, p.log_ratio_clamp).exp()  # 1 off the actions
    surrogate = objective = torch.minimum(ratio * adv, ratio.clamp(1 - p.eps_low, 1 + p.eps_high) * adv)
    if p.dual_clip_c is not None:
        bound = p.dual_clip_c * adv
        objective = torch.where(adv < 0, torch.maximum(surrogate, bound), surrogate)
    weight, rejected = behaviour_weight(inp, p, prox)
    keep = None
    if p.m2_threshold is not None:
        m2_weight, keep = m2po_weight(inp, prox - cast(Tensor, inp.behavior_logp), p.m2_threshold, True)
        weight = weight * m2_weight
    objective = weight.detach() * objective

    @functools.cache
    def cut() -> dict[str, tuple[Tensor, Tensor]]:
        hits = {"low": (ratio < 1 - p.eps_low, adv < 0), "high": (ratio > 1 + p.eps_high, adv > 0)}
        if p.dual_clip_c is not None:
            hits["dual"] = (surrogate < bound, adv < 0)
        return hits

    def fraction(side: str) -> Tensor:
        return inp.token_fraction(*cut()[side], false_off_actions=True)

    def active() -> Tensor:
        clipped = functools.reduce(torch.logical_or, [hit & where for hit, where in cut().values()])
        return inp.mask & ~clipped & (weight != 0)

    metrics = {"clip_frac_low": lambda: fraction("low"), "clip_frac_high": lambda: fraction("high")}
    if p.dual_clip_c is not None:
        metrics["clip_frac_dual"] = lambda: fraction("dual")
    if rejected is not None:
        rejected_tokens = rejected
        metrics["weight_rejected_frac"] = lambda: inp.token_fraction(rejected_tokens)
    if keep is not None:
        kept_tokens = keep
        metrics["m2_masked_frac"] = lambda: inp.token_fraction(~kept_tokens)
    details = {"behavior_weight_mean": lambda: inp.masked_mean(weight.expand(inp.mask.shape))}
    return lossplug.GateOutput(objective=objective, metrics=metrics, details=details, active=active)
