"""Plugins and recipes described as plain data: what ``lossplug show``, ``lossplug list`` and ``lossplug recipe
explain`` print (and emit with ``--json``), and what a generated plugin catalogue reads.

Nothing here prints: :mod:`lossplug.cli` renders these dictionaries.
"""

from __future__ import annotations

import inspect
import re
import sys
from typing import Any

from lossplug.contracts import Recipe

from .needs import FIELD_SHAPES, batch_fields, recipe_needs, required_fields

#: pydantic's constraint attributes and how a person reads them
_CONSTRAINTS = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤", "multiple_of": "multiple of", "min_length": "min length",
                "max_length": "max length"}


def distribution(origin: str) -> str:
    """'lossplug-example-plugin 0.1.0' from an entry-point origin; the origin itself otherwise."""
    m = re.search(r"of distribution '([^']+)'", origin)
    return m.group(1) if m else origin


def constraints(field) -> str:
    """A parameter's bounds as text, e.g. ``'> 0, ≤ 80'``."""
    parts = []
    for meta in field.metadata:
        for attr, sym in _CONSTRAINTS.items():
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sym} {value}")
    return ", ".join(parts)


def type_name(annotation) -> str:
    """``float``, ``Optional[float]``, ``Literal['product', 'geometric']``…"""
    text = getattr(annotation, "__name__", None) if not getattr(annotation, "__args__", None) else None
    return text or str(annotation).replace("typing.", "").replace("NoneType", "None")


def parameters(plugin) -> list[dict[str, Any]]:
    """One row per parameter of the plugin: name, type, default (``None`` with ``required``), constraint,
    description."""
    return [{"name": name, "type": type_name(f.annotation), "required": f.is_required(),
             "default": None if f.is_required() else f.default, "constraint": constraints(f),
             "description": f.description or ""}
            for name, f in plugin.params.model_fields.items()]


def plugin_info(kind: str, name: str, plugin, source: str) -> dict[str, Any]:
    """Everything known about one registered plugin: its docs (function and module), role, the batch fields it
    needs, its layouts and group size, and its parameter schema."""
    module_doc = inspect.getdoc(sys.modules.get(getattr(plugin.fn, "__module__", ""), None)) or ""
    return {
        "kind": kind, "name": name, "source": source, "distribution": distribution(source),
        "role": getattr(plugin, "role", None), "level": getattr(plugin, "level", None),
        "requires": list(required_fields(plugin)),
        "requires_depends_on_params": callable(getattr(plugin, "requires", None)),
        "needs": list(batch_fields(plugin)),
        "layouts": list(getattr(plugin, "layouts", ())) or None,
        "min_group_size": getattr(plugin, "min_group_size", None),
        "doc": plugin.doc, "module_doc": module_doc if module_doc.strip() != plugin.doc.strip() else "",
        "params_schema": plugin.params.model_json_schema(),
    }


def recipe_fields(recipe: Recipe) -> list[dict[str, str]]:
    """What a PolicyBatch must contain for this recipe: field, shape and which stage needs it."""
    return [{"field": f, "shape": FIELD_SHAPES.get(f, ""), "needed_by": "; ".join(stages)}
            for f, stages in recipe_needs(recipe).items()]


def explain_recipe(recipe: Recipe) -> dict[str, Any]:
    """A recipe resolved: its stages (plugin, parameters, role, source, summary), the batch fields it needs and the
    normaliser it expects."""
    from .pipeline import compile_recipe
    from .plugin_registry import registry

    reg = registry()
    compiled = compile_recipe(recipe)
    stages = []
    if compiled.advantage is not None:
        stages.append(("advantage", compiled.advantage))
    stages += [(f"gates[{i}]", s) for i, s in enumerate(compiled.gates)]
    stages.append(("reduction", compiled.reduction))
    stage_rows = []
    for where, stage in stages:
        p = stage.plugin
        role = f"{p.role} · {p.level}" if getattr(p, "role", None) else ""
        if p.kind == "advantage":
            role = "layouts: " + ", ".join(p.layouts)
        stage_rows.append({"stage": where, "plugin": p.name, "params": stage.params.model_dump(), "role": role,
                           "source": distribution(reg.origin(p.kind, p.name)),
                           "summary": p.doc.splitlines()[0] if p.doc else ""})
    red = compiled.reduction
    normalizer = "Normalizer(action_tokens=…, sequences=…) over the whole optimizer step (all micro-batches, ranks)"
    if red.plugin.name == "fixed" and getattr(red.params, "budget", "absent") is None:
        normalizer += "; budget=… (e.g. max_completion_length) — the recipe sets none"
    preset_source = reg.presets[recipe.name].source if recipe.name in reg.presets else ""
    packed = compiled.advantage is not None and "packed" in compiled.advantage.plugin.layouts
    return {"name": recipe.name, "source": preset_source, "recipe": recipe.to_dict(), "yaml": recipe.to_yaml(),
            "stages": stage_rows, "needs": recipe_fields(recipe), "normalizer": normalizer,
            "packed_advantage": packed}
