"""Recipes: which reward shapers and filters, which advantage, which gates, which reduction and which regularizers,
with their parameters.

A recipe is data — it parses from a dict, YAML or JSON, is written into every run's record, and is validated the
moment it is built: every plugin name must be registered, and every parameter must pass the plugin's own pydantic
model. A typo fails before any tensor is touched, with a message naming the stage, the plugin, the parameter and
the allowed values.

The stages:

* ``shapers`` — optional, the rollout side: each rewrites the reward (KL in the reward, length and overlong
  penalties, clipping, scaling, running normalisation), in the recipe's order, before the advantage. A list.
* ``filters`` — optional, the rollout side: each decides which responses and tokens take part in the update,
  after the shapers and before the advantage; a filtered token leaves every denominator. A list.
* ``advantage`` — optional: without one, advantages come with the batch.
* ``gates`` — the first is the **update gate** (turns ratio × advantage into a per-token objective that carries the
  gradient); the rest are **detached corrections** (weights on the engine ratio old/behaviour).
* ``reduction`` — turns the per-token objective into the scalar, over the step's global population.
* ``regularizers`` — optional: per-token terms added to the loss with a coefficient (KL to the reference, entropy
  bonus), each ``coef · reduce(term)`` with the recipe's reduction unless it names its own. A list; one allowed.

The seam with the plugins. ``contracts`` holds the structure — the plugin kinds and the recipe key of each
(:data:`PLUGIN_KINDS`), stage shapes, gate positions, which errors belong to which stage — and the :class:`Catalogue`
protocol; it imports nothing of ``lossplug``'s core, not even by name (dependencies point one way). Whether a plugin
exists, whether its parameters validate and what a preset says are the catalogue's checks. The catalogue is the one
:func:`install_catalogue` installed; until something is installed, :func:`installed_catalogue` asks the top-level
package that ships ``contracts`` for its default, once, the first time a recipe is checked: it calls that package's
``default_recipe_catalogue()`` (``lossplug``'s returns its plugin registry), so merely importing ``contracts`` builds
nothing. Without a catalogue (``install_catalogue(None)``), checking a recipe is a :class:`LossplugError` saying so.

Every stage is checked even when an earlier one failed: one :class:`RecipeError` reports them all, each line naming
its stage.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, cast

from pydantic import BaseModel, ConfigDict, PrivateAttr, model_validator

from .errors import LossplugError, PluginError, RecipeError, did_you_mean

#: The plugin kinds, in recipe order, and the recipe key each kind's stages sit under. The one spelling of the kinds:
#: the recipe's keys are read from it, and core binds each kind to its plugin class and registration hook
#: (``lossplug.kinds.KINDS``, derived from this table).
PLUGIN_KINDS: Mapping[str, str] = {
    "shaper": "shapers",
    "filter": "filters",
    "advantage": "advantage",
    "gate": "gates",
    "reduction": "reduction",
    "regularizer": "regularizers",
}

#: recipe keys under their earlier spellings: still read, written under the new one (lossplug 0.1.0 wrote
#: ``regularisers``)
RENAMED_KEYS = {"regularisers": "regularizers"}

#: the recipe's stage keys
STAGES = tuple(PLUGIN_KINDS.values())


class Catalogue(Protocol):
    """What a recipe's stages are checked against: the plugins and presets of an installed package."""

    def check_stage(self, kind: str, spec: PluginSpec, where: str, role: str | None = None) -> PluginSpec:
        """``spec`` with its parameters validated and their defaults filled in. Raises a :class:`RecipeError`
        starting with ``where`` when no ``kind`` plugin has that name, a parameter is refused, or — with ``role`` —
        the gate has another role (``"update"`` / ``"correction"``)."""
        ...

    def preset(self, name: str) -> Mapping[str, Any]:
        """The recipe mapping of a named preset (with its ``name``); a :class:`RecipeError` when there is none."""
        ...


_catalogue: Catalogue | None = None
#: whether a catalogue was chosen: installed, or the default looked up (``_catalogue`` None then means "none")
_chosen = False


def _default_catalogue() -> Catalogue | None:
    """The default catalogue of the top-level package that ships ``contracts``: its ``default_recipe_catalogue()``.

    ``contracts`` is always imported as a subpackage, so importing that package only returns it; asking it by an
    attribute (never a module path) keeps ``contracts`` free of any name of core while core supplies the
    implementation."""
    package = importlib.import_module(__name__.partition(".")[0])
    provide = getattr(package, "default_recipe_catalogue", None)
    return cast("Catalogue | None", provide()) if callable(provide) else None


def install_catalogue(catalogue: Catalogue | None) -> Catalogue | None:
    """Install the catalogue recipes are checked against and return the one in force before (``None`` uninstalls:
    checking a recipe then raises)."""
    global _catalogue, _chosen
    previous = _catalogue if _chosen else _default_catalogue()
    _catalogue, _chosen = catalogue, True
    return previous


def installed_catalogue() -> Catalogue:
    """The catalogue in force: the installed one, else the package's default (looked up once)."""
    global _catalogue, _chosen
    if not _chosen:
        _catalogue, _chosen = _default_catalogue(), True
    if _catalogue is None:
        raise LossplugError(
            "recipe: no plugin catalogue is installed, so plugin names and parameters cannot be "
            "checked (the lossplug package provides its plugin registry the first time a recipe is checked; "
            "install_catalogue(None) removed it)"
        )
    return _catalogue


class PluginSpec(BaseModel):
    """One stage of a recipe: a plugin name and its (validated, defaults-filled) parameters."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    params: dict[str, Any] = {}

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.params}

    @classmethod
    def parse(cls, raw: Any, where: str) -> PluginSpec:
        if isinstance(raw, PluginSpec):
            return raw
        if isinstance(raw, str):
            return cls(name=raw)
        if isinstance(raw, Mapping):
            if "name" not in raw or not isinstance(raw["name"], str):
                raise RecipeError(f"{where}: needs a 'name' (the plugin, a string), got {dict(raw)!r}")
            if "params" in raw:
                if len(raw) > 2:
                    raise RecipeError(f"{where}: give parameters either flat or under 'params', not both")
                if not isinstance(raw["params"], Mapping):
                    raise RecipeError(
                        f"{where}: params must be a mapping of parameter name → value, got "
                        f"{type(raw['params']).__name__} {raw['params']!r}"
                    )
                params = dict(raw["params"])
            else:
                params = {k: v for k, v in raw.items() if k != "name"}
            bad = [k for k in params if not isinstance(k, str)]
            if bad:
                raise RecipeError(f"{where}: parameter names must be strings, got {bad!r}")
            return cls(name=raw["name"], params=params)
        raise RecipeError(f"{where}: expected a plugin name or a mapping with 'name', got {type(raw).__name__}")


def _merge_stage(base: Any, override: Any) -> Any:
    """A stage override without a name, or with the preset's own plugin name, only changes parameters:
    ``Recipe.preset("ppo", advantage={"kl_coef": 0.05})`` keeps ``gae`` and its other parameters."""
    if not isinstance(override, Mapping) or base is None or isinstance(base, (list, tuple)):
        return override
    base_spec = PluginSpec.parse(base, "preset")
    if override.get("name", base_spec.name) != base_spec.name:
        return override
    extra = (
        dict(override.get("params", {})) if "params" in override else {k: v for k, v in override.items() if k != "name"}
    )
    return {"name": base_spec.name, **base_spec.params, **extra}


class _StageErrors:
    """The errors of a recipe's stages, collected so that one error reports every stage at once."""

    def __init__(self) -> None:
        self.found: list[LossplugError] = []

    @contextmanager
    def stage(self) -> Iterator[None]:
        try:
            yield
        except (RecipeError, PluginError) as err:
            self.found.append(err)

    def raise_any(self) -> None:
        if len(self.found) == 1:
            raise self.found[0]
        if self.found:
            # a PluginError (a name registered twice) is about the installation, not the recipe: it keeps its type
            # only when it is all there is to report
            kind = PluginError if all(isinstance(e, PluginError) for e in self.found) else RecipeError
            lines = "\n".join(f"  {e}" for e in self.found)
            raise kind(f"recipe: {len(self.found)} stages have errors:\n{lines}")


def _check_stage(raw: Any, kind: str, where: str, role: str | None = None) -> PluginSpec:
    return installed_catalogue().check_stage(kind, PluginSpec.parse(raw, where), where, role)


def _check_gates(gates: Any, errors: _StageErrors) -> tuple[PluginSpec, ...]:
    if isinstance(gates, (str, Mapping)):
        gates = [gates]
    if gates is not None and not isinstance(gates, (list, tuple)):
        raise RecipeError(f"recipe.gates: must be a list of gates (or one gate), got {type(gates).__name__} {gates!r}")
    if not gates:
        raise RecipeError("recipe.gates: needs at least one gate (the update gate, e.g. ppo_clip)")
    resolved = []
    for i, raw in enumerate(gates):
        with errors.stage():
            # the first gate carries the gradient; every later one is a detached correction on the engine ratio
            resolved.append(_check_stage(raw, "gate", f"recipe.gates[{i}]", "update" if i == 0 else "correction"))
    return tuple(resolved)


def _check_list(raw_stages: Any, kind: str, errors: _StageErrors) -> tuple[PluginSpec, ...]:
    """A stage key that holds a list of ``kind`` plugins (or one): shapers, filters, regularizers."""
    key = PLUGIN_KINDS[kind]
    if raw_stages is None:
        return ()
    if isinstance(raw_stages, (str, Mapping)):
        raw_stages = [raw_stages]
    if not isinstance(raw_stages, (list, tuple)):
        raise RecipeError(
            f"recipe.{key}: must be a list of {key} (or one), got {type(raw_stages).__name__} {raw_stages!r}"
        )
    resolved = []
    for i, raw in enumerate(raw_stages):
        with errors.stage():
            resolved.append(_check_stage(raw, kind, f"recipe.{key}[{i}]"))
    return tuple(resolved)


class Recipe(BaseModel):
    """A validated recipe. Build from a dict, ``Recipe.preset(name)``, ``Recipe.from_yaml/json/file`` or
    ``Recipe.load(anything)``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: the preset this recipe came from, if any (recorded for provenance)
    name: str | None = None
    shapers: tuple[PluginSpec, ...] = ()
    filters: tuple[PluginSpec, ...] = ()
    advantage: PluginSpec | None = None
    gates: tuple[PluginSpec, ...]
    reduction: PluginSpec
    regularizers: tuple[PluginSpec, ...] = ()

    #: what core compiled this recipe into (opaque here): see :attr:`compiled`
    _compiled: Any = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _resolve(cls, data: Any) -> Any:
        if isinstance(data, Recipe):
            return data.model_dump()
        if not isinstance(data, Mapping):
            raise RecipeError(f"recipe: expected a mapping with {', '.join(STAGES)}, got {type(data).__name__}")
        data = dict(data)
        for old, new in RENAMED_KEYS.items():  # recipes written before a key's rename still load
            if old in data:
                if new in data:
                    raise RecipeError(f"recipe: '{old}' is the old spelling of '{new}'; give one of them")
                data[new] = data.pop(old)
        if "preset" in data:  # a preset with overrides: {preset: dapo, reduction: token}
            preset = data.pop("preset")
            if not isinstance(preset, str):
                raise RecipeError(
                    f"recipe.preset: must be a preset name (a string), got {type(preset).__name__} {preset!r}"
                )
            base = dict(installed_catalogue().preset(preset))
            data = {**base, **{k: _merge_stage(base.get(k), v) for k, v in data.items()}}
        allowed = ("name",) + STAGES
        for key in data:
            if key not in allowed:
                raise RecipeError(
                    f"recipe: unknown key '{key}'{did_you_mean(key, allowed)}; keys are: {', '.join(allowed)}, preset"
                )
        if data.get("name") is not None and not isinstance(data["name"], str):
            raise RecipeError(f"recipe.name: must be a string, got {type(data['name']).__name__} {data['name']!r}")
        out: dict[str, Any] = {"name": data.get("name")}
        errors = _StageErrors()
        for kind in ("shaper", "filter"):
            with errors.stage():
                out[PLUGIN_KINDS[kind]] = _check_list(data.get(PLUGIN_KINDS[kind]), kind, errors)
        if data.get("advantage") is not None:
            with errors.stage():
                out["advantage"] = _check_stage(data["advantage"], "advantage", "recipe.advantage")
        with errors.stage():
            out["gates"] = _check_gates(data.get("gates"), errors)
        with errors.stage():
            if data.get("reduction") is None:
                raise RecipeError("recipe.reduction: required (e.g. token, response, fixed, sequence_sum)")
            out["reduction"] = _check_stage(data["reduction"], "reduction", "recipe.reduction")
        with errors.stage():
            out["regularizers"] = _check_list(data.get("regularizers"), "regularizer", errors)
        errors.raise_any()
        return out

    # ---- construction -------------------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Recipe:
        """A named preset (``grpo``, ``dr_grpo``, ``dapo`` …), optionally with stages overridden."""
        return cls.model_validate({"preset": name, **overrides})

    @classmethod
    def from_yaml(cls, text: str) -> Recipe:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise RecipeError(f"recipe: not valid YAML: {err}") from None
        return cls.model_validate(data)

    @classmethod
    def from_json(cls, text: str) -> Recipe:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise RecipeError(f"recipe: not valid JSON: {err}") from None
        return cls.model_validate(data)

    @classmethod
    def from_file(cls, path: str | Path) -> Recipe:
        path = Path(path)
        if not path.is_file():
            raise RecipeError(f"recipe: no such file: {path}")
        text = path.read_text()
        try:
            return cls.from_json(text) if path.suffix == ".json" else cls.from_yaml(text)
        except RecipeError as err:
            raise RecipeError(f"{path}: {err}") from None

    @classmethod
    def load(cls, source: Recipe | Mapping[str, Any] | str | Path) -> Recipe:
        """Anything that names a recipe: a Recipe, a mapping, a preset name, a YAML/JSON path or YAML text."""
        if isinstance(source, Recipe):
            return source
        if isinstance(source, Mapping):
            return cls.model_validate(source)
        if isinstance(source, Path) or (isinstance(source, str) and source.endswith((".yaml", ".yml", ".json"))):
            return cls.from_file(source)
        # a preset's name, bare or qualified by its distribution (my-presets:dapo: YAML would read it as a string)
        if (
            isinstance(source, str)
            and "\n" not in source
            and (":" not in source or re.fullmatch(r"[\w.-]+:[\w.-]+", source))
        ):
            return cls.preset(source)
        if isinstance(source, str):
            return cls.from_yaml(source)
        raise RecipeError(f"recipe: cannot load a recipe from {type(source).__name__}")

    # ---- the compiled form: resolved once by core and kept with the recipe object --------------------------------
    @property
    def compiled(self) -> Any:
        """What :func:`lossplug.compile_recipe` resolved this recipe object into, or None before the first compile.
        Opaque to ``contracts``; not part of the recipe's value (equality, hash and serialisation ignore it)."""
        return self._compiled

    def keep_compiled(self, compiled: Any) -> None:
        """Keep ``compiled`` with this recipe object (the cache :attr:`compiled` returns); core's compiler calls it."""
        self._compiled = compiled

    # ---- identity: what the recipe says, never the compiled cache riding on it ----------------------------------
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Recipe) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True, default=str))

    # ---- serialisation ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.name:
            out["name"] = self.name
        if self.shapers:
            out["shapers"] = [s.to_dict() for s in self.shapers]
        if self.filters:
            out["filters"] = [f.to_dict() for f in self.filters]
        if self.advantage is not None:
            out["advantage"] = self.advantage.to_dict()
        out["gates"] = [g.to_dict() for g in self.gates]
        out["reduction"] = self.reduction.to_dict()
        if self.regularizers:
            out["regularizers"] = [r.to_dict() for r in self.regularizers]
        return out

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)
