"""The entropy and KL terms under verl: verl's ``ppo_loss`` adds them itself around any policy loss (from the
actor's ``entropy_coeff`` / ``use_kl_loss`` settings) and hands a policy loss neither entropies nor reference
log-probs. A recipe's regularizers must therefore be exactly those terms; the policy loss then computes only the
policy term (:func:`policy_term`), so each is counted once. Nothing here is cached: the policy loss's plan
(:mod:`.plan`) derives the term once per configuration and the settings it is called with (:class:`VerlTerms`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lossplug.adapters.common import warn_once
from lossplug.adapters.verl.equivalent import LOSS_AGG_REDUCTIONS, verl_regularizers
from lossplug.adapters.verl.recipes import POLICY_RECIPE_KEY
from lossplug.contracts import LossplugError, Recipe

__all__ = ["VerlTerms", "policy_term", "verl_settings_for"]


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


def policy_term(recipe: Recipe, terms: VerlTerms) -> Recipe:
    """The recipe without its regularizers, once they are found to be exactly the terms verl's ``ppo_loss`` adds
    itself around the policy loss (``entropy_coeff``; ``use_kl_loss``, ``kl_loss_type``, ``kl_loss_coef``; reduced
    with ``loss_agg_mode`` over the step) — so each is counted once. verl hands a policy loss neither the entropy nor
    the reference log-probs, so a regularizer verl does not add cannot be computed here: it is refused, naming the
    settings."""
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
    if recipe.regularizers:
        _check_they_are_verls(recipe, verl_adds, agg, described)
        return Recipe.load({k: v for k, v in recipe.to_dict().items() if k != "regularizers"})
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


def _check_they_are_verls(recipe: Recipe, verl_adds: list[dict[str, Any]], agg: str, described: str) -> None:
    """Refuse the recipe's regularizers unless they are ``verl_adds`` (what verl's settings add), with the override
    lines that would make them so when some verl settings do."""
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

    if comparable(recipe.regularizers) == comparable(as_stages(verl_adds)):
        return
    ours = [s.to_dict() for s in recipe.regularizers]
    # the exact override lines, when some verl settings do add these terms
    wanted = verl_settings_for(recipe)
    fits = wanted is not None and comparable(recipe.regularizers) == comparable(
        as_stages(verl_regularizers(wanted, agg))
    )
    if wanted is not None and fits:
        fix = "Next step: set: " + " ".join(f"actor_rollout_ref.actor.{k}={v}" for k, v in wanted.items())
    else:
        fix = (
            "No verl setting adds these terms (verl adds one static entropy bonus and one KL of its "
            "kl_penalty modes, reduced with loss_agg_mode). Next step: change the recipe's regularizers, or run it where "
            "lossplug computes the whole loss (TRL, plain PyTorch)"
        )
    raise LossplugError(
        f"{POLICY_RECIPE_KEY}: the recipe's regularizers {ours} are not what verl's ppo_loss adds around the "
        f"policy loss for {described} ({verl_adds or 'nothing'}); verl passes a policy loss neither the "
        f"entropy nor ref_log_prob, so under verl the entropy and KL terms come from those actor settings. "
        f"{fix}"
    )


def verl_settings_for(recipe: Recipe) -> dict[str, Any] | None:
    """The actor settings under which verl's ``ppo_loss`` adds the recipe's entropy / KL stages — None when they
    are not of that shape (several of a kind, an adaptive coefficient, another regularizer)."""
    entropy = [r for r in recipe.regularizers if r.name == "entropy"]
    kl = [r for r in recipe.regularizers if r.name == "kl"]
    if len(entropy) + len(kl) != len(recipe.regularizers) or len(entropy) > 1 or len(kl) > 1:
        return None
    if any(r.params.get("adaptive") for r in entropy):
        return None
    return {
        "entropy_coeff": float(entropy[0].params["coef"]) if entropy else 0.0,
        "use_kl_loss": bool(kl),
        "kl_loss_type": str(kl[0].params.get("estimator", "low_var_kl")) if kl else "low_var_kl",
        "kl_loss_coef": float(kl[0].params["coef"]) if kl else 0.001,
    }
