"""Recipes: which advantage, which gates and which reduction, with their parameters.

A recipe is data — it parses from a dict, YAML or JSON, is written into every run's record, and is validated the
moment it is built: every plugin name must be registered, and every parameter must pass the plugin's own pydantic
model. A typo fails before any tensor is touched, with a message naming the stage, the plugin, the parameter and
the allowed values.

The stages:

* ``advantage`` — optional: without one, advantages come with the batch.
* ``gates`` — the first is the **update gate** (turns ratio × advantage into a per-token objective that carries the
  gradient); the rest are **detached corrections** (weights on the engine ratio old/behaviour).
* ``reduction`` — turns the per-token objective into the scalar, over the step's global population.

``contracts`` does not import the plugin registry (dependencies point one way); the registry installs itself as the
catalogue recipes consult, through :func:`set_catalog`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol, Union

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, model_validator

from .errors import RecipeError, did_you_mean

STAGES = ("advantage", "gates", "reduction")


class PluginInfo(Protocol):
    name: str
    kind: str
    params: type[BaseModel]
    role: Optional[str]


class Catalog(Protocol):
    def lookup(self, kind: str, name: str, where: str) -> PluginInfo: ...

    def preset(self, name: str) -> Mapping[str, Any]: ...


_catalog: Optional[Catalog] = None


def set_catalog(catalog: Catalog) -> None:
    """Install the plugin catalogue recipes are validated against (done by ``import lossplug``)."""
    global _catalog
    _catalog = catalog


def _get_catalog() -> Catalog:
    if _catalog is None:
        # The registry installs itself on import. It is looked up by name, not imported statically: contracts must
        # not depend on core, and `import lossplug` resolves its names lazily.
        import importlib

        importlib.import_module("lossplug.plugin_registry")
    return _catalog


def format_param_errors(err: ValidationError, where: str, plugin: str, allowed: list[str]) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<params>"
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown parameter '{loc}'{did_you_mean(loc, allowed)}; allowed: {', '.join(allowed) or 'none'}")
        else:
            lines.append(f"parameter '{loc}': {e['msg']} (got {e.get('input')!r})")
    return f"{where} ({plugin}): " + "; ".join(lines)


class PluginSpec(BaseModel):
    """One stage of a recipe: a plugin name and its (validated, defaults-filled) parameters."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    params: dict[str, Any] = {}

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.params}

    @classmethod
    def parse(cls, raw: Any, where: str) -> "PluginSpec":
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
                    raise RecipeError(f"{where}: params must be a mapping of parameter name → value, got "
                                      f"{type(raw['params']).__name__} {raw['params']!r}")
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
    extra = dict(override.get("params", {})) if "params" in override else {k: v for k, v in override.items() if k != "name"}
    return {"name": base_spec.name, **base_spec.params, **extra}


def _validate_spec(spec: PluginSpec, kind: str, where: str) -> tuple[PluginSpec, PluginInfo]:
    info = _get_catalog().lookup(kind, spec.name, where)
    allowed = list(info.params.model_fields)
    try:
        model = info.params.model_validate(spec.params)
    except ValidationError as err:
        raise RecipeError(format_param_errors(err, where, spec.name, allowed)) from None
    return PluginSpec(name=spec.name, params=model.model_dump()), info


class Recipe(BaseModel):
    """A validated recipe. Build from a dict, ``Recipe.preset(name)``, ``Recipe.from_yaml/json/file`` or
    ``Recipe.load(anything)``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: the preset this recipe came from, if any (recorded for provenance)
    name: Optional[str] = None
    advantage: Optional[PluginSpec] = None
    gates: tuple[PluginSpec, ...]
    reduction: PluginSpec

    _compiled: Any = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _resolve(cls, data: Any) -> Any:
        if isinstance(data, Recipe):
            return data.model_dump()
        if not isinstance(data, Mapping):
            raise RecipeError(f"recipe: expected a mapping with {', '.join(STAGES)}, got {type(data).__name__}")
        data = dict(data)
        if "preset" in data:  # a preset with overrides: {preset: dapo, reduction: token}
            preset = data.pop("preset")
            if not isinstance(preset, str):
                raise RecipeError(f"recipe.preset: must be a preset name (a string), got {type(preset).__name__} "
                                  f"{preset!r}")
            base = dict(_get_catalog().preset(preset))
            data = {**base, **{k: _merge_stage(base.get(k), v) for k, v in data.items()}}
        allowed = ("name",) + STAGES
        for key in data:
            if key not in allowed:
                raise RecipeError(f"recipe: unknown key '{key}'{did_you_mean(key, allowed)}; keys are: "
                                  f"{', '.join(allowed)}, preset")
        if data.get("name") is not None and not isinstance(data["name"], str):
            raise RecipeError(f"recipe.name: must be a string, got {type(data['name']).__name__} {data['name']!r}")
        out: dict[str, Any] = {"name": data.get("name")}
        if data.get("advantage") is not None:
            out["advantage"], _ = _validate_spec(PluginSpec.parse(data["advantage"], "recipe.advantage"),
                                                 "advantage", "recipe.advantage")
        gates = data.get("gates")
        if isinstance(gates, (str, Mapping)):
            gates = [gates]
        if gates is not None and not isinstance(gates, (list, tuple)):
            raise RecipeError(f"recipe.gates: must be a list of gates (or one gate), got {type(gates).__name__} "
                              f"{gates!r}")
        if not gates:
            raise RecipeError("recipe.gates: needs at least one gate (the update gate, e.g. ppo_clip)")
        resolved = []
        for i, raw in enumerate(gates):
            where = f"recipe.gates[{i}]"
            spec, info = _validate_spec(PluginSpec.parse(raw, where), "gate", where)
            want = "update" if i == 0 else "correction"
            if info.role != want:
                rule = ("the first gate must be an update gate" if i == 0
                        else "gates after the first must be detached corrections")
                raise RecipeError(f"{where} ({spec.name}): {rule}, but '{spec.name}' is a {info.role} gate")
            resolved.append(spec)
        out["gates"] = tuple(resolved)
        if data.get("reduction") is None:
            raise RecipeError("recipe.reduction: required (e.g. token, response, fixed, sequence_sum)")
        out["reduction"], _ = _validate_spec(PluginSpec.parse(data["reduction"], "recipe.reduction"),
                                             "reduction", "recipe.reduction")
        return out

    # ---- construction -------------------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "Recipe":
        """A named preset (``grpo``, ``dr_grpo``, ``dapo`` …), optionally with stages overridden."""
        return cls.model_validate({"preset": name, **overrides})

    @classmethod
    def from_yaml(cls, text: str) -> "Recipe":
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise RecipeError(f"recipe: not valid YAML: {err}") from None
        return cls.model_validate(data)

    @classmethod
    def from_json(cls, text: str) -> "Recipe":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise RecipeError(f"recipe: not valid JSON: {err}") from None
        return cls.model_validate(data)

    @classmethod
    def from_file(cls, path: Union[str, Path]) -> "Recipe":
        path = Path(path)
        if not path.is_file():
            raise RecipeError(f"recipe: no such file: {path}")
        text = path.read_text()
        try:
            return cls.from_json(text) if path.suffix == ".json" else cls.from_yaml(text)
        except RecipeError as err:
            raise RecipeError(f"{path}: {err}") from None

    @classmethod
    def load(cls, source: Union["Recipe", Mapping[str, Any], str, Path]) -> "Recipe":
        """Anything that names a recipe: a Recipe, a mapping, a preset name, a YAML/JSON path or YAML text."""
        if isinstance(source, Recipe):
            return source
        if isinstance(source, Mapping):
            return cls.model_validate(source)
        if isinstance(source, Path) or (isinstance(source, str) and source.endswith((".yaml", ".yml", ".json"))):
            return cls.from_file(source)
        if isinstance(source, str) and "\n" not in source and ":" not in source:
            return cls.preset(source)
        if isinstance(source, str):
            return cls.from_yaml(source)
        raise RecipeError(f"recipe: cannot load a recipe from {type(source).__name__}")

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
        if self.advantage is not None:
            out["advantage"] = self.advantage.to_dict()
        out["gates"] = [g.to_dict() for g in self.gates]
        out["reduction"] = self.reduction.to_dict()
        return out

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)
