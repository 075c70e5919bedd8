"""Policy losses anchored at the rollout engine's log-probs: no old-policy forward pass.

An asynchronous or engine-mismatched trainer often has no ``old_logp`` (the training engine's log-probs before the
update) — only the log-probs the rollout engine reported when it sampled the tokens (``behavior_logp``). These gates
take their ratio against those directly, per action token::

    ρ = exp(logp − behavior_logp)                      (log-ratio clamped to ± log_ratio_clamp before exp)

* ``importance_sampling`` — the plain importance-weighted policy gradient, the ratio *not* detached::

      J = ρ · A                                       ∂J/∂logp = ρ · A

* ``rollout_is`` — a calibrated, detached importance weight, zero outside the interval::

      J = sg(ρ · 1[1 − eps_low < ρ < 1 + eps_high]) · A · logp

  the same rule as :mod:`dis <lossplug.plugins.gates.dis>` (whose ``low``/``high`` are ``eps_low``/``eps_high``),
  here with SkyRL's defaults and name; it is the gate ``dis`` computes, called through it.

* ``cispo_rollout`` — CISPO's clipped, detached weight on the rollout ratio (every token keeps its gradient)::

      J = sg(clip(ρ, 1 − eps_low, 1 + eps_high)) · A · logp

The trainer skips the old-policy pass exactly when nothing else needs ``old_logp``: these gates do not declare it,
so a batch without it is valid for them (the pipeline's ``update/*`` metrics then stay out, having no update
ratio). Gradient flows through ``logp`` only; ``behavior_logp`` and the advantage are constants.

Reference: SkyRL 0.3.0 (``pip download skyrl==0.3.0``), ``skyrl/backends/skyrl_train/utils/ppo_utils.py``:
``importance_sampling_loss``, ``rollout_is_policy_loss`` and ``compute_policy_loss_cispo`` (``PolicyLossRegistry``;
``rollout_is`` is in ``LOSSES_WITHOUT_OLD_LOGPROBS``, the losses for which ``RayPPOTrainer._skip_policy_forward``
skips the old-log-prob pass). ``importance_sampling`` and ``cispo`` reach that code through SkyRL's Tinker API with
``old_log_probs`` = the datum's *sampling* log-probs (``skyrl/backends/skyrl_train_backend.py``, which also copies
them into ``rollout_logprobs``), and SkyRL's JAX backend computes both against ``sampling_logprobs``
(``skyrl/tinker/loss_fns.py``). SkyRL's ``importance_sampling`` exponentiates without a clamp (the clamp here changes
nothing while ``|log ρ| ≤ 20``, where SkyRL's loss is finite); its other losses clamp at ±20 (``safe_exp_delta``, in
float32). SkyRL sums the per-token loss and folds its reduction into the advantages
(``apply_loss_reduction_to_advantages_minibatch``): ``token_mean`` is lossplug's ``token`` reduction,
``sequence_mean`` its ``response``, ``prompt_mean`` its ``prompt_mean``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from pydantic import Field

import lossplug
from lossplug.ops import clamp_exact, count_actions

from .dis import DISParams, dis

Tensor = torch.Tensor

#: SkyRL's ``safe_exp_delta`` clamp of the log-ratio before exp
LOG_RATIO_CLAMP = 20.0


def _clamp_field() -> Any:
    return Field(
        LOG_RATIO_CLAMP,
        gt=0,
        le=80,
        description="the log-ratio logp − behavior_logp is clamped to ± this before exp (SkyRL: 20)",
    )


def _rollout_log_ratio(inp: lossplug.GateInput, bound: float) -> Tensor:
    """``logp − behavior_logp`` clamped to ``± bound``, zero off the actions, gradient through ``logp``."""
    behavior_logp = cast(Tensor, inp.behavior_logp)  # set: every gate here declares it
    return clamp_exact(inp.logp - behavior_logp, -bound, bound)


class ImportanceSamplingParams(lossplug.Params):
    log_ratio_clamp: float = _clamp_field()


@lossplug.gate("importance_sampling", params=ImportanceSamplingParams, requires=("behavior_logp",))
def importance_sampling(inp: lossplug.GateInput, p: ImportanceSamplingParams) -> lossplug.GateOutput:
    """Importance sampling against the rollout policy: ρ·A with ρ = exp(logp − behavior_logp), not detached."""
    ratio = _rollout_log_ratio(inp, p.log_ratio_clamp).exp()
    objective = ratio * inp.broadcast_advantage()

    def clamped_frac() -> Tensor:  # tokens whose log-ratio hit the safety clamp (flat objective there)
        log_ratio = (inp.logp.detach() - cast(Tensor, inp.behavior_logp)).abs()
        return inp.token_fraction(log_ratio > p.log_ratio_clamp, false_off_actions=True)

    return lossplug.GateOutput(objective=objective, metrics={"clamp_frac": clamped_frac}, active=lambda: inp.mask)


class RolloutISParams(lossplug.Params):
    eps_low: float = Field(
        0.2, gt=0, lt=1, description="weights with ρ ≤ 1 − eps_low are zeroed (SkyRL: eps_clip_low, 0.2)"
    )
    eps_high: float = Field(
        0.2, gt=0, description="weights with ρ ≥ 1 + eps_high are zeroed (SkyRL: eps_clip_high, 0.2)"
    )
    log_ratio_clamp: float = _clamp_field()


@lossplug.gate("rollout_is", params=RolloutISParams, requires=("behavior_logp",))
def rollout_is(inp: lossplug.GateInput, p: RolloutISParams) -> lossplug.GateOutput:
    """Calibrated rollout IS: sg(ρ·1[1−eps_low < ρ < 1+eps_high])·A·logp, ρ = exp(logp − behavior_logp)."""
    return dis(inp, DISParams(low=p.eps_low, high=p.eps_high, log_ratio_clamp=p.log_ratio_clamp))


class CISPORolloutParams(lossplug.Params):
    eps_low: float = Field(
        0.0, ge=0, le=1, description="weights below 1 − eps_low are raised to it (SkyRL: cispo_eps_clip_low, 0.0)"
    )
    eps_high: float = Field(
        5.0, gt=0, description="weights above 1 + eps_high are capped (SkyRL: cispo_eps_clip_high, 5.0)"
    )
    log_ratio_clamp: float = _clamp_field()


@lossplug.gate("cispo_rollout", params=CISPORolloutParams, requires=("behavior_logp",))
def cispo_rollout(inp: lossplug.GateInput, p: CISPORolloutParams) -> lossplug.GateOutput:
    """CISPO on the rollout ratio: sg(clip(ρ, 1−eps_low, 1+eps_high))·A·logp, ρ = exp(logp − behavior_logp)."""
    lower, upper = 1 - p.eps_low, 1 + p.eps_high
    with torch.no_grad():
        ratio = _rollout_log_ratio(inp, p.log_ratio_clamp).detach().exp()
        coefficient = ratio.clamp(lower, upper)
    objective = coefficient * inp.broadcast_advantage() * inp.logp

    # off the actions ρ = exp(0) = 1: never below lower ≤ 1 nor above upper > 1, so no mask pass is needed
    def fraction(hit: Tensor) -> Tensor:
        return count_actions(hit, inp.mask, inp.lengths, false_off_actions=True) / inp.action_tokens

    return lossplug.GateOutput(
        objective=objective,
        metrics={"clip_frac_low": lambda: fraction(ratio < lower), "clip_frac_high": lambda: fraction(ratio > upper)},
        # the clip saturates the weight only: every action token keeps its gradient
        active=lambda: inp.mask,
    )
