"""Recipes from verl's config: where they sit (:data:`POLICY_RECIPE_KEY`, :data:`ADVANTAGE_RECIPE_KEY`) and
:func:`load_recipe` — a preset name, a YAML/JSON path, YAML text or a mapping, as Hydra hands it over, into a
validated, compiled :class:`~lossplug.Recipe` whose errors name the config key (:func:`keyed`).

Loaded recipes are kept in a small cache keyed by what the recipe *says*: a file by its text (read on every load, so
a recipe file edited between two runs in one process is read again), a mapping by its value (:func:`frozen`), a
preset name or YAML text by itself. Nothing is keyed by a path alone or by an object's identity, and the cache is bounded. The
policy loss loads its recipe once per configuration (:mod:`.plan`), the estimator once per training step."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import lossplug
from lossplug.contracts import LossplugError, Recipe, RecipeError

__all__ = [
    "ADVANTAGE_RECIPE_KEY",
    "POLICY_RECIPE_KEY",
    "RECIPE_CACHE_SIZE",
    "frozen",
    "keyed",
    "load_recipe",
    "plain",
    "recipe_content",
]

#: where the recipes live in verl's config (used in every error message about a recipe)
POLICY_RECIPE_KEY = "actor_rollout_ref.actor.policy_loss.recipe"
ADVANTAGE_RECIPE_KEY = "algorithm.lossplug"

#: how many distinct recipes stay loaded (a run uses one or two; the bound keeps a long-lived process from growing)
RECIPE_CACHE_SIZE = 32

_FILE_SUFFIXES = (".yaml", ".yml", ".json")


def plain(source: Any) -> Any:
    """OmegaConf containers → plain dicts/lists (Hydra may hand over a DictConfig); anything else as it is."""
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


def frozen(value: Any) -> Any:
    """A plain config value (mappings, lists, scalars) as a hashable value equal only to the same config: mappings
    as sorted items, lists as tuples, each scalar with its type (``1``, ``1.0`` and ``True`` stay apart).
    Raises ``TypeError`` for a value with no hashable form."""
    if isinstance(value, Mapping):
        return ("{}", tuple(sorted(((str(k), frozen(v)) for k, v in value.items()), key=lambda kv: kv[0])))
    if isinstance(value, (list, tuple)):
        return ("[]", tuple(frozen(v) for v in value))
    hash(value)
    return (type(value).__name__, value)


def recipe_content(source: Any, key: str) -> tuple[Any, ...] | None:
    """What the recipe says, as a hashable value: ``("file", path, text)`` for a recipe file (read now),
    ``("mapping", frozen(source))``, ``("text", source)`` for a preset name or YAML text; None when ``source`` has no
    such value (it is then loaded without the cache). ``source`` is plain (:func:`plain`)."""
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, str) and source.endswith(_FILE_SUFFIXES):
        if not os.path.isfile(source):
            raise LossplugError(
                f"{key}: no such recipe file: {source} (relative paths resolve against this process's "
                f"working directory {os.getcwd()}; Ray workers may run elsewhere — use an absolute path "
                f"present on every node, a preset name or an inline recipe)"
            )
        with open(source, encoding="utf-8") as f:
            return ("file", source, f.read())
    if isinstance(source, str):
        return ("text", source)
    if isinstance(source, Mapping):
        try:
            return ("mapping", frozen(source))
        except TypeError:  # a value with no hashable form: loaded without the cache
            return None
    return None


def _parse(content: tuple[Any, ...], source: Any) -> Recipe:
    """The recipe that ``content`` says (a file's text as read, never the file again: what was keyed is what loads)."""
    if content[0] != "file":
        return Recipe.load(source)
    _, path, text = content
    try:
        return Recipe.from_json(text) if path.endswith(".json") else Recipe.from_yaml(text)
    except RecipeError as err:
        raise RecipeError(f"{path}: {err}") from None


_loaded: OrderedDict[tuple[Any, ...], Recipe] = OrderedDict()


def load_recipe(source: Any, key: str) -> Recipe:
    """A validated :class:`~lossplug.Recipe` from a config value (preset name, YAML/JSON path, YAML text or mapping),
    every plugin resolved (an unknown one fails here). Any error names ``key``.

    The same content gives the same recipe object (a bounded cache keyed by content, see the module docstring), so
    its compiled form is shared; an edited file gives the new recipe."""
    source = plain(source)
    if source is None or source == "" or source == {}:
        raise LossplugError(
            f"{key}: no recipe given; set it to a preset name (e.g. grpo, dapo), the path of a "
            f"recipe YAML file, or an inline mapping, e.g. +{key}=dapo"
        )
    if isinstance(source, Recipe):
        return source
    content = recipe_content(source, key)
    cached = _loaded.get(content) if content is not None else None
    if cached is not None:
        _loaded.move_to_end(content)  # type: ignore[arg-type]  # (not None: cached is only found under a key)
        return cached
    try:
        recipe = _parse(content, source) if content is not None else Recipe.load(source)
        lossplug.compile_recipe(recipe)  # resolve every plugin now: an unknown one fails here, naming the key
    except LossplugError as err:
        raise keyed(err, key) from None
    if content is not None:
        _loaded[content] = recipe
        while len(_loaded) > RECIPE_CACHE_SIZE:
            _loaded.popitem(last=False)
    return recipe
