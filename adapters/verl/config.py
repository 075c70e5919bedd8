"""verl's config and lossplug: :class:`LossplugPolicyLossConfig`, the actor's ``policy_loss`` config that carries
the recipe — selected with ``actor_rollout_ref.actor.policy_loss._target_=lossplug.adapters.verl.LossplugPolicyLossConfig``
— and holds its :class:`~lossplug.adapters.verl.plan.PolicyPlan`, derived once when verl builds it; and
:func:`policy_plan`, the plan of the config verl hands the policy loss. Recipes themselves load in :mod:`.recipes`
(:func:`load_recipe`, re-exported here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl.workers.config import PolicyLossConfig

from lossplug.adapters.verl.plan import PolicyPlan, checked_levels, plan_for_section
from lossplug.adapters.verl.recipes import ADVANTAGE_RECIPE_KEY, POLICY_RECIPE_KEY, keyed, load_recipe
from lossplug.adapters.verl.registration import NAME
from lossplug.adapters.verl.trl_beside import warn_if_trl_breaks_verl
from lossplug.contracts import LossplugError

__all__ = [
    "ADVANTAGE_RECIPE_KEY",
    "POLICY_RECIPE_KEY",
    "LossplugPolicyLossConfig",
    "keyed",
    "load_recipe",
    "policy_plan",
]

#: where a LossplugPolicyLossConfig keeps its plan (an attribute, not a dataclass field: not part of verl's config)
_PLAN = "_lossplug_plan"


@dataclass
class LossplugPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus lossplug's fields; select it with
    ``actor_rollout_ref.actor.policy_loss._target_=lossplug.adapters.verl.LossplugPolicyLossConfig``.

    ``recipe``: preset name, recipe YAML/JSON path (absolute: Ray workers may run in another directory) or an inline
    mapping. ``validation``: ``full`` checks every micro-batch against the batch contract (one host sync), ``off``
    skips it. ``metrics``: lossplug's metrics under ``actor/lossplug/`` — ``basic`` (default: each gate's cut fractions,
    at about the cost of verl's own ``pg_clipfrac``), ``full`` (also ratio quantiles and effective-sample fractions)
    or ``off`` (``true``/``false`` mean ``full``/``off``); ``actor/ppo_kl`` is reported unless ``off``, and with
    ``rollout_log_probs`` also ``actor/rollout_corr/kl`` (verl's ``rollout_corr/kl``: mean of rollout − old log-probs).
    Under ``loss_mode=lossplug`` verl's ``clip_ratio*``, ``clip_ratio_c`` and ``tau_*`` are not read: the recipe's
    parameters are the only ones.

    ``rollout_correction``: verl's ``algorithm.rollout_correction``, forwarded to the actor with
    ``+actor_rollout_ref.actor.policy_loss.rollout_correction=${algorithm.rollout_correction}`` (verl itself copies it
    there only in bypass mode, where ``loss_mode`` becomes ``bypass_mode``). With it, a recipe may keep its correction
    gates against the rollout engine when they are exactly what that config maps to
    (:func:`~lossplug.adapters.verl.equivalent.rollout_correction.correction_gates`): verl's driver computes them and
    hands the loss ``rollout_is_weights`` (and removes rejected tokens from ``response_mask``), so the adapter drops
    them from the policy term and applies verl's weights, once. ``None`` (the default here; verl's own dataclass
    default is a ``rollout_is: sequence`` config nobody set): not forwarded.
    """

    loss_mode: str = NAME
    recipe: Any = None
    validation: str = "full"
    metrics: Any = "basic"
    rollout_correction: Any = None

    def __post_init__(self) -> None:
        checked_levels(self.validation, self.metrics)
        if self.loss_mode != NAME:
            if self.recipe is not None:
                raise LossplugError(
                    f"{POLICY_RECIPE_KEY} is set but actor_rollout_ref.actor.policy_loss.loss_mode="
                    f"{self.loss_mode}: the recipe is only used with loss_mode={NAME}"
                )
            return
        self._keep_plan()
        warn_if_trl_breaks_verl()  # this process builds a verl actor: where TRL beside verl fails

    @property
    def plan(self) -> PolicyPlan:
        """What this configuration resolves to, derived once (when verl builds the config, or on first use after a
        copy: a copy carries the settings, not the plan)."""
        plan = self.__dict__.get(_PLAN)
        return plan if plan is not None else self._keep_plan()

    def _keep_plan(self) -> PolicyPlan:
        plan = PolicyPlan.build(
            self.recipe, validation=self.validation, metrics=self.metrics, rollout_correction=self.rollout_correction
        )
        object.__setattr__(self, _PLAN, plan)  # (verl's BaseConfig freezes attributes once set: set it once)
        return plan

    def __getstate__(self) -> dict[str, Any]:
        # pickling (Ray) or copying carries the settings only: the plan holds compiled plugins and is re-derived
        # where the copy is used
        state = dict(self.__dict__)
        state.pop(_PLAN, None)
        return state


def policy_plan(actor_config: Any) -> PolicyPlan:
    """The plan of the ``policy_loss`` section of the actor config verl hands the policy loss: the one a
    :class:`LossplugPolicyLossConfig` holds, else (a section built by hand) :func:`~.plan.plan_for_section`."""
    section = getattr(actor_config, "policy_loss", None) if actor_config is not None else None
    if isinstance(section, LossplugPolicyLossConfig):
        return section.plan
    return plan_for_section(section)
