"""verl configuration → lossplug recipe (:func:`verl_equivalent`): one module per side of the configuration.

* :mod:`.policy_losses` — ``actor.policy_loss.loss_mode`` (and the parameters each mode reads) → the gates;
* :mod:`.advantages` — ``algorithm.adv_estimator`` (with its options) → the advantage stage;
* :mod:`.rollout_correction` — ``algorithm.rollout_correction`` → correction gates;
* :mod:`.rollout_side` — ``algorithm.use_kl_in_reward`` / ``kl_penalty`` / ``kl_ctrl`` → the ``kl_in_reward``
  shaper, ``algorithm.filter_groups`` → the ``zero_variance`` filter;
* :mod:`.keys` — the valid keys of each section read (verl's own config dataclasses): an unknown key is refused;
* :mod:`.settings` — what they share: verl's defaults, the ``loss_agg_mode`` and ``kl_loss_type`` tables,
  :func:`as_plain` (a leaf: the modules import it, never this one, so no two of them import each other).

This module composes them, adds what verl's ``ppo_loss`` adds around the policy loss (``loss_agg_mode`` → the
reduction, ``entropy_coeff`` and ``use_kl_loss`` → regularizers) and returns one validated :class:`~lossplug.Recipe`.

Every function takes plain mappings (an ``OmegaConf`` node converted with ``to_container``, a dataclass converted
field by field) and raises :class:`~lossplug.LossplugError` naming the setting for anything without an exact
equivalent — never a silent approximation, and for a key verl's config does not have (a misspelling would otherwise
read as the default). Nothing here imports verl at import time (:mod:`.keys` reads verl's schema when called): the
defaults below are verl 0.9.1's (``verl/trainer/config/actor/actor.yaml``), so a partial actor mapping means what it
means to verl.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lossplug.adapters.verl.equivalent import advantages, keys, policy_losses, rollout_correction, rollout_side
from lossplug.adapters.verl.equivalent.settings import (
    ACTOR_DEFAULTS,
    KL_ESTIMATORS,
    LOSS_AGG_REDUCTIONS,
    as_plain,
)
from lossplug.contracts import LossplugError, Recipe

__all__ = [
    "ACTOR_DEFAULTS",
    "KL_ESTIMATORS",
    "LOSS_AGG_REDUCTIONS",
    "as_plain",
    "verl_equivalent",
    "verl_regularizers",
]


def _with_defaults(actor: Mapping[str, Any]) -> dict[str, Any]:
    merged = {**ACTOR_DEFAULTS, **{k: v for k, v in actor.items() if k != "policy_loss"}}
    policy = actor.get("policy_loss") or {}
    if not isinstance(policy, Mapping):
        raise LossplugError(
            f"verl_equivalent: actor.policy_loss must be a mapping (verl's PolicyLossConfig), got "
            f"{type(policy).__name__} {policy!r}"
        )
    merged["policy_loss"] = {**ACTOR_DEFAULTS["policy_loss"], **policy}
    return merged


def _reduction(actor: Mapping[str, Any]) -> dict[str, Any]:
    """``loss_agg_mode`` (and ``loss_scale_factor``) → the reduction spec ``agg_loss`` computes."""
    mode = actor["loss_agg_mode"]
    name = LOSS_AGG_REDUCTIONS.get(mode)
    if name is None:
        raise LossplugError(
            f"verl_equivalent: actor.loss_agg_mode={mode!r} is not one of verl's modes "
            f"({', '.join(LOSS_AGG_REDUCTIONS)})"
        )
    if name != "fixed":
        return {"name": name}
    budget = actor.get("loss_scale_factor")
    if budget is None:
        raise LossplugError(
            "verl_equivalent: actor.loss_agg_mode='seq-mean-token-sum-norm' with actor.loss_scale_factor=null divides "
            "by each micro-batch's padded response length (loss_mask.shape[-1]), which changes with the batching; "
            "lossplug's 'fixed' reduction needs a constant: set actor.loss_scale_factor (e.g. the maximum response "
            "length) — verl recommends it for the same reason"
        )
    return {"name": "fixed", "budget": float(budget)}


def verl_regularizers(actor: Mapping[str, Any], reduction: str | None = None) -> list[dict[str, Any]]:
    """What verl's ``ppo_loss`` adds around the policy loss, as regularizer specs: ``− entropy_coeff · agg(H)``
    (``entropy``) and ``+ kl_loss_coef · agg(kl_penalty(logp, ref, kl_loss_type))`` (``kl``), both aggregated with
    ``loss_agg_mode`` — ``reduction`` names that reduction when it is not the recipe's own."""
    out: list[dict[str, Any]] = []
    own = {} if reduction is None else {"reduction": reduction}
    entropy_coeff = float(actor.get("entropy_coeff") or 0.0)
    if entropy_coeff != 0.0:
        out.append({"name": "entropy", "coef": entropy_coeff, **own})
    if actor.get("use_kl_loss"):
        kl_type = str(actor.get("kl_loss_type", ACTOR_DEFAULTS["kl_loss_type"]))
        if kl_type not in KL_ESTIMATORS:
            raise LossplugError(
                f"verl_equivalent: actor.kl_loss_type={kl_type!r} has no lossplug estimator (supported: "
                f"{', '.join(KL_ESTIMATORS)}; verl itself raises NotImplementedError for 'full')"
            )
        coef = actor.get("kl_loss_coef", ACTOR_DEFAULTS["kl_loss_coef"])
        out.append({"name": "kl", "coef": float(coef), "estimator": kl_type, **own})
    return out


def verl_equivalent(actor_config: Any = None, algorithm_config: Any = None, *, whole_batch: bool = False) -> Recipe:
    """The lossplug recipe that computes what verl 0.9.1 computes for this configuration.

    ``actor_config``: verl's ``actor_rollout_ref.actor`` (``DictConfig``, ``ActorConfig`` or a mapping; missing keys
    take verl's defaults, :data:`ACTOR_DEFAULTS`) → the update gate of ``policy_loss.loss_mode`` with every parameter
    it reads, the reduction of ``loss_agg_mode`` (``loss_scale_factor`` → the ``fixed`` budget) unless the mode
    reduces on its own, and the regularizers ``entropy`` (``entropy_coeff``) and ``kl`` (``use_kl_loss``,
    ``kl_loss_coef``, ``kl_loss_type``) that verl's ``ppo_loss`` adds around the policy loss.

    ``algorithm_config``: verl's ``algorithm`` → the advantage stage of ``adv_estimator`` (with
    ``norm_adv_by_std_in_grpo``, ``gamma``, ``lam`` and its own options), the correction gates of
    ``rollout_correction`` (after the update gate), the ``kl_in_reward`` shaper of ``use_kl_in_reward`` (with
    ``kl_penalty`` and ``kl_ctrl.{type, kl_coef, target_kl, horizon}``) and the ``zero_variance`` filter of
    ``filter_groups`` (``metric: reward``; the filtering only — verl's re-sampling of prompts to refill the batch
    has no recipe equivalent). Running the recipe under verl (``adv_estimator=lossplug``), its shaper replaces
    verl's: set ``algorithm.use_kl_in_reward=false`` (both on is refused, the KL would be counted twice), and keep
    verl's reference policy with ``actor.use_kl_loss=true`` (``kl_loss_coef=0`` when the actor has no KL loss).

    Either may be omitted. Without ``algorithm_config`` the recipe has no advantage stage (the advantages come with
    the batch, as they reach verl's actor). A recipe always has an update gate, so without ``actor_config`` the
    policy part is verl's default actor (``vanilla``: clip 0.2, dual-clip 3.0, ``token-mean``) — what verl
    computes when the actor section is left alone; verl's estimator ``algorithm.lossplug`` reads only the advantage
    stage. Raises :class:`~lossplug.LossplugError` naming the setting for anything without an exact equivalent, and
    for every key of the sections it reads that verl's config does not have — e.g.
    ``actor_rollout_ref.actor.clip_ratio_hgh (did you mean clip_ratio_high?)`` — checked against the installed
    verl's config dataclasses (:mod:`.keys`); keys verl accepts and lossplug does not read are fine.

    ``whole_batch``: every loss call will see one whole rollout batch (no mini- or micro-batches), which makes
    ``rollout_is_batch_normalize`` exact (refused otherwise; see :mod:`.rollout_correction`).

    Under verl itself (``loss_mode=lossplug``) verl's driver still computes the rollout correction and hands the loss
    ``rollout_is_weights``: forward ``algorithm.rollout_correction`` to the actor
    (``+actor_rollout_ref.actor.policy_loss.rollout_correction=${algorithm.rollout_correction}``) and the adapter
    replaces the recipe's correction gates with verl's weights once it finds them equal; or leave them out
    (``algorithm_config`` without ``rollout_correction``).
    """
    actor = as_plain(actor_config, "actor_config")
    algorithm = as_plain(algorithm_config, "algorithm_config")
    if actor is None and algorithm is None:
        raise LossplugError("verl_equivalent: give actor_config, algorithm_config or both")
    keys.check_keys(actor, algorithm)  # a misspelt key would silently read as verl's default
    full_actor = _with_defaults(actor or {})

    stages = policy_losses.policy_gates(full_actor)
    if not stages.gates:
        raise LossplugError(
            f"verl_equivalent: actor.policy_loss.loss_mode={full_actor['policy_loss']['loss_mode']!r} gave no gate"
        )
    gates = list(stages.gates)
    regularizers = verl_regularizers(full_actor)
    # loss_agg_mode reduces the policy term unless the loss mode reduces its own; verl reduces entropy and KL with
    # it always — a mode that ignores it and no regularizer leave it unread (and unchecked)
    agg = _reduction(full_actor) if stages.reduction is None or regularizers else None
    reduction = stages.reduction if stages.reduction is not None else agg
    if reduction is None:  # pragma: no cover - agg is computed whenever the mode has no reduction of its own
        raise LossplugError("verl_equivalent: no reduction")
    if agg is not None and agg != reduction:
        if agg.get("budget") is not None:
            raise LossplugError(
                f"verl_equivalent: loss_mode={full_actor['policy_loss']['loss_mode']!r} reduces its own term, and "
                f"verl reduces entropy_coeff / use_kl_loss with loss_agg_mode='seq-mean-token-sum-norm'; a "
                f"regularizer's own reduction carries no budget: use another loss_agg_mode"
            )
        regularizers = verl_regularizers(full_actor, agg["name"])

    recipe: dict[str, Any] = {"name": f"verl-{full_actor['policy_loss']['loss_mode']}"}
    if algorithm is not None:
        correction = algorithm.get("rollout_correction")
        if correction:
            if not isinstance(correction, Mapping):
                raise LossplugError(
                    f"verl_equivalent: algorithm.rollout_correction must be a mapping, got {type(correction).__name__}"
                )
            # the aggregation verl applies to the policy term decides whether a rejection is exact as a weight
            applied = next((m for m, r in LOSS_AGG_REDUCTIONS.items() if r == reduction["name"]), None)
            corrections = rollout_correction.correction_gates(
                correction, loss_agg_mode=applied or full_actor["loss_agg_mode"], whole_batch=whole_batch
            )
            weighting = [g for g in corrections if g["name"] != "offpolicy_metrics"]
            if weighting and full_actor["policy_loss"]["loss_mode"] == "geo_mean":
                # compute_policy_loss_geo_mean folds rollout_is_weights into the sequence as their geometric mean
                # exp(mean_t log w_t) per response; a correction gate multiplies each token by its own weight
                raise LossplugError(
                    "verl_equivalent: loss_mode='geo_mean' with algorithm.rollout_correction "
                    f"({', '.join(g['name'] for g in weighting)}): verl's geo_mean applies the rollout weights as "
                    "their geometric mean per response, which no lossplug correction gate reproduces; set "
                    "algorithm.rollout_correction.rollout_is=null and rollout_rs=null, or use another loss_mode"
                )
            gates += corrections
        if algorithm.get("adv_estimator") is not None:
            recipe["advantage"] = advantages.advantage_stage(algorithm)
            recipe["name"] += f"+{algorithm['adv_estimator']}"
        shapers, filters = rollout_side.reward_shapers(algorithm), rollout_side.batch_filters(algorithm)
        if (shapers or filters) and "advantage" not in recipe:
            raise LossplugError(
                "verl_equivalent: algorithm.use_kl_in_reward / filter_groups shape and filter the rewards before the "
                "advantage: give algorithm.adv_estimator too"
            )
        if shapers:
            recipe["shapers"] = shapers
        if filters:
            recipe["filters"] = filters
    recipe["gates"] = gates
    recipe["reduction"] = reduction
    if regularizers:
        recipe["regularizers"] = regularizers
    return Recipe.load(recipe)
