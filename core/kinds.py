"""The plugin kinds: one table, read by the registry, the conformance kit, the CLI and the docs.

Each :class:`Kind` binds a kind's name to its plugin class, the hook that registers plugins of that kind and the
recipe key its stages sit under. The names and the recipe keys come from
:data:`lossplug.contracts.recipe.PLUGIN_KINDS` — ``contracts`` may not import core, yet recipes must know their keys,
so the table of names lives there — and this module derives the rest: the plugin class is the one whose ``kind``
is the name, the hook is ``lossplug_register_<name>s``. Both are checked when this module is imported, so a
kind added to one side and not the other fails at once instead of silently disappearing from a listing.
"""

from __future__ import annotations

from dataclasses import dataclass

from lossplug.contracts.recipe import PLUGIN_KINDS

from . import hookspecs
from .plugin import AdvantagePlugin, GatePlugin, ReductionPlugin, RegularizerPlugin
from .rollout_plugin import FilterPlugin, ShaperPlugin

PluginClass = (
    type[ShaperPlugin]
    | type[FilterPlugin]
    | type[AdvantagePlugin]
    | type[GatePlugin]
    | type[ReductionPlugin]
    | type[RegularizerPlugin]
)

#: a plugin of any kind
AnyPlugin = ShaperPlugin | FilterPlugin | AdvantagePlugin | GatePlugin | ReductionPlugin | RegularizerPlugin

_PLUGIN_CLASSES: tuple[PluginClass, ...] = (
    ShaperPlugin,
    FilterPlugin,
    AdvantagePlugin,
    GatePlugin,
    ReductionPlugin,
    RegularizerPlugin,
)


@dataclass(frozen=True)
class Kind:
    """A plugin kind: ``name`` (``"gate"``), ``plugin_class`` (what ``@lossplug.gate`` makes), ``hook`` (the
    ``lossplug_register_*`` hook that registers it) and ``recipe_key`` (where a recipe names its stages: ``gates``)."""

    name: str
    plugin_class: PluginClass
    hook: str
    recipe_key: str


def _bind() -> dict[str, Kind]:
    by_name: dict[str, PluginClass] = {cls.kind: cls for cls in _PLUGIN_CLASSES}
    if set(by_name) != set(PLUGIN_KINDS):
        raise AssertionError(f"plugin classes {sorted(by_name)} do not match the recipe's kinds {sorted(PLUGIN_KINDS)}")
    table = {}
    for name, recipe_key in PLUGIN_KINDS.items():
        hook = f"lossplug_register_{name}s"
        if not callable(getattr(hookspecs, hook, None)):
            raise AssertionError(f"kind '{name}' has no registration hook {hook} in lossplug.hookspecs")
        table[name] = Kind(name, by_name[name], hook, recipe_key)
    return table


#: hooks under an earlier spelling → the kind they register (still called, after the kind's own hook)
RENAMED_HOOKS: dict[str, str] = {"lossplug_register_regularisers": "regularizer"}

#: kind name → :class:`Kind`, in recipe order (shaper, filter, advantage, gate, reduction, regularizer); iterating
#: gives the names
KINDS: dict[str, Kind] = _bind()
