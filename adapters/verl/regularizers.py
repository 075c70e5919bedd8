"""The regularizers under verl. verl's ``ppo_loss`` adds an entropy and a KL term itself around any policy loss (from
the actor's ``entropy_coeff`` / ``use_kl_loss`` settings) and hands a policy loss neither the entropies nor the
reference log-probs. A recipe regularizer that reads those (:data:`VERLS_OWN_FIELDS`: ``entropy``, ``kl`` to the
reference) must therefore be exactly one of verl's terms, and is left to verl (counted once); every other regularizer
stays in the policy term and lossplug adds ``coef · reduce(term)`` to the loss verl receives, reduced over the step's
population like the policy term (:func:`policy_term`) — when it reads only what the seam has (``logp``, ``old_logp``,
``advantage``, ``action_mask``, ``behavior_logp`` with ``rollout_log_probs``: ``nll``, a ``kl`` anchored at
``old_logp`` or ``behavior_logp``); the plan refuses the others by the field they lack (:mod:`.unfed`). Nothing
here is cached: the policy loss's plan (:mod:`.plan`) derives the term once per configuration and the settings it is
called with (:class:`VerlTerms`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lossplug.adapters.common import warn_once
from lossplug.adapters.verl.equivalent import LOSS_AGG_REDUCTIONS, verl_regularizers
from lossplug.adapters.verl.recipes import POLICY_RECIPE_KEY
from lossplug.contracts import LossplugError, Recipe
from lossplug.contracts.recipe import PluginSpec
from lossplug.needs import required_fields
from lossplug.pipeline import compile_recipe

__all__ = [
    "VERLS_OWN_FIELDS",
    "VerlTerms",
    "policy_term",
    "regularizer_stages_run_here",
    "verl_settings_for",
    "verls_regularizers",
]

#: the fields verl's ppo_loss reads for the terms it adds itself around a policy loss, and never hands the policy
#: loss: the entropies (``entropy_coeff``) and ``ref_log_prob`` (``use_kl_loss``)
VERLS_OWN_FIELDS = frozenset({"entropy", "ref_logp"})


def _config_value(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


@dataclass(frozen=True)
class VerlTerms:
    """The actor settings with which verl's ``ppo_loss`` adds its entropy and KL terms around a policy loss, and the
    ``loss_agg_mode`` that reduces them — a value (frozen, hashable): the policy loss's plan keys its terms by it."""

    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_type: str = "low_var_kl"
    kl_loss_coef: float = 0.001
    loss_agg_mode: str = "token-mean"

    @classmethod
    def of(cls, actor_config: Any, loss_agg_mode: str) -> VerlTerms:
        """The settings of verl's actor config (its ``ActorConfig``, a ``DictConfig`` or a mapping; verl's defaults
        for what it lacks) with the ``loss_agg_mode`` verl passed the policy loss."""
        return cls(
            entropy_coeff=float(_config_value(actor_config, "entropy_coeff", 0.0)),
            use_kl_loss=bool(_config_value(actor_config, "use_kl_loss", False)),
            kl_loss_type=str(_config_value(actor_config, "kl_loss_type", "low_var_kl")),
            kl_loss_coef=float(_config_value(actor_config, "kl_loss_coef", 0.001)),
            loss_agg_mode=loss_agg_mode,
        )


def _reduction_name(reduction: Any, default: str) -> str:
    if reduction is None:
        return default
    return str(reduction if isinstance(reduction, str) else reduction["name"])


def verls_regularizers(recipe: Recipe) -> tuple[PluginSpec, ...]:
    """The recipe's regularizers that read a field verl keeps for its own terms (:data:`VERLS_OWN_FIELDS`): under verl
    they can only be the terms its ``ppo_loss`` adds (the rest run in lossplug's policy loss, or are refused by the
    field they lack)."""
    return tuple(recipe.regularizers[i] for i in _verls_indices(recipe))


def regularizer_stages_run_here(recipe: Recipe) -> tuple[Any, ...]:
    """The recipe's regularizer stages lossplug's policy loss computes under verl (those not left to verl's own
    terms), compiled from the recipe as written — so a refusal names each by its position there."""
    left_to_verl = _verls_indices(recipe)
    return tuple(s for i, s in enumerate(compile_recipe(recipe).regularizers) if i not in left_to_verl)


def _verls_indices(recipe: Recipe) -> list[int]:
    stages = compile_recipe(recipe).regularizers
    return [
        i
        for i, stage in enumerate(stages)
        if VERLS_OWN_FIELDS.intersection(required_fields(stage.plugin, stage.params))
    ]


def policy_term(recipe: Recipe, terms: VerlTerms) -> Recipe:
    """The recipe without the regularizers verl's ``ppo_loss`` adds itself around the policy loss, once they are found
    to be exactly its terms (``entropy_coeff``; ``use_kl_loss``, ``kl_loss_type``, ``kl_loss_coef``; reduced with
    ``loss_agg_mode`` over the step) — so each is counted once. verl hands a policy loss neither the entropy nor the
    reference log-probs, so a regularizer reading them that verl does not add cannot be computed here: it is refused,
    naming the settings. The other regularizers stay: lossplug's policy loss adds them (or the plan refuses the
    fields they read that the seam lacks)."""
    settings = {
        "entropy_coeff": terms.entropy_coeff,
        "use_kl_loss": terms.use_kl_loss,
        "kl_loss_type": terms.kl_loss_type,
        "kl_loss_coef": terms.kl_loss_coef,
    }
    agg = LOSS_AGG_REDUCTIONS.get(terms.loss_agg_mode, terms.loss_agg_mode)
    verl_adds = verl_regularizers(settings, agg)
    described = (
        f"actor.entropy_coeff={terms.entropy_coeff}, use_kl_loss={terms.use_kl_loss}, "
        f"kl_loss_type={terms.kl_loss_type}, kl_loss_coef={terms.kl_loss_coef}, loss_agg_mode={terms.loss_agg_mode}"
    )
    left_to_verl = _verls_indices(recipe)
    if left_to_verl:
        verls = tuple(recipe.regularizers[i] for i in left_to_verl)
        _check_they_are_verls(recipe, verls, verl_adds, agg, described)
        kept = [spec.to_dict() for i, spec in enumerate(recipe.regularizers) if i not in left_to_verl]
        spec = {k: v for k, v in recipe.to_dict().items() if k != "regularizers"}
        return Recipe.load({**spec, "regularizers": kept} if kept else spec)
    if verl_adds:
        warn_once(
            f"regularizers:{described}",
            (
                f"lossplug: verl's ppo_loss adds {', '.join(r['name'] for r in verl_adds)} ({described}) to the "
                f"policy loss of {POLICY_RECIPE_KEY}, which does not list them: its record does not describe the "
                f"whole loss (verl_equivalent(actor) gives the recipe that does)"
            ),
        )
    return recipe


def _check_they_are_verls(
    recipe: Recipe, verls: tuple[PluginSpec, ...], verl_adds: list[dict[str, Any]], agg: str, described: str
) -> None:
    """Refuse the recipe's regularizers that read verl's own fields (``verls``) unless they are ``verl_adds`` (what
    verl's settings add), with the override lines that would make them so when some verl settings do."""
    base = {"gates": [g.to_dict() for g in recipe.gates], "reduction": recipe.reduction.to_dict()}

    def as_stages(specs: list[dict[str, Any]]) -> tuple[Any, ...]:
        return Recipe.load({**base, "regularizers": specs}).regularizers if specs else ()

    def comparable(specs: tuple[Any, ...]) -> list[tuple[str, list[tuple[str, Any]]]]:
        out = []
        for spec in specs:
            params = dict(spec.params)
            params["reduction"] = _reduction_name(params.get("reduction"), recipe.reduction.name)
            out.append((spec.name, sorted(params.items(), key=lambda kv: kv[0])))
        return sorted(out, key=repr)

    if comparable(verls) == comparable(as_stages(verl_adds)):
        return
    ours = [s.to_dict() for s in verls]
    # the exact override lines, when some verl settings do add these terms
    wanted = verl_settings_for(recipe)
    fits = wanted is not None and comparable(verls) == comparable(as_stages(verl_regularizers(wanted, agg)))
    if wanted is not None and fits:
        fix = "Next step: set: " + " ".join(f"actor_rollout_ref.actor.{k}={v}" for k, v in wanted.items())
    else:
        fix = (
            "No verl setting adds these terms (verl adds one static entropy bonus and one KL of its "
            "kl_penalty modes, reduced with loss_agg_mode; a kl anchored at old_logp or behavior_logp runs in "
            "lossplug's policy loss). Next step: change the recipe's regularizers, or run it where lossplug computes "
            "the whole loss (TRL, plain PyTorch)"
        )
    raise LossplugError(
        f"{POLICY_RECIPE_KEY}: the recipe's regularizers {ours} are not what verl's ppo_loss adds around the "
        f"policy loss for {described} ({verl_adds or 'nothing'}); verl passes a policy loss neither the "
        f"entropy nor ref_log_prob, so under verl the entropy and KL terms come from those actor settings. "
        f"{fix}"
    )


def verl_settings_for(recipe: Recipe) -> dict[str, Any] | None:
    """The actor settings under which verl's ``ppo_loss`` adds the recipe's entropy / KL stages (those reading
    :data:`VERLS_OWN_FIELDS`; the others run in lossplug's policy loss) — None when they are not of that shape
    (several of a kind, an adaptive coefficient, another regularizer reading the entropies or the reference)."""
    verls = verls_regularizers(recipe)
    entropy = [r for r in verls if r.name == "entropy"]
    kl = [r for r in verls if r.name == "kl"]
    if len(entropy) + len(kl) != len(verls) or len(entropy) > 1 or len(kl) > 1:
        return None
    if any(r.params.get("adaptive") for r in entropy):
        return None
    return {
        "entropy_coeff": float(entropy[0].params["coef"]) if entropy else 0.0,
        "use_kl_loss": bool(kl),
        "kl_loss_type": str(kl[0].params.get("estimator", "low_var_kl")) if kl else "low_var_kl",
        "kl_loss_coef": float(kl[0].params["coef"]) if kl else 0.001,
    }
