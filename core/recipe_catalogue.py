"""The catalogue recipes are checked against: lossplug's plugin registry.

``lossplug.contracts`` holds a recipe's structure and the :class:`~lossplug.contracts.recipe.Catalogue` protocol; the
checks that need the plugins live here — does the named plugin exist, do its parameters pass its pydantic model, is
a gate in the role its position asks for, does a regularizer's own reduction exist, what does a preset say.
:data:`CATALOGUE` is the default catalogue of ``lossplug.contracts``: contracts asks
``lossplug.default_recipe_catalogue()`` for it the first time a recipe is checked, so this module and the registry are
loaded then, not at import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from lossplug.contracts import RecipeError
from lossplug.contracts.errors import did_you_mean
from lossplug.contracts.recipe import PluginSpec

from . import plugin_registry

_ROLE_RULES = {
    "update": "the first gate must be an update gate",
    "correction": "gates after the first must be detached corrections",
}


def format_param_errors(err: ValidationError, where: str, plugin: str, allowed: list[str]) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<params>"
        if e["type"] == "extra_forbidden":
            lines.append(
                f"unknown parameter '{loc}'{did_you_mean(loc, allowed)}; allowed: {', '.join(allowed) or 'none'}"
            )
        else:
            # a validator's own ValueError reads as its message, without pydantic's "Value error, " prefix
            error = e.get("ctx", {}).get("error") if e["type"] == "value_error" else None
            message = str(error) if isinstance(error, ValueError) else e["msg"]
            lines.append(f"parameter '{loc}': {message} (got {e.get('input')!r})")
    return f"{where} ({plugin}): " + "; ".join(lines)


class RegistryCatalogue:
    """The :class:`~lossplug.contracts.recipe.Catalogue` of the plugin registry, rebuilt registries included."""

    def check_stage(self, kind: str, spec: PluginSpec, where: str, role: str | None = None) -> PluginSpec:
        plugin = plugin_registry.registry().lookup(kind, spec.name, where)
        allowed = list(plugin.params.model_fields)
        try:
            params = plugin.params.model_validate(spec.params)
        except ValidationError as err:
            raise RecipeError(format_param_errors(err, where, spec.name, allowed)) from None
        if role is not None and plugin.role != role:
            raise RecipeError(f"{where} ({spec.name}): {_ROLE_RULES[role]}, but '{spec.name}' is a {plugin.role} gate")
        # the record names every parameter, defaults included, so a run can be reproduced from it alone
        dumped = params.model_dump()
        if kind == "regularizer" and dumped.get("reduction") is not None:
            # a regularizer's own reduction is checked like the recipe's, and recorded with its defaults filled in
            own = f"{where}.reduction"
            reduction = self.check_stage("reduction", PluginSpec.parse(dumped["reduction"], own), own)
            dumped["reduction"] = reduction.to_dict()
        return PluginSpec(name=spec.name, params=dumped)

    def preset(self, name: str) -> Mapping[str, Any]:
        return plugin_registry.registry().preset(name)


CATALOGUE = RegistryCatalogue()
