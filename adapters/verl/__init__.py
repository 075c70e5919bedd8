"""lossplug inside verl: a policy loss ``lossplug`` and an advantage estimator ``lossplug``, selected by config alone.

Registration. lossplug declares this module in verl's own ``verl.plugins`` entry-point group (see pyproject.toml).
``import verl`` loads that group in every process where the package is installed — the driver, the trainer and
every Ray worker — so nothing has to be imported by hand and verl is not edited. Importing this module registers::

    verl.trainer.ppo.core_algos.get_policy_loss_fn("lossplug")    gates + reduction of the recipe
    verl.trainer.ppo.core_algos.get_adv_estimator_fn("lossplug")  advantage stage of the recipe

Registration is idempotent (verl's ``register_adv_est`` raises when a *different* function takes a name). verl only
logs entry-point failures at DEBUG level, so :func:`check_registration` verifies the whole chain itself and raises a
:class:`~lossplug.LossplugError` that names the missing piece; it runs when :class:`LossplugPolicyLossConfig` is
built (in the driver, by verl's ``validate_config``, before any GPU work) and on the first call of each function.

Selection (Hydra overrides)::

    actor_rollout_ref.actor.policy_loss._target_=lossplug.adapters.verl.LossplugPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=lossplug
    +actor_rollout_ref.actor.policy_loss.recipe=dapo          # preset name, YAML/JSON path, or inline {…}
    algorithm.adv_estimator=lossplug
    +algorithm.lossplug=dapo                                  # its advantage stage is used

Batch mapping (verl → :class:`~lossplug.PolicyBatch`): ``log_prob`` → ``logp``, ``old_log_prob`` → ``old_logp``,
``advantages`` → ``advantage``, ``response_mask`` → ``action_mask``; the behaviour side: ``rollout_log_probs`` (when
a caller passes it) → ``behavior_logp`` for the recipe's correction gates, and verl's own rollout-correction weights
``rollout_is_weights`` multiply the objective after the gates (detached), exactly as verl's built-in losses apply them.
verl's ``ppo_loss`` never passes ``rollout_log_probs``: there a recipe's engine corrections must be verl's
``algorithm.rollout_correction``, forwarded as ``actor.policy_loss.rollout_correction`` — checked equal, dropped from
the policy term, verl's weights applied instead (:class:`LossplugPolicyLossConfig`); else refused with the lines.
For the estimator: ``token_level_rewards`` → ``reward`` ``[B, T]``, ``uid`` (numpy object array) → integer
``group_id``, ``reward_baselines`` → ``reward_baseline``. verl's ``ray_trainer.compute_advantage`` passes a
registered estimator nothing else, so a plugin that needs the critic's ``values`` (``gae``) or log-probs is refused
there with the way out: :func:`compute_advantage` ``(data, recipe)`` on the ``DataProto`` in a custom trainer (it
reads every field from ``data.batch``), or verl's own estimator. Rows with no action token (verl's synthetic padding rows, or
responses removed by rollout rejection sampling) are left out of the lossplug batch; they get zero advantages and
contribute nothing to the loss, as in verl.

Regularisers. verl's ``ppo_loss`` adds the entropy bonus and the KL loss around any policy loss, from the actor's
``entropy_coeff`` / ``use_kl_loss`` settings, and hands a policy loss neither entropies nor reference log-probs. A
recipe's regularisers must therefore be exactly those terms (as :func:`verl_equivalent` writes them); the adapter then
computes only the policy term, so each is counted once, and refuses any other regulariser naming the settings.

Metrics. verl's own keys with verl's definitions — ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``,
``actor/ppo_kl`` — beside lossplug's under ``actor/lossplug/``.

TRL beside verl. verl's FSDP workers import ``AutoModelForCausalLMWithValueHead`` from any importable TRL, which
TRL ≥ 1.0 does not have; importing this module (at ``import verl``) warns once when that is the environment
(:func:`trl_breaks_verl`): install ``lossplug[verl]``, not ``lossplug[all]``, where verl runs.

Reduction. The returned loss is this micro-batch's share of the full optimizer step: a :class:`~lossplug.Normalizer`
is built from verl's ``config.global_batch_info`` (``batch_num_tokens`` → action tokens, ``global_batch_size`` →
sequences, ``loss_scale_factor`` → the ``fixed`` reduction's budget) and the result is multiplied by ``dp_size``,
which cancels the data-parallel gradient averaging exactly as verl's ``agg_loss`` does. The recipe's reduction
decides the policy term; verl's ``loss_agg_mode`` still reduces verl's own entropy and KL terms, which ``ppo_loss``
adds itself (lossplug never adds them). ``loss_agg_mode`` ↔ reduction: ``token-mean`` ↔ ``token``,
``seq-mean-token-mean`` ↔ ``response``, ``seq-mean-token-sum`` ↔ ``sequence_sum``, ``seq-mean-token-sum-norm`` ↔
``fixed`` (budget ``loss_scale_factor``), ``token-sum`` ↔ ``token_sum`` (no denominator; only the ``× dp_size``).
A reduction with ``population: micro_batch`` (verl's batch-local ``geo_mean``) is instead handed the micro-batch as its
whole population and not multiplied by ``dp_size``: verl's engine backpropagates each micro-batch's loss as it is, so
that is verl's own value (times the share of rows with an action token, which verl's ``torch.mean`` also divides by).
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import importlib.util
import json
import operator
import os
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from verl.trainer.ppo import core_algos
from verl.workers.config import PolicyLossConfig

import lossplug
from lossplug.adapters.verl_recipes import LOSS_AGG_REDUCTIONS, verl_equivalent
from lossplug.contracts import LossplugError, Normalizer, PolicyBatch, Recipe, RecipeError
from lossplug.contracts.normalizer import whole_count
from lossplug.pipeline import Validate, metric_level

__all__ = [
    "NAME",
    "POLICY_RECIPE_KEY",
    "ADVANTAGE_RECIPE_KEY",
    "LOSS_AGG_MODES",
    "LossplugPolicyLossConfig",
    "check_registration",
    "compute_advantage",
    "compute_lossplug_advantage",
    "compute_policy_loss_lossplug",
    "group_ids",
    "load_recipe",
    "register",
    "trl_breaks_verl",
    "verl_equivalent",
    "verl_normalizer",
]

#: the name under which lossplug is registered in both verl registries
NAME = "lossplug"
ENTRY_POINT_GROUP = "verl.plugins"
MODULE = __name__
#: where the recipes live in verl's config (used in every error message about a recipe)
POLICY_RECIPE_KEY = "actor_rollout_ref.actor.policy_loss.recipe"
ADVANTAGE_RECIPE_KEY = "algorithm.lossplug"
#: verl's loss_agg_mode → the lossplug reduction that computes the same aggregation (every mode has one)
LOSS_AGG_MODES: dict[str, str] = dict(LOSS_AGG_REDUCTIONS)  # one table, shared with verl_equivalent

Tensor = torch.Tensor
_warned: set[str] = set()
_lock = threading.Lock()


def _warn_once(key: str, message: str) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, UserWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------------------------------
# Recipes from verl's config


def _plain(source: Any) -> Any:
    """OmegaConf containers → plain dicts/lists (Hydra may hand over a DictConfig)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a verl dependency
        return source
    if isinstance(source, (DictConfig, ListConfig)):
        return OmegaConf.to_container(source, resolve=True)
    return source


def _keyed(err: LossplugError, key: str) -> LossplugError:
    """The same error with the recipe's config key in front ('recipe.gates[0]: …' → '<key>.gates[0]: …')."""
    message = str(err)
    if message.startswith("recipe"):
        message = key + message[len("recipe") :]
    else:
        message = f"{key}: {message}"
    try:
        return type(err)(message)
    except TypeError:  # an error class with a richer constructor
        return LossplugError(message)


_recipes: dict[str, Recipe] = {}


def load_recipe(source: Any, key: str) -> Recipe:
    """A validated :class:`~lossplug.Recipe` from a config value (preset name, YAML/JSON path, YAML text or mapping).

    Cached per source, so plugin dispatch is resolved once, not per micro-batch. Any error names ``key``.
    """
    source = _plain(source)
    if source is None or source == "" or source == {}:
        raise LossplugError(
            f"{key}: no recipe given; set it to a preset name (e.g. grpo, dapo), the path of a "
            f"recipe YAML file, or an inline mapping, e.g. +{key}=dapo"
        )
    if isinstance(source, Recipe):
        return source
    try:
        cache_key = json.dumps(source, sort_keys=True, default=str)
    except (TypeError, ValueError):
        cache_key = repr(source)
    cached = _recipes.get(cache_key)
    if cached is not None:
        return cached
    if isinstance(source, str) and source.endswith((".yaml", ".yml", ".json")) and not os.path.isfile(source):
        raise LossplugError(
            f"{key}: no such recipe file: {source} (relative paths resolve against this process's "
            f"working directory {os.getcwd()}; Ray workers may run elsewhere — use an absolute path "
            f"present on every node, a preset name or an inline recipe)"
        )
    try:
        recipe = Recipe.load(source)
        lossplug.compile_recipe(recipe)  # resolve every plugin now: an unknown one fails here, naming the key
    except LossplugError as err:
        raise _keyed(err, key) from None
    _recipes[cache_key] = recipe
    return recipe


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
    (:func:`~lossplug.adapters.verl_recipes.rollout_correction.correction_gates`): verl's driver computes them and
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
        try:
            metric_level(self.metrics)
        except LossplugError as err:
            raise LossplugError(f"actor_rollout_ref.actor.policy_loss.{err}") from None
        if self.validation not in ("full", "off"):
            raise LossplugError(
                f"actor_rollout_ref.actor.policy_loss.validation must be 'full' or 'off', got {self.validation!r}"
            )
        if self.loss_mode != NAME:
            if self.recipe is not None:
                raise LossplugError(
                    f"{POLICY_RECIPE_KEY} is set but actor_rollout_ref.actor.policy_loss.loss_mode="
                    f"{self.loss_mode}: the recipe is only used with loss_mode={NAME}"
                )
            return
        check_registration(estimator=False)
        load_recipe(self.recipe, POLICY_RECIPE_KEY)


# ---------------------------------------------------------------------------------------------------------------------
# Registration and its check


def _entry_point() -> md.EntryPoint | None:
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        if ep.value.split(":")[0].strip() == MODULE:
            return ep
    return None


def _loaded_by_import_verl(ep: md.EntryPoint | None) -> tuple[bool, str]:
    """Whether ``import verl`` imports this module in every process, and if not, why not."""
    modules = [m.strip() for m in os.getenv("VERL_USE_EXTERNAL_MODULES", "").split(",") if m.strip()]
    if MODULE in modules:
        return True, ""
    if ep is None:
        return False, (
            f"lossplug's '{ENTRY_POINT_GROUP}' entry point is not installed in this environment "
            f"({sys.prefix}); install lossplug there — pip install 'lossplug[verl]' (or pip install -e "
            f"<lossplug checkout>) — in the environment of the driver and of every Ray worker"
        )
    policy = os.getenv("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    if policy == "auto":
        return True, ""
    allowed = {n.strip() for n in policy.split(",") if n.strip()}
    if policy != "none" and ep.name in allowed:
        return True, ""
    return False, (
        f"VERL_USE_EXTERNAL_PLUGINS={os.getenv('VERL_USE_EXTERNAL_PLUGINS')} stops `import verl` from "
        f"loading lossplug's '{ENTRY_POINT_GROUP}' entry point '{ep.name}'; unset it (or set it to 'auto'),"
        f" or list '{ep.name}' in it — in the driver's environment and the Ray workers' "
        f"(runtime_env env_vars) — or set VERL_USE_EXTERNAL_MODULES={MODULE}"
    )


def _describe(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def check_registration(*, policy_loss: bool = True, estimator: bool = True) -> None:
    """Raise a :class:`~lossplug.LossplugError` naming the missing piece unless ``import verl`` registers lossplug in
    every process of a run (entry point installed and enabled) and both verl registries hold lossplug's functions."""
    problems = []
    ok, why = _loaded_by_import_verl(_entry_point())
    if not ok:
        problems.append(why)
    slots: list[tuple[str, dict[str, Any], Callable[..., Any], str]] = []
    if policy_loss:
        slots.append(
            (
                "policy loss",
                core_algos.POLICY_LOSS_REGISTRY,
                compute_policy_loss_lossplug,
                "actor_rollout_ref.actor.policy_loss.loss_mode",
            )
        )
    if estimator:
        slots.append(
            (
                "advantage estimator",
                core_algos.ADV_ESTIMATOR_REGISTRY,
                compute_lossplug_advantage,
                "algorithm.adv_estimator",
            )
        )
    for what, table, fn, key in slots:
        found = table.get(NAME)
        if found is None:
            problems.append(
                f"verl's {what} registry has no '{NAME}' in this process ({key}={NAME} cannot "
                f"resolve): the module {MODULE} was not imported by `import verl`"
            )
        elif found is not fn:
            problems.append(
                f"verl's {what} '{NAME}' is {_describe(found)}, not lossplug's {_describe(fn)}: another "
                f"package registered the same name"
            )
    if problems:
        raise LossplugError("lossplug is not registered with verl: " + "; ".join(problems))


def register() -> None:
    """Register lossplug's policy loss and advantage estimator with verl (idempotent; done on import)."""
    for table, fn, what in (
        (core_algos.POLICY_LOSS_REGISTRY, compute_policy_loss_lossplug, "policy loss"),
        (core_algos.ADV_ESTIMATOR_REGISTRY, compute_lossplug_advantage, "advantage estimator"),
    ):
        found = table.get(NAME)
        if found is fn:
            continue
        if found is not None and not getattr(found, "__lossplug_verl__", False):
            raise LossplugError(
                f"cannot register lossplug with verl: the {what} '{NAME}' is already taken by {_describe(found)}"
            )
        if found is not None:  # an older copy of this very module (importlib.reload): replace it
            del table[NAME]
    core_algos.register_policy_loss(NAME)(compute_policy_loss_lossplug)
    core_algos.register_adv_est(NAME)(compute_lossplug_advantage)


# ---------------------------------------------------------------------------------------------------------------------
# Shared helpers


def group_ids(index: Any) -> Tensor:
    """verl's ``uid`` (numpy object array of strings, or any sequence of hashables) → ``[B]`` int64 group ids,
    numbered in order of first appearance."""
    ids: dict[Any, int] = {}
    out = [ids.setdefault(u, len(ids)) for u in np.asarray(index, dtype=object).reshape(-1).tolist()]
    return torch.tensor(out, dtype=torch.long)


def _count(info: Mapping[str, Any], key: str) -> int | None:
    """A count of ``global_batch_info``, refused (never truncated) unless it is a whole number."""
    value = info.get(key)
    if value is None:
        return None
    return whole_count(value.item() if isinstance(value, torch.Tensor) else value, f"config.global_batch_info[{key!r}]")


def verl_normalizer(
    global_batch_info: Mapping[str, Any] | None, mask: Tensor, *, counts_needed: bool = True
) -> tuple[Normalizer | None, int]:
    """``(Normalizer, dp_size)`` from verl's ``global_batch_info`` for a micro-batch whose kept action mask is ``mask``.

    With no global counts and ``dp_size == 1`` the micro-batch is its own population (verl's ``agg_loss`` fallback);
    with ``dp_size > 1`` a missing count is an error, as in verl — unless ``counts_needed`` is False (``token_sum``,
    like verl's ``token-sum``, reads no population).
    """
    info = dict(global_batch_info or {})
    dp_size = _count(info, "dp_size") or 1
    tokens = _count(info, "batch_num_tokens")
    sequences = _count(info, "global_batch_size")
    budget = info.get("loss_scale_factor")
    if tokens is None or sequences is None:
        if dp_size > 1 and counts_needed:
            missing = [k for k, v in (("batch_num_tokens", tokens), ("global_batch_size", sequences)) if v is None]
            raise LossplugError(
                f"lossplug policy loss: config.global_batch_info has dp_size={dp_size} but no "
                f"{' / '.join(missing)}; without the global counts the loss cannot be normalised over "
                f"the whole optimizer step"
            )
        if tokens is None and sequences is None and budget is None:
            return None, dp_size
        tokens = tokens if tokens is not None else max(int(mask.sum()), 1)
        sequences = sequences if sequences is not None else max(mask.shape[0], 1)
    return Normalizer(
        action_tokens=tokens, sequences=sequences, budget=float(budget) if budget is not None else None
    ), dp_size


def _policy_recipe(config: Any) -> Recipe:
    policy = getattr(config, "policy_loss", None) if config is not None else None
    source = None
    if policy is not None:
        source = policy.get("recipe") if hasattr(policy, "get") else getattr(policy, "recipe", None)
    if source is None:
        raise LossplugError(
            f"loss_mode={NAME} needs a recipe: set actor_rollout_ref.actor.policy_loss._target_="
            f"{MODULE}.LossplugPolicyLossConfig and +{POLICY_RECIPE_KEY}=<preset | /abs/path/recipe.yaml | {{…}}>"
        )
    return load_recipe(source, POLICY_RECIPE_KEY)


def _sum(*keys: str) -> Callable[[Callable[[str], Tensor | None]], Tensor | None]:
    def total(get: Callable[[str], Tensor | None]) -> Tensor | None:
        parts = [get(k) for k in keys]
        return None if any(p is None for p in parts) else functools.reduce(operator.add, parts)

    return total


def _zero(get: Callable[[str], Tensor | None]) -> Tensor | None:
    approx_kl = get("@approx_kl")
    return None if approx_kl is None else approx_kl * 0


#: update gate → verl's metric keys with the definitions of the verl loss mode that gate reproduces (``core_algos``);
#: each entry reads the gate's own metrics (``get("clip_frac_low")``) — ``"@approx_kl"`` is lossplug's
#: ``update/approx_kl``, verl's ``ppo_kl`` for every mode but ``kl_cov``
_VERL_METRICS: dict[str, dict[str, Callable[[Callable[[str], Tensor | None]], Tensor | None]]] = {
    # vanilla: clipped-branch tokens; tokens held at the dual-clip bound c·A (A < 0)
    "ppo_clip": {
        "actor/pg_clipfrac": _sum("clip_frac_low", "clip_frac_high"),
        "actor/pg_clipfrac_lower": lambda get: (
            get("clip_frac_dual") if get("clip_frac_dual") is not None else _zero(get)
        ),
    },
    # gspo (GSPO-token): clipped tokens; pg_clipfrac_lower is always 0 in verl
    "gspo_token": {"actor/pg_clipfrac": _sum("clip_frac_low", "clip_frac_high"), "actor/pg_clipfrac_lower": _zero},
    "gspo": {"actor/pg_clipfrac": _sum("clip_frac_low", "clip_frac_high"), "actor/pg_clipfrac_lower": _zero},
    "cispo": {"actor/pg_clipfrac": lambda get: get("clip_frac"), "actor/pg_clipfrac_lower": _zero},
    "sapo": {"actor/pg_clipfrac": _zero, "actor/pg_clipfrac_lower": _zero},  # verl reports 0 for both
    # dppo: tokens masked out of the update; kept tokens whose ratio exceeds clip_ratio_c
    "dppo_tv": {
        "actor/pg_clipfrac": lambda get: get("mask_frac"),
        "actor/pg_clipfrac_lower": lambda get: get("trunc_frac"),
    },
    "dppo_kl": {
        "actor/pg_clipfrac": lambda get: get("mask_frac"),
        "actor/pg_clipfrac_lower": lambda get: get("trunc_frac"),
    },
    "clip_cov": {"actor/pg_clipfrac": lambda get: get("cov_cut_frac")},  # tokens whose gradient the covariance cut
    "kl_cov": {"actor/ppo_kl": lambda get: get("abs_kl")},  # verl's kl_cov reports mean |log-ratio| as ppo_kl
    # geo_mean: clipped tokens with A > 0 / with A < 0
    "gmpo": {
        "actor/pg_clipfrac": lambda get: get("clip_frac_high"),
        "actor/pg_clipfrac_lower": lambda get: get("clip_frac_low"),
    },
}


def _verl_metrics(update_gate: str, found: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """verl's own metric keys for the update gate, with the definitions of the verl loss mode it reproduces (means over
    the micro-batch's action tokens, like verl's ``masked_mean``), so a dashboard built on verl's keys keeps working
    after ``loss_mode=lossplug``: ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower`` and, for ``kl_cov``,
    ``actor/ppo_kl`` (see :data:`_VERL_METRICS`). A gate verl has no loss for adds none."""

    def get(name: str) -> Tensor | None:
        return found.get("update/approx_kl" if name == "@approx_kl" else f"{update_gate}/{name}")

    out = {}
    for key, compute in _VERL_METRICS.get(update_gate, {}).items():
        value = compute(get)
        if value is not None:
            out[key] = value
    return out


def _config_value(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


#: (id(recipe), verl's settings) → (recipe, its policy term); the recipe is kept so that its id is never reused
_policy_terms: dict[tuple[Any, ...], tuple[Recipe, Recipe]] = {}


def _reduction_name(reduction: Any, default: str) -> str:
    if reduction is None:
        return default
    return str(reduction if isinstance(reduction, str) else reduction["name"])


def _policy_term(recipe: Recipe, config: Any, loss_agg_mode: str) -> Recipe:
    """The recipe without its regularisers, once they are found to be exactly the terms verl's ``ppo_loss`` adds
    itself around the policy loss (``entropy_coeff``; ``use_kl_loss``, ``kl_loss_type``, ``kl_loss_coef``; reduced
    with ``loss_agg_mode`` over the step) — so each is counted once. verl hands a policy loss neither the entropy nor
    the reference log-probs, so a regulariser verl does not add cannot be computed here: it is refused, naming the
    settings. Resolved once per recipe and settings."""
    entropy_coeff = float(_config_value(config, "entropy_coeff", 0.0))
    use_kl = bool(_config_value(config, "use_kl_loss", False))
    kl_type = str(_config_value(config, "kl_loss_type", "low_var_kl"))
    kl_coef = float(_config_value(config, "kl_loss_coef", 0.001))
    key = (id(recipe), entropy_coeff, use_kl, kl_type, kl_coef, loss_agg_mode)
    cached = _policy_terms.get(key)
    if cached is not None:
        return cached[1]
    from lossplug.adapters.verl_recipes import verl_regularisers

    settings = {"entropy_coeff": entropy_coeff, "use_kl_loss": use_kl, "kl_loss_type": kl_type, "kl_loss_coef": kl_coef}
    agg = LOSS_AGG_MODES.get(loss_agg_mode, loss_agg_mode)
    verl_adds = verl_regularisers(settings, agg)
    described = (
        f"actor.entropy_coeff={entropy_coeff}, use_kl_loss={use_kl}, kl_loss_type={kl_type}, kl_loss_coef={kl_coef}, "
        f"loss_agg_mode={loss_agg_mode}"
    )
    if recipe.regularisers:
        base = {"gates": [g.to_dict() for g in recipe.gates], "reduction": recipe.reduction.to_dict()}
        expected = Recipe.load({**base, "regularisers": verl_adds}).regularisers if verl_adds else ()

        def comparable(specs: tuple[Any, ...]) -> list[tuple[str, list[tuple[str, Any]]]]:
            out = []
            for spec in specs:
                params = dict(spec.params)
                params["reduction"] = _reduction_name(params.get("reduction"), recipe.reduction.name)
                out.append((spec.name, sorted(params.items(), key=lambda kv: kv[0])))
            return sorted(out, key=repr)

        if comparable(recipe.regularisers) != comparable(expected):
            ours = [s.to_dict() for s in recipe.regularisers]
            # the exact override lines, when some verl settings do add these terms
            wanted = _verl_settings_for(recipe)
            fits = wanted is not None and comparable(recipe.regularisers) == comparable(
                Recipe.load({**base, "regularisers": verl_regularisers(wanted, agg)}).regularisers
                if verl_regularisers(wanted, agg)
                else ()
            )
            if wanted is not None and fits:
                fix = "Set: " + " ".join(f"actor_rollout_ref.actor.{k}={v}" for k, v in wanted.items())
            else:
                fix = (
                    "No verl setting adds these terms (verl adds one static entropy bonus and one KL of its "
                    "kl_penalty modes, reduced with loss_agg_mode): change the recipe's regularisers, or run it where "
                    "lossplug computes the whole loss (TRL, plain PyTorch)"
                )
            raise LossplugError(
                f"{POLICY_RECIPE_KEY}: the recipe's regularisers {ours} are not what verl's ppo_loss adds around the "
                f"policy loss for {described} ({verl_adds or 'nothing'}); verl passes a policy loss neither the "
                f"entropy nor ref_log_prob, so under verl the entropy and KL terms come from those actor settings. "
                f"{fix}"
            )
        term = Recipe.load({k: v for k, v in recipe.to_dict().items() if k != "regularisers"})
    else:
        if verl_adds:
            _warn_once(
                f"regularisers:{key[1:]}",
                (
                    f"lossplug: verl's ppo_loss adds {', '.join(r['name'] for r in verl_adds)} ({described}) to the "
                    f"policy loss of {POLICY_RECIPE_KEY}, which does not list them: its record does not describe the "
                    f"whole loss (verl_equivalent(actor) gives the recipe that does)"
                ),
            )
        term = recipe
    _policy_terms[key] = (recipe, term)
    return term


def _verl_settings_for(recipe: Recipe) -> dict[str, Any] | None:
    """The actor settings under which verl's ``ppo_loss`` adds the recipe's entropy / KL stages — None when they
    are not of that shape (several of a kind, an adaptive coefficient, another regulariser)."""
    entropy = [r for r in recipe.regularisers if r.name == "entropy"]
    kl = [r for r in recipe.regularisers if r.name == "kl"]
    if len(entropy) + len(kl) != len(recipe.regularisers) or len(entropy) > 1 or len(kl) > 1:
        return None
    if any(r.params.get("adaptive") for r in entropy):
        return None
    return {
        "entropy_coeff": float(entropy[0].params["coef"]) if entropy else 0.0,
        "use_kl_loss": bool(kl),
        "kl_loss_type": str(kl[0].params.get("estimator", "low_var_kl")) if kl else "low_var_kl",
        "kl_loss_coef": float(kl[0].params["coef"]) if kl else 0.001,
    }


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
    from lossplug.adapters.verl_recipes.rollout_correction import correction_gates

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


#: (id(recipe), forwarded rollout_correction, weights given) → (recipe, the recipe without verl's correction gates)
_correction_terms: dict[tuple[Any, ...], tuple[Recipe, Recipe]] = {}


def _without_verls_correction(recipe: Recipe, policy_cfg: Any, *, has_weights: bool) -> Recipe:
    """The recipe without its correction gates against the rollout engine, once they are found to be exactly verl's
    ``algorithm.rollout_correction`` (forwarded as ``actor.policy_loss.rollout_correction``), which verl's driver has
    applied: its weights arrive as ``rollout_is_weights`` (applied by the caller, once) and its rejection in
    ``response_mask``. A recipe without such gates is returned as is. Otherwise refused, with the override lines."""
    from lossplug.adapters.verl_recipes import as_plain
    from lossplug.adapters.verl_recipes.rollout_correction import correction_gates

    engine_side = _engine_corrections(recipe)
    if not engine_side:
        return recipe
    forwarded = as_plain(getattr(policy_cfg, "rollout_correction", None), "policy_loss.rollout_correction")
    key = (id(recipe), json.dumps(forwarded, sort_keys=True, default=str), has_weights)
    cached = _correction_terms.get(key)
    if cached is not None:
        return cached[1]
    ours = [recipe.gates[i].to_dict() for i, _ in engine_side]
    names = ", ".join(f"recipe.gates[{i}] ({s.plugin.name})" for i, s in engine_side)
    lines = _verl_lines(ours)
    wanted = (
        f"forward algorithm.rollout_correction to the actor and set it to the recipe's corrections: {_FORWARD_LINE} "
        f"{lines}"
        if lines is not None
        else "verl's rollout correction has no setting for them: drop them from the recipe (and use verl's "
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
    term = Recipe.load(spec)
    _correction_terms[key] = (recipe, term)
    return term


_checked_kinds: set[str] = set()


def _check_once(kind: str) -> None:
    """The registration check, once per process and function kind (the hot path pays one set lookup)."""
    if kind in _checked_kinds:
        return
    check_registration(policy_loss=kind == "policy", estimator=kind == "estimator")
    _checked_kinds.add(kind)


# ---------------------------------------------------------------------------------------------------------------------
# The policy loss


def compute_policy_loss_lossplug(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Tensor | None = None,
    rollout_log_probs: Tensor | None = None,
    **_: Any,
) -> tuple[Tensor, dict[str, Any]]:
    """verl policy loss ``lossplug``: the recipe's gates and reduction (``actor_rollout_ref.actor.policy_loss.recipe``).

    Returns ``(loss, metrics)`` like verl's built-ins: the loss is this micro-batch's share of the step, already
    multiplied by ``dp_size``; entropy and KL are left to verl's ``ppo_loss``.
    """
    _check_once("policy")
    recipe = _policy_term(_policy_recipe(config), config, loss_agg_mode)
    compiled = lossplug.compile_recipe(recipe)
    policy_cfg = getattr(config, "policy_loss", None)
    validate: Validate = getattr(policy_cfg, "validation", "full") if policy_cfg is not None else "full"
    level = metric_level(getattr(policy_cfg, "metrics", "basic") if policy_cfg is not None else "basic")

    reduction = compiled.reduction.plugin.name
    matching = LOSS_AGG_MODES.get(loss_agg_mode)
    if matching != reduction:
        wanted = next((m for m, r in LOSS_AGG_MODES.items() if r == reduction), "a matching mode")
        _warn_once(
            f"agg:{loss_agg_mode}:{reduction}",
            (
                f"lossplug: the recipe reduces the policy term with '{reduction}', but actor.loss_agg_mode="
                f"{loss_agg_mode} (lossplug's {matching or 'no reduction'}) still reduces verl's entropy and KL terms; "
                f"set loss_agg_mode to {wanted} to reduce them alike"
            ),
        )

    # corrections on the engine ratio read the rollout engine's log-probs; bypass mode's gates (bypass_is, bypass_rs)
    # read old_logp, which verl's apply_bypass_mode has set to the rollout log-probs. verl's ppo_loss never passes
    # rollout_log_probs: such gates must be verl's own rollout correction, which its driver has applied already
    if rollout_is_weights is not None or rollout_log_probs is None:
        recipe = _without_verls_correction(recipe, policy_cfg, has_weights=rollout_is_weights is not None)
        compiled = lossplug.compile_recipe(recipe)

    mask = response_mask.bool()
    keep = mask.any(-1)
    info = getattr(config, "global_batch_info", None) if config is not None else None
    if not bool(keep.any()):  # nothing to learn from in this micro-batch; keep the graph connected
        return (log_prob * 0).sum(), {}
    # the share of this micro-batch's rows that have an action token (1.0 unless rows are left out below)
    kept_share = 1.0
    if not bool(keep.all()):
        kept_share = int(keep.sum()) / keep.numel()

        def rows(t: Tensor | None) -> Tensor | None:
            return None if t is None or t.ndim == 0 else t[keep]

        # (rows keeps a tensor a tensor)
        log_prob, old_log_prob = rows(log_prob), rows(old_log_prob)  # type: ignore[assignment]
        advantages, mask = rows(advantages), mask[keep]  # type: ignore[assignment]
        rollout_is_weights, rollout_log_probs = rows(rollout_is_weights), rows(rollout_log_probs)

    local = getattr(compiled.reduction.params, "population", "step") == "micro_batch"
    normalizer, dp_size = verl_normalizer(info, mask, counts_needed=reduction != "token_sum" and not local)
    if local:
        # population: micro_batch (verl's geo_mean): verl's engine backpropagates each micro-batch's loss as it is
        # (no 1 / micro-batches) and averages the ranks' gradients, and a batch-local verl loss is its micro-batch's
        # own mean over every row (rows without an action token count in torch.mean's denominator): the micro-batch
        # is its own population (only the budget of `fixed` is verl's), no × dp_size, times the kept rows' share
        budget = normalizer.budget if normalizer is not None else None
        normalizer = (
            None
            if budget is None
            else Normalizer(
                action_tokens=max(int(mask.sum()), 1), sequences=mask.shape[0], budget=budget, micro_batches=1
            )
        )
    params: Any = compiled.reduction.params  # (the reduction's own model: FixedParams for 'fixed')
    if reduction == "fixed" and params.budget is None and (normalizer is None or normalizer.budget is None):
        raise LossplugError(
            f"{POLICY_RECIPE_KEY}: reduction 'fixed' needs a budget: set "
            f"actor_rollout_ref.actor.loss_scale_factor=<max response length> (verl's "
            f"seq-mean-token-sum-norm constant) or give the recipe one ({{name: fixed, budget: N}})"
        )

    batch = PolicyBatch.unchecked(
        logp=log_prob, action_mask=mask, old_logp=old_log_prob, advantage=advantages, behavior_logp=rollout_log_probs
    )
    result = lossplug.policy_loss(
        batch, recipe, normalizer, validate=validate, metrics=level, weight=rollout_is_weights
    )
    loss = result.loss * (kept_share if local else dp_size)

    metrics: dict[str, Any] = {}
    if level != "off":  # verl wants floats: one device→host transfer for all of them
        with torch.no_grad():
            found = dict(result.metric_tensors)
            found.pop("loss", None)
            # verl's ppo_kl is lossplug's update/approx_kl: mean over the actions of old_log_prob − log_prob
            approx_kl = found.pop("update/approx_kl", None)
            tensors = {} if approx_kl is None else {"actor/ppo_kl": approx_kl}
            # lossplug's engine/approx_kl is verl's rollout_corr/kl (mean of rollout − old log-probs); under the
            # actor's prefix, beside the trainer's own whole-batch value rather than in its place
            engine_kl = found.pop("engine/approx_kl", None)
            if engine_kl is not None:
                tensors["actor/rollout_corr/kl"] = engine_kl
            gate_metrics = found if approx_kl is None else {**found, "update/approx_kl": approx_kl}
            tensors.update(_verl_metrics(compiled.update.plugin.name, gate_metrics))
            tensors.update({f"actor/lossplug/{k}": v for k, v in found.items()})
            values = torch.stack([t.detach().double().reshape(()) for t in tensors.values()]).tolist()
        metrics = dict(zip(tensors, values))
    return loss, metrics


# ---------------------------------------------------------------------------------------------------------------------
# The advantage estimator

#: PolicyBatch field → the DataProto key it is read from, for plugins that need more than rewards
_EXTRA_FIELDS = {
    "value": "values",
    "old_logp": "old_log_probs",
    "ref_logp": "ref_log_prob",
    "behavior_logp": "rollout_log_probs",
    "reward_baseline": "reward_baselines",
    "sum_pi_squared": "sum_pi_squared",
}
#: the DataProto keys ``ray_trainer.compute_advantage`` hands a registered estimator (besides rewards, mask, uid)
_PASSED_BY_VERL = frozenset({"reward_baselines"})


def _algorithm_value(config: Any, key: str) -> Any:
    if config is None:
        return None
    if hasattr(config, "get"):
        try:
            return config.get(key)
        except Exception:  # pragma: no cover
            return None
    return getattr(config, key, None)


def _advantage_stage(recipe: Recipe, key: str) -> Any:
    stage = lossplug.compile_recipe(recipe).advantage
    if stage is None:
        raise LossplugError(f"{key}: the recipe has no advantage stage; add one, e.g. advantage: {{name: grpo}}")
    return stage


def compute_lossplug_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Any = None,
    config: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """verl advantage estimator ``lossplug``: the advantage stage of ``algorithm.lossplug``.

    Returns ``(advantages, returns)``, both ``[B, T]`` and zero off the response mask; ``returns`` are the critic
    targets where the plugin has a critic (GAE: ``A + V_old``), otherwise the advantages (verl's convention).
    ``algorithm.gamma``, ``lam`` and ``norm_adv_by_std_in_grpo`` are not read: the recipe's parameters are.

    verl's ``ray_trainer.compute_advantage`` passes a registered estimator only ``token_level_rewards``,
    ``response_mask``, ``index`` (uid) and ``reward_baselines``: a plugin that needs anything else (critic
    ``values`` for ``gae``, log-probs) is refused here with the way out — :func:`compute_advantage` on the
    ``DataProto`` in a custom trainer, or verl's own estimator.
    """
    _check_once("estimator")
    source = _algorithm_value(config, "lossplug")
    if source is None:
        raise LossplugError(
            f"algorithm.adv_estimator={NAME} needs a recipe: +{ADVANTAGE_RECIPE_KEY}=<preset | "
            f"/abs/path/recipe.yaml | {{…}}> (its advantage stage is used)"
        )
    recipe = load_recipe(source, ADVANTAGE_RECIPE_KEY)
    stage = _advantage_stage(recipe, ADVANTAGE_RECIPE_KEY)
    for name in ("gamma", "lam"):
        if name in type(stage.params).model_fields:
            ours, theirs = getattr(stage.params, name), _algorithm_value(config, name)
            if theirs is not None and float(theirs) != float(ours):
                _warn_once(
                    f"{name}:{ours}:{theirs}",
                    (
                        f"lossplug: {ADVANTAGE_RECIPE_KEY} uses {stage.plugin.name} {name}={ours}; algorithm.{name}="
                        f"{theirs} is not read under adv_estimator={NAME}"
                    ),
                )
    extra = {key: value for key, value in kwargs.items() if key in _EXTRA_FIELDS.values() and value is not None}
    return _estimate(recipe, ADVANTAGE_RECIPE_KEY, token_level_rewards, response_mask, index, extra, from_verl=True)


def compute_advantage(data: Any, recipe: Any, *, reward_keys: Sequence[str] | None = None) -> Any:
    """The recipe's advantage stage on a verl ``DataProto``, for custom trainers: the explicit path for plugins that
    read more than verl hands a registered estimator (``gae`` reads the critic's ``values``).

    Reads ``token_level_rewards``, ``response_mask`` and ``non_tensor_batch["uid"]``, plus whatever the plugin
    requires of ``values``, ``old_log_probs``, ``ref_log_prob``, ``rollout_log_probs``, ``reward_baselines`` and
    ``sum_pi_squared`` from ``data.batch``; ``reward_keys`` (verl's ``algorithm.gdpo_reward_keys``) name the
    per-response reward components, read from ``data.non_tensor_batch`` (or ``data.batch``) as the columns of
    ``PolicyBatch.reward_components`` for multi-reward plugins (``gdpo``). Writes ``data.batch["advantages"]`` and ``data.batch["returns"]`` (``[B, T]``, zero off the
    response mask) and returns ``data`` — what ``verl.trainer.ppo.ray_trainer.compute_advantage`` does with verl's
    own estimators. ``recipe``: a :class:`~lossplug.Recipe`, preset name, YAML/JSON path or mapping.
    """
    batch = data.batch
    where = "compute_advantage(recipe)"
    recipe = load_recipe(recipe, where)
    _advantage_stage(recipe, where)
    keys = set(batch.keys())
    for needed in ("token_level_rewards", "response_mask"):
        if needed not in keys:
            raise LossplugError(f"compute_advantage: data.batch has no '{needed}' (keys: {', '.join(sorted(keys))})")
    extra = {key: batch[key] for key in _EXTRA_FIELDS.values() if key in keys}
    if reward_keys:
        extra[_REWARD_COMPONENTS] = _reward_components(data, list(reward_keys), batch["token_level_rewards"])
    uid = data.non_tensor_batch.get("uid") if getattr(data, "non_tensor_batch", None) is not None else None
    adv, ret = _estimate(
        recipe, where, batch["token_level_rewards"], batch["response_mask"], uid, extra, from_verl=False
    )
    batch["advantages"] = adv
    batch["returns"] = ret
    return data


#: the pseudo DataProto key under which compute_advantage hands the stacked reward components to _estimate
_REWARD_COMPONENTS = "reward_components"


def _reward_components(data: Any, reward_keys: list[str], rewards: Tensor) -> Tensor:
    """``[B, K]`` float64: one column per key, from ``non_tensor_batch`` (verl's reward manager's per-response scores)
    or ``batch``."""
    non_tensor = getattr(data, "non_tensor_batch", None) or {}
    columns = []
    for key in reward_keys:
        if key in non_tensor:
            column = torch.as_tensor(np.asarray(non_tensor[key], dtype=np.float64))
        elif key in data.batch.keys():
            column = data.batch[key].to(torch.float64)
        else:
            raise LossplugError(
                f"compute_advantage: reward_keys names '{key}', which is in neither data.non_tensor_batch "
                f"({', '.join(sorted(non_tensor)) or 'empty'}) nor data.batch"
            )
        if column.ndim != 1 or column.shape[0] != rewards.shape[0]:
            raise LossplugError(
                f"compute_advantage: reward component '{key}' must hold one value per response "
                f"([{rewards.shape[0]}]), got shape {list(column.shape)}"
            )
        columns.append(column.to(rewards.device))
    return torch.stack(columns, -1)


def _estimate(
    recipe: Recipe,
    key: str,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Any,
    extra_by_verl_key: Mapping[str, Tensor],
    *,
    from_verl: bool,
) -> tuple[Tensor, Tensor]:
    stage = _advantage_stage(recipe, key)
    plugin = stage.plugin
    mask = response_mask.bool()
    B, T = mask.shape
    dtype = token_level_rewards.dtype if token_level_rewards.is_floating_point() else torch.float32
    keep = mask.any(-1)
    advantages = torch.zeros(B, T, dtype=dtype, device=token_level_rewards.device)
    returns = torch.zeros_like(advantages)

    extra: dict[str, Tensor] = {}
    required = plugin.required_fields(stage.params)
    fields_by_key = {**_EXTRA_FIELDS, "reward_components": _REWARD_COMPONENTS}
    for name in (f for f in fields_by_key if f in required):
        verl_key = fields_by_key[name]
        value = extra_by_verl_key.get(verl_key)
        if value is not None:
            extra[name] = value
        elif from_verl and verl_key not in _PASSED_BY_VERL:
            raise LossplugError(
                f"{key}: advantage plugin '{plugin.name}' needs '{verl_key}', which verl's "
                f"ray_trainer.compute_advantage does not pass to a registered estimator (it passes "
                f"token_level_rewards, response_mask, uid and reward_baselines); under verl's trainer use verl's own "
                f"estimator for it (e.g. adv_estimator=gae), or in a custom trainer call "
                f"lossplug.adapters.verl.compute_advantage(data, recipe) on the DataProto, which reads '{verl_key}' "
                f"from data.batch"
            )
        else:
            hint = {
                "values": " (a critic-based recipe needs critic.enable=True)",
                _REWARD_COMPONENTS: " (pass reward_keys=, verl's algorithm.gdpo_reward_keys)",
                "sum_pi_squared": " (verl computes it with actor.calculate_sum_pi_squared=True)",
            }.get(verl_key, "")
            raise LossplugError(
                f"{key}: advantage plugin '{plugin.name}' needs '{verl_key}', which the batch does not hold{hint}"
            )
    if not bool(keep.any()):
        return advantages, returns

    off = (token_level_rewards != 0) & ~mask
    if bool(off.any()):
        from lossplug.contracts.errors import describe_positions

        raise LossplugError(
            f"token_level_rewards: non-zero rewards outside response_mask at "
            f"{describe_positions(off)}; lossplug credits rewards on action tokens only (verl's "
            f"outcome estimators sum every position) — place the score on the last response token"
        )

    def rows(t: Tensor) -> Tensor:
        return t if bool(keep.all()) else t[keep]

    fields: dict[str, Any] = {name: rows(value) for name, value in extra.items()}
    logp = fields.get("old_logp")
    fields["logp"] = logp if logp is not None else torch.zeros_like(rows(mask), dtype=dtype)
    fields["action_mask"] = rows(mask)
    fields["reward"] = rows(token_level_rewards).to(dtype)
    if index is not None:
        fields["group_id"] = rows(group_ids(index).to(mask.device))
    batch = PolicyBatch.unchecked(**fields)
    try:
        result = lossplug.estimate_advantages(batch, recipe)
    except RecipeError as err:
        raise _keyed(err, key) from None
    adv = result.advantage
    if adv.ndim == 1:
        adv = adv.unsqueeze(-1).expand(-1, T)
    ret = result.returns if result.returns is not None else adv
    kept_mask = rows(mask)
    adv = torch.where(kept_mask, adv.to(dtype), 0)
    ret = torch.where(kept_mask, ret.to(dtype), 0)
    if bool(keep.all()):
        return adv, ret
    advantages[keep] = adv
    returns[keep] = ret
    return advantages, returns


# ---------------------------------------------------------------------------------------------------------------------
# TRL beside verl


def trl_breaks_verl() -> str | None:
    """Why the TRL installed beside verl breaks verl's FSDP workers, or ``None`` when it does not (no TRL, or a TRL
    that still has ``AutoModelForCausalLMWithValueHead``). Reads files only: TRL is not imported.

    verl 0.9.1's ``models/transformers/monkey_patch.py`` imports ``AutoModelForCausalLMWithValueHead`` from
    ``trl.experimental.ppo`` or ``trl`` whenever ``importlib.util.find_spec("trl")`` finds TRL; TRL ≥ 1.0 has
    neither, so building an FSDP actor fails with ImportError — on GPUs too. ``lossplug[all]`` installs exactly
    that combination."""
    try:
        spec = importlib.util.find_spec("trl")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = next(iter(spec.submodule_search_locations))
    if os.path.isdir(os.path.join(root, "experimental", "ppo")):
        return None
    try:
        with open(os.path.join(root, "__init__.py"), encoding="utf-8") as f:
            if "AutoModelForCausalLMWithValueHead" in f.read():
                return None
    except OSError:
        return None
    try:
        version = md.version("trl")
    except md.PackageNotFoundError:
        version = "?"
    return (
        f"lossplug: TRL {version} is installed beside verl in {sys.prefix}: verl's FSDP workers "
        f"(verl/models/transformers/monkey_patch.py) import AutoModelForCausalLMWithValueHead from trl whenever TRL "
        f"is importable, and this TRL has none, so building the actor fails with ImportError (on GPUs too). Run verl "
        f"from an environment without TRL: pip uninstall trl there, and install lossplug with pip install "
        f"'lossplug[verl]' (lossplug[all] brings TRL); TRL runs belong in their own environment"
    )


def _warn_if_trl_breaks_verl() -> None:
    problem = trl_breaks_verl()
    if problem is not None:
        _warn_once("trl-beside-verl", problem)


compute_policy_loss_lossplug.__lossplug_verl__ = True  # type: ignore[attr-defined]
compute_lossplug_advantage.__lossplug_verl__ = True  # type: ignore[attr-defined]

register()
_warn_if_trl_breaks_verl()
