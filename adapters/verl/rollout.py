"""verl's rollout correction under ``loss_mode=lossplug``: verl's ``ppo_loss`` never passes the rollout engine's
log-probs to a policy loss — its driver applies ``algorithm.rollout_correction`` itself and hands the loss
``rollout_is_weights`` (and removes rejected tokens from ``response_mask``). A recipe's corrections against the
rollout engine must therefore be exactly that config, forwarded to the actor; they are then dropped from the policy
term and verl's weights applied instead, once (:func:`without_verls_correction`) — else refused with the lines.
Nothing here is cached: the policy loss's plan (:mod:`.plan`) asks once per configuration and call pattern."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import lossplug
from lossplug.adapters.verl.equivalent.rollout_correction import correction_gates
from lossplug.adapters.verl.recipes import POLICY_RECIPE_KEY
from lossplug.contracts import LossplugError, Recipe

__all__ = ["without_verls_correction"]

#: verl's rollout-correction settings as Hydra overrides (how the refusals below say what to set)
_FORWARD_LINE = "'+actor_rollout_ref.actor.policy_loss.rollout_correction=${algorithm.rollout_correction}'"
_RC = "algorithm.rollout_correction"


def _engine_corrections(recipe: Recipe) -> list[tuple[int, Any]]:
    """``(index in recipe.gates, stage)`` of the correction gates that read the rollout engine's log-probs."""
    compiled = lossplug.compile_recipe(recipe)
    out = []
    for stage in compiled.corrections:
        if "behavior_logp" in stage.plugin.required_fields(stage.params):
            out.append((int(stage.where.removeprefix("recipe.gates[").rstrip("]")), stage))
    return out


def _comparable(recipe: Recipe, gates: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """Correction gate specs with their defaults filled in (``offpolicy_metrics``, diagnostics only, left out), in a
    canonical order: the weights multiply, so their order is free."""
    trial = Recipe.load({"gates": [recipe.gates[0].to_dict(), *gates], "reduction": recipe.reduction.to_dict()})
    compiled = lossplug.compile_recipe(trial)
    return sorted(
        (s.plugin.name, json.dumps(s.params.model_dump(), sort_keys=True, default=str))
        for s in compiled.corrections
        if s.plugin.name != "offpolicy_metrics"
    )


def _verl_lines(gates: Sequence[Mapping[str, Any]]) -> str | None:
    """The ``algorithm.rollout_correction`` overrides whose :func:`correction_gates` are ``gates`` (checked by mapping
    them back), or None when verl has no such setting."""
    settings: dict[str, Any] = {"rollout_is": None}
    for gate in gates:
        name, params = gate["name"], {k: v for k, v in gate.items() if k != "name"}
        level = "sequence" if name.endswith("_seq") else "token"
        if name in ("tis", "tis_seq") and "cap" in params:
            settings.update(rollout_is=level, rollout_is_threshold=float(params["cap"]))
        elif name in ("icepop", "icepop_seq") and "low" in params and "high" in params:
            settings.update(rollout_is=level, rollout_is_threshold=f"{float(params['low'])}_{float(params['high'])}")
        elif name == "rollout_rs":
            settings.update(rollout_rs=params.get("options"), rollout_rs_threshold=params.get("threshold"))
        elif name != "offpolicy_metrics":
            return None
        if params.get("batch_normalize"):
            settings["rollout_is_batch_normalize"] = True
    try:
        mapped = correction_gates(settings, loss_agg_mode="token-sum", whole_batch=True)
        trial = Recipe.load({"gates": ["reinforce", *gates], "reduction": "token"})
        if _comparable(trial, mapped) != _comparable(trial, gates):
            return None
    except LossplugError:
        return None

    def value(v: Any) -> str:
        # (Hydra reads a bare a,b as a sweep and a bare 0.5_5.0 as a number: such strings are quoted)
        return "null" if v is None else f"'{v}'" if isinstance(v, str) and any(c in v for c in "_,") else str(v)

    return " ".join(f"{_RC}.{k}={value(v)}" for k, v in settings.items())


def without_verls_correction(recipe: Recipe, forwarded: Mapping[str, Any] | None, *, has_weights: bool) -> Recipe:
    """The recipe without its correction gates against the rollout engine, once they are found to be exactly verl's
    ``algorithm.rollout_correction`` — ``forwarded``: as the actor's ``policy_loss.rollout_correction``, a plain
    mapping, or None when not forwarded — which verl's driver has applied: its weights arrive as
    ``rollout_is_weights`` (applied by the caller, once; ``has_weights``: they did) and its rejection in
    ``response_mask``. A recipe without such gates is returned as is. Otherwise refused, with the override lines."""
    engine_side = _engine_corrections(recipe)
    if not engine_side:
        return recipe
    ours = [recipe.gates[i].to_dict() for i, _ in engine_side]
    names = ", ".join(f"recipe.gates[{i}] ({s.plugin.name})" for i, s in engine_side)
    lines = _verl_lines(ours)
    wanted = (
        f"Next step: forward algorithm.rollout_correction to the actor and set it to the recipe's corrections: "
        f"{_FORWARD_LINE} "
        f"{lines}"
        if lines is not None
        else "verl's rollout correction has no setting for them. Next step: drop them from the recipe (and use verl's "
        f"{_RC}.rollout_is / rollout_rs, which reach lossplug as rollout_is_weights and response_mask)"
    )
    where = (
        f"{POLICY_RECIPE_KEY}: the recipe's corrections {names} read the rollout engine's log-probs, which verl's "
        f"ppo_loss never passes to a policy loss (verl's driver applies {_RC} itself and hands the loss "
        f"rollout_is_weights)"
    )
    if forwarded is None:
        raise LossplugError(f"{where}; {wanted}")
    # the driver sees the whole rollout batch (batch normalisation is whole-batch) and removes rejected tokens from
    # response_mask (exact under any loss_agg_mode): only the gates are compared, not their exactness as weights
    try:
        theirs = correction_gates(forwarded, loss_agg_mode="token-sum", whole_batch=True)
    except LossplugError as err:
        raise LossplugError(
            f"actor_rollout_ref.actor.policy_loss.rollout_correction (forwarded {_RC}): {err}"
        ) from None
    if _comparable(recipe, theirs) != _comparable(recipe, ours):
        shown = [g for g in theirs if g["name"] != "offpolicy_metrics"]
        raise LossplugError(
            f"{where}; the forwarded {_RC} ({forwarded}) maps to {shown or 'no correction'}, not to the recipe's "
            f"{[g for g in ours if g['name'] != 'offpolicy_metrics']}: {wanted}"
        )
    reweights = any(g["name"] in ("tis", "tis_seq", "icepop", "icepop_seq") for g in theirs)
    if reweights != has_weights:
        raise LossplugError(
            f"{where}; the forwarded {_RC} "
            + (
                "sets rollout_is, but verl handed this micro-batch no rollout_is_weights: the driver computes them "
                "in decoupled mode (bypass_mode=false) when the rollout returns log-probs "
                "(actor_rollout_ref.rollout.calculate_log_probs=true) — is the forwarded config algorithm's?"
                if reweights
                else f"sets no rollout_is, but verl handed this micro-batch rollout_is_weights: forward {_RC} itself "
                f"({_FORWARD_LINE})"
            )
        )
    dropped = {i for i, _ in engine_side}
    spec = recipe.to_dict()
    spec["gates"] = [g for i, g in enumerate(spec["gates"]) if i not in dropped]
    return Recipe.load(spec)
