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
For the estimator: ``token_level_rewards`` → ``reward`` ``[B, T]``, ``uid`` (numpy object array) → integer
``group_id``, and — for critic-based plugins such as ``gae`` — ``values`` (plus ``old_log_probs``/``ref_log_prob``)
from the ``DataProto`` that ``ray_trainer.compute_advantage`` is processing, because verl passes only rewards, mask,
index and config to a registered estimator (the one seam here that reads verl's call stack; it checks the tensor
identity and raises if it cannot find the batch). Rows with no action token (verl's synthetic padding rows, or
responses removed by rollout rejection sampling) are left out of the lossplug batch; they get zero advantages and
contribute nothing to the loss, as in verl.

Reduction. The returned loss is this micro-batch's share of the full optimizer step: a :class:`~lossplug.Normalizer`
is built from verl's ``config.global_batch_info`` (``batch_num_tokens`` → action tokens, ``global_batch_size`` →
sequences, ``loss_scale_factor`` → the ``fixed`` reduction's budget) and the result is multiplied by ``dp_size``,
which cancels the data-parallel gradient averaging exactly as verl's ``agg_loss`` does. The recipe's reduction
decides the policy term; verl's ``loss_agg_mode`` still reduces verl's own entropy and KL terms, which ``ppo_loss``
adds itself (lossplug never adds them). ``loss_agg_mode`` ↔ reduction: ``token-mean`` ↔ ``token``,
``seq-mean-token-mean`` ↔ ``response``, ``seq-mean-token-sum`` ↔ ``sequence_sum``, ``seq-mean-token-sum-norm`` ↔
``fixed`` (budget ``loss_scale_factor``), ``token-sum`` ↔ ``token_sum`` (no denominator; only the ``× dp_size``).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import sys
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

import numpy as np
import torch
from verl.trainer.ppo import core_algos
from verl.workers.config import PolicyLossConfig

import lossplug
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
    "compute_lossplug_advantage",
    "compute_policy_loss_lossplug",
    "group_ids",
    "load_recipe",
    "register",
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
LOSS_AGG_MODES: dict[str, str] = {
    "token-mean": "token",
    "seq-mean-token-mean": "response",
    "seq-mean-token-sum": "sequence_sum",
    "seq-mean-token-sum-norm": "fixed",
    "token-sum": "token_sum",
}

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
    """

    loss_mode: str = NAME
    recipe: Any = None
    validation: str = "full"
    metrics: Any = "basic"

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
    recipe = _policy_recipe(config)
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

    if compiled.corrections:
        names = ", ".join(f"recipe.gates[{i + 1}] ({s.plugin.name})" for i, s in enumerate(compiled.corrections))
        if rollout_is_weights is not None:
            raise LossplugError(
                f"{POLICY_RECIPE_KEY}: the recipe's corrections {names} and verl's rollout correction "
                f"(rollout_is_weights, from algorithm.rollout_correction) would correct the engine mismatch twice; "
                f"disable one (algorithm.rollout_correction.rollout_is=null, or drop the corrections from the recipe)"
            )
        if rollout_log_probs is None:
            raise LossplugError(
                f"{POLICY_RECIPE_KEY}: the recipe's corrections {names} need the rollout engine's log-probs, but verl "
                f"passes no rollout_log_probs to a policy loss; use verl's rollout correction instead "
                f"(algorithm.rollout_correction.rollout_is=token|sequence, rollout_is_threshold=2.0 for TIS or "
                f'"0.5_5.0" for IcePop), which reaches lossplug as rollout_is_weights'
            )

    mask = response_mask.bool()
    keep = mask.any(-1)
    info = getattr(config, "global_batch_info", None) if config is not None else None
    if not bool(keep.any()):  # nothing to learn from in this micro-batch; keep the graph connected
        return (log_prob * 0).sum(), {}
    if not bool(keep.all()):

        def rows(t: Tensor | None) -> Tensor | None:
            return None if t is None or t.ndim == 0 else t[keep]

        # (rows keeps a tensor a tensor)
        log_prob, old_log_prob = rows(log_prob), rows(old_log_prob)  # type: ignore[assignment]
        advantages, mask = rows(advantages), mask[keep]  # type: ignore[assignment]
        rollout_is_weights, rollout_log_probs = rows(rollout_is_weights), rows(rollout_log_probs)

    normalizer, dp_size = verl_normalizer(info, mask, counts_needed=reduction != "token_sum")
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
    loss = result.loss * dp_size

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
            tensors.update({f"actor/lossplug/{k}": v for k, v in found.items()})
            values = torch.stack([t.detach().double().reshape(()) for t in tensors.values()]).tolist()
        metrics = dict(zip(tensors, values))
    return loss, metrics


# ---------------------------------------------------------------------------------------------------------------------
# The advantage estimator

#: DataProto keys read for plugins that need more than rewards (verl passes only rewards, mask, index and config)
_EXTRA_FIELDS = {
    "value": "values",
    "old_logp": "old_log_probs",
    "ref_logp": "ref_log_prob",
    "behavior_logp": "rollout_log_probs",
}


def _caller_batch(token_level_rewards: Tensor) -> Any | None:
    """The ``DataProto.batch`` that ``ray_trainer.compute_advantage`` is processing (its local ``data``), found up the
    call stack and accepted only if it holds this very ``token_level_rewards`` tensor."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return None
        data = frame.f_locals.get("data")
        batch = getattr(data, "batch", None)
        try:
            if batch is not None and batch.get("token_level_rewards", None) is token_level_rewards:
                return batch
        except Exception:  # pragma: no cover - a foreign object named data
            pass
        frame = frame.f_back
    return None


def _algorithm_value(config: Any, key: str) -> Any:
    if config is None:
        return None
    if hasattr(config, "get"):
        try:
            return config.get(key)
        except Exception:  # pragma: no cover
            return None
    return getattr(config, key, None)


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
    """
    _check_once("estimator")
    source = _algorithm_value(config, "lossplug")
    if source is None:
        raise LossplugError(
            f"algorithm.adv_estimator={NAME} needs a recipe: +{ADVANTAGE_RECIPE_KEY}=<preset | "
            f"/abs/path/recipe.yaml | {{…}}> (its advantage stage is used)"
        )
    recipe = load_recipe(source, ADVANTAGE_RECIPE_KEY)
    stage = lossplug.compile_recipe(recipe).advantage
    if stage is None:
        raise LossplugError(
            f"{ADVANTAGE_RECIPE_KEY}: the recipe has no advantage stage; add one, e.g. advantage: {{name: grpo}}"
        )
    plugin = stage.plugin
    for name in ("gamma", "lam"):
        if name in type(stage.params).model_fields:
            ours, theirs = getattr(stage.params, name), _algorithm_value(config, name)
            if theirs is not None and float(theirs) != float(ours):
                _warn_once(
                    f"{name}:{ours}:{theirs}",
                    (
                        f"lossplug: {ADVANTAGE_RECIPE_KEY} uses {plugin.name} {name}={ours}; algorithm.{name}={theirs} is "
                        f"not read under adv_estimator={NAME}"
                    ),
                )

    mask = response_mask.bool()
    B, T = mask.shape
    dtype = token_level_rewards.dtype if token_level_rewards.is_floating_point() else torch.float32
    keep = mask.any(-1)
    advantages = torch.zeros(B, T, dtype=dtype, device=token_level_rewards.device)
    returns = torch.zeros_like(advantages)
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

    extra: dict[str, Tensor] = {}
    required = plugin.required_fields(stage.params)
    wanted = [f for f in _EXTRA_FIELDS if f in required]
    source_batch = None
    if any(kwargs.get(_EXTRA_FIELDS[f]) is None for f in wanted):
        source_batch = _caller_batch(token_level_rewards)
    for name in wanted:
        key = _EXTRA_FIELDS[name]
        value = kwargs.get(key)
        if value is None and source_batch is not None and key in source_batch.keys():
            value = source_batch[key]
        if value is not None:
            extra[name] = value
        else:
            raise LossplugError(
                f"{ADVANTAGE_RECIPE_KEY}: advantage plugin '{plugin.name}' needs '{key}', which verl does not pass to "
                f"a registered estimator and which was not found in the DataProto being processed by "
                f"verl.trainer.ppo.ray_trainer.compute_advantage; a critic-based recipe needs critic.enable=True "
                f"(verl enables a critic by itself only for adv_estimator=gae)"
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
        raise _keyed(err, ADVANTAGE_RECIPE_KEY) from None
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


compute_policy_loss_lossplug.__lossplug_verl__ = True  # type: ignore[attr-defined]
compute_lossplug_advantage.__lossplug_verl__ = True  # type: ignore[attr-defined]

register()
