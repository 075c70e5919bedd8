"""What a trainer cannot feed a recipe, and what to do instead: the one wording both adapters' refusals and the docs
use.

Each adapter keeps a table of the batch fields its trainer does not hand lossplug at one seam (TRL's loss and
advantage stages: :mod:`lossplug.adapters.trl.refusals`; verl's policy loss and advantage estimator:
:mod:`lossplug.adapters.verl.unfed`), each row an :class:`Unfed`: why the trainer cannot feed the field, and the next
step — the setting that makes it, the trainer that does, or the issue where the feed is planned. A refusal names the
stage, the plugin, the field and that row (:func:`unfed_line`); the docs' tables are generated from the same rows,
with the built-in plugins that read each field (:func:`readers`). Imports neither TRL nor verl.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from lossplug.contracts import Recipe

__all__ = ["BUILT_IN", "Unfed", "Variant", "readers", "unfed_line", "variants"]

#: the origin the registry gives lossplug's own plugins
BUILT_IN = "lossplug (built-in)"


@dataclass(frozen=True)
class Unfed:
    """A field a trainer does not feed at one seam: ``why`` (a clause, no final stop) and ``next_step`` (what the
    user can do: a setting, an argument, another trainer, or the issue it waits on)."""

    why: str
    next_step: str


def unfed_line(where: str, plugin: str, name: str, unfed: Unfed) -> str:
    """One refusal line: ``recipe.advantage (opd) reads teacher_logp: <why>. Next step: <next step>``."""
    return f"{where} ({plugin}) reads {name}: {unfed.why}. Next step: {unfed.next_step}"


@dataclass(frozen=True)
class Variant:
    """A built-in plugin with its default parameters, or with one setting changed that changes the fields it reads."""

    kind: str
    name: str
    #: a gate's role (update or correction)
    role: str | None = None
    #: the setting changed from the defaults (empty: the defaults)
    setting: dict[str, Any] = field(default_factory=dict)
    #: the optional batch fields it reads so
    fields: tuple[str, ...] = ()
    #: a number that was null by default: shown as "set" (any value reads the same fields)
    any_number: bool = False

    @property
    def label(self) -> str:
        """``decoupled_ppo`` or ``decoupled_ppo (prox_logp: loglinear)``."""
        extra = ", ".join(f"{k}: {'set' if self.any_number else _shown(v)}" for k, v in self.setting.items())
        return f"{self.name} ({extra})" if extra else self.name

    def recipe(self) -> Recipe:
        """The smallest recipe that runs this variant in its stage (with grpo, ppo_clip and the token reduction
        around it)."""
        spec = {"name": self.name, **self.setting}
        recipe: dict[str, Any] = {"advantage": "grpo", "gates": ["ppo_clip"], "reduction": "token"}
        if self.kind == "advantage":
            recipe["advantage"] = spec
        elif self.kind == "gate":
            recipe["gates"] = [spec] if self.role == "update" else ["ppo_clip", spec]
        elif self.kind == "regularizer":
            recipe["regularizers"] = [spec]
        elif self.kind in ("shaper", "filter"):
            recipe[f"{self.kind}s"] = [spec]
        else:
            recipe["reduction"] = spec
        return Recipe.load(recipe)


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _alternatives(annotation: Any) -> tuple[Any, ...]:
    """The values a parameter can take when it has few: a Literal's, a bool's (an Optional's the same)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return typing.get_args(annotation)
    if annotation is bool:
        return (True, False)
    if origin in (typing.Union, types.UnionType):
        return tuple(v for arg in typing.get_args(annotation) if arg is not type(None) for v in _alternatives(arg))
    return ()


def variants() -> Iterator[Variant]:
    """Every built-in plugin with its defaults, then each single Literal or bool setting that makes it read other
    fields (``decoupled_ppo`` with ``prox_logp: loglinear`` reads the policy versions)."""
    import lossplug
    from lossplug.needs import required_fields

    registry = lossplug.registry()
    for kind, plugins in registry.plugins.items():
        for name, plugin in sorted(plugins.items()):
            if registry.origin(kind, name) != BUILT_IN:
                continue
            defaults = plugin.params()
            base = required_fields(plugin, defaults)
            role = getattr(plugin, "role", None)
            yield Variant(kind, name, role, {}, base)
            seen = {base}
            for key, info in type(defaults).model_fields.items():
                # a number that is off (null) by default: switched on by any value the model accepts
                number = getattr(defaults, key) is None and _alternatives(info.annotation) == ()
                for value in (1.0, 2.0) if number else _alternatives(info.annotation):
                    if value == getattr(defaults, key):
                        continue
                    try:
                        params = type(defaults).model_validate({**defaults.model_dump(), key: value})
                    except ValueError:  # a setting that needs another one with it, or out of range
                        continue
                    fields = required_fields(plugin, params)
                    if fields not in seen:
                        seen.add(fields)
                        yield Variant(kind, name, role, {key: value}, fields, any_number=number)
                    if number:
                        break


def readers(name: str, kinds: tuple[str, ...] = ("advantage", "gate", "regularizer", "reduction")) -> list[str]:
    """The built-in plugins of ``kinds`` that read batch field ``name`` (a variant's setting in brackets)."""
    return list(dict.fromkeys(v.label for v in variants() if v.kind in kinds and name in v.fields))
