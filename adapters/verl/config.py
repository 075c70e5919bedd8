"""Recipes from verl's config: :func:`load_recipe` (a preset name, a YAML/JSON path or an inline mapping, as Hydra
hands it over) and :class:`LossplugPolicyLossConfig`, the actor's ``policy_loss`` config that carries the recipe —
selected with ``actor_rollout_ref.actor.policy_loss._target_=lossplug.adapters.verl.LossplugPolicyLossConfig``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from verl.workers.config import PolicyLossConfig

import lossplug
from lossplug.adapters.verl.registration import NAME, check_registration
from lossplug.adapters.verl.trl_beside import warn_if_trl_breaks_verl
from lossplug.contracts import LossplugError, Recipe
from lossplug.pipeline import metric_level

__all__ = ["ADVANTAGE_RECIPE_KEY", "POLICY_RECIPE_KEY", "LossplugPolicyLossConfig", "keyed", "load_recipe"]

#: where the recipes live in verl's config (used in every error message about a recipe)
POLICY_RECIPE_KEY = "actor_rollout_ref.actor.policy_loss.recipe"
ADVANTAGE_RECIPE_KEY = "algorithm.lossplug"


def _plain(source: Any) -> Any:
    """OmegaConf containers → plain dicts/lists (Hydra may hand over a DictConfig)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a verl dependency
        return source
    if isinstance(source, (DictConfig, ListConfig)):
        return OmegaConf.to_container(source, resolve=True)
    return source


def keyed(err: LossplugError, key: str) -> LossplugError:
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
        raise keyed(err, key) from None
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
        warn_if_trl_breaks_verl()  # this process builds a verl actor: where TRL beside verl fails
