"""PPO's clipped surrogate, with clip-higher and dual-clip.

Objective per action token, with ratio ``r = exp(logp − old_logp)`` and advantage ``A``::

    J = min(r·A, clip(r, 1 − eps_low, 1 + eps_high)·A)                  (sign-aware: the min is the point)
    J = max(J, c·A)        where A < 0, if dual_clip_c = c is set (c > 1)

``delta`` (TRL's ``delta``, INTELLECT-2's two-sided clip) caps the unclipped branch instead::

    J = min(min(r, δ)·A, clip(r, 1 − eps_low, 1 + eps_high)·A)

(TRL: ``coef_1 = clamp(coef_1, max=delta)`` after ``coef_2`` is taken from the unclamped ratio). For ``δ ≥ 1 +
eps_high`` that is the dual clip at ``c = δ``; below, it also caps positive-advantage ratios at ``δ`` and leaves a
negative-advantage ratio in ``(δ, 1 + eps_high]`` its raw branch — TRL's loss for every ``δ``, which the dual clip
is not.

For ``A > 0`` only ratios above ``1 + eps_high`` are cut (their gradient is zero); for ``A < 0`` only ratios below
``1 − eps_low``. The other side keeps the raw branch and its gradient. Dual-clip additionally bounds the objective
of negative-advantage tokens at ``c·A`` when the ratio explodes (gradient zero there). Gradient flows through
``logp`` only; ``old_logp`` is treated as a constant.

The log-ratio is clamped to ``±log_ratio_clamp`` before ``exp`` (verl's safety clamp, 20 by default) so that a
log-ratio of ±100 can never produce inf or NaN.

Paper: Schulman et al., 2017, *Proximal Policy Optimization Algorithms*, arXiv:1707.06347; clip-higher
(``eps_high > eps_low``) from DAPO (Yu et al., 2025, arXiv:2503.14476); dual-clip from Ye et al., 2020, *Mastering
Complex Control in MOBA Games with Deep Reinforcement Learning*, arXiv:1912.09729.

Reference: verl ``compute_policy_loss_vanilla`` (``clip_ratio_low/high``, ``clip_ratio_c``); TRL ``GRPOTrainer``
(``epsilon``, ``epsilon_high``, ``delta``); Prime Intellect, 2025, *INTELLECT-2*, arXiv:2505.07291 (``delta``).
"""

from __future__ import annotations

import functools

import torch
from pydantic import Field

import lossplug
from lossplug.ops import clamp_exact


class PPOClipParams(lossplug.Params):
    eps_low: float = Field(0.2, gt=0, lt=1, description="lower clip: ratios below 1 − eps_low are cut when A < 0")
    eps_high: float = Field(0.2, gt=0, description="upper clip: ratios above 1 + eps_high are cut when A > 0")
    dual_clip_c: float | None = Field(None, gt=1, description="dual-clip bound c·A for A < 0 (e.g. 3)")
    delta: float | None = Field(
        None,
        gt=1,
        description="cap on the unclipped branch: min(min(r, delta)·A, clip(r)·A) (TRL's delta, INTELLECT-2; "
        "the dual clip at c = delta when delta ≥ 1 + eps_high); null: none",
    )
    log_ratio_clamp: float = Field(20.0, gt=0, description="the log-ratio is clamped to ± this before exp")


@lossplug.gate("ppo_clip", params=PPOClipParams, requires=("old_logp",))
def ppo_clip(inp: lossplug.GateInput, p: PPOClipParams) -> lossplug.GateOutput:
    """PPO clip: min(r·A, clip(r, 1−eps_low, 1+eps_high)·A), optional dual-clip max(·, c·A) for A < 0; with
    ``delta``: min(min(r, δ)·A, clip(r)·A)."""
    adv = inp.broadcast_advantage()
    ratio = clamp_exact(inp.update_log_ratio(), -p.log_ratio_clamp, p.log_ratio_clamp).exp()
    clipped = ratio.clamp(1 - p.eps_low, 1 + p.eps_high) * adv
    unclipped = ratio if p.delta is None else ratio.clamp(max=p.delta)
    surrogate = objective = torch.minimum(unclipped * adv, clipped)
    if p.dual_clip_c is not None:
        bound = p.dual_clip_c * adv
        objective = torch.where(adv < 0, torch.maximum(surrogate, bound), surrogate)

    # Off the actions the inputs are cleaned to 0, so r = exp(0) = 1 exactly: never below 1 − eps_low nor above
    # 1 + eps_high, and never past the dual bound (min(A, A) = A > c·A for A < 0) — no token there is counted, and
    # no mask pass is needed.
    @functools.cache
    def cut() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        hits = {"low": (ratio < 1 - p.eps_low, adv < 0), "high": (ratio > 1 + p.eps_high, adv > 0)}
        if p.dual_clip_c is not None:
            hits["dual"] = (surrogate < bound, adv < 0)
        if p.delta is not None:  # the capped branch δ·A is the minimum: a constant, no gradient
            hits["delta"] = (ratio > p.delta, p.delta * adv < clipped)
        return hits

    def fraction(side: str) -> torch.Tensor:
        return inp.token_fraction(*cut()[side], false_off_actions=True)

    def active() -> torch.Tensor:
        cuts = [hit & where for hit, where in cut().values()]
        any_cut: torch.Tensor = functools.reduce(torch.logical_or, cuts)
        return ~any_cut

    metrics = {"clip_frac_low": lambda: fraction("low"), "clip_frac_high": lambda: fraction("high")}
    if p.dual_clip_c is not None:
        metrics["clip_frac_dual"] = lambda: fraction("dual")
    if p.delta is not None:
        metrics["delta_frac"] = lambda: fraction("delta")
    return lossplug.GateOutput(objective=objective, metrics=metrics, active=active)
