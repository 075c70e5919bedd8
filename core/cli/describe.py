"""Plugins and recipes described as plain data: what ``lossplug show``, ``lossplug list`` and ``lossplug recipe
explain`` print (and emit with ``--json``), and what a generated plugin catalogue reads.

Nothing here prints: :mod:`lossplug.cli` renders these dictionaries.
"""

from __future__ import annotations

import inspect
import re
from typing import TYPE_CHECKING, Any, cast

from lossplug.contracts import Recipe
from lossplug.kinds import KINDS
from lossplug.needs import FIELD_SHAPES, batch_fields, recipe_needs, required_fields

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

    from lossplug.kinds import AnyPlugin
    from lossplug.pipeline import RegularizerStage, Stage
    from lossplug.plugin_registry import Registry

#: pydantic's constraint attributes and how a person reads them
_CONSTRAINTS = {
    "gt": ">",
    "ge": "≥",
    "lt": "<",
    "le": "≤",
    "multiple_of": "multiple of",
    "min_length": "min length",
    "max_length": "max length",
}


def distribution(origin: str) -> str:
    """'lossplug-example-plugin 0.1.0' from an entry-point origin; the origin itself otherwise."""
    m = re.search(r"of distribution '([^']+)'", origin)
    return m.group(1) if m else origin


def constraints(field: FieldInfo) -> str:
    """A parameter's bounds as text, e.g. ``'> 0, ≤ 80'``."""
    parts = []
    for meta in field.metadata:
        for attr, sym in _CONSTRAINTS.items():
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sym} {value}")
    return ", ".join(parts)


def type_name(annotation: Any) -> str:
    """``float``, ``Optional[float]``, ``Literal['product', 'geometric']``…"""
    text = getattr(annotation, "__name__", None) if not getattr(annotation, "__args__", None) else None
    return text or str(annotation).replace("typing.", "").replace("NoneType", "None")


def parameters(plugin: AnyPlugin) -> list[dict[str, Any]]:
    """One row per parameter of the plugin: name, type, default (``None`` with ``required``), constraint,
    description."""
    return [
        {
            "name": name,
            "type": type_name(f.annotation),
            "required": f.is_required(),
            "default": None if f.is_required() else f.get_default(call_default_factory=True),
            "constraint": constraints(f),
            "description": f.description or "",
        }
        for name, f in plugin.params.model_fields.items()
    ]


def plugin_info(kind: str, name: str, plugin: AnyPlugin, source: str) -> dict[str, Any]:
    """Everything known about one registered plugin: its docs (function and module), role, the batch fields it
    needs, its layouts and group size, and its parameter schema."""
    module_doc = inspect.getdoc(inspect.getmodule(plugin.fn)) or ""
    return {
        "kind": kind,
        "name": name,
        "source": source,
        "distribution": distribution(source),
        "role": getattr(plugin, "role", None),
        "level": getattr(plugin, "level", None),
        "requires": list(required_fields(plugin)),
        "requires_depends_on_params": callable(getattr(plugin, "requires", None)),
        "needs": list(batch_fields(plugin)),
        "layouts": list(getattr(plugin, "layouts", ())) or None,
        "min_group_size": getattr(plugin, "min_group_size", None),
        "doc": plugin.doc,
        "module_doc": module_doc if module_doc.strip() != plugin.doc.strip() else "",
        "params_schema": plugin.params.model_json_schema(),
    }


def recipe_fields(recipe: Recipe) -> list[dict[str, str]]:
    """What a PolicyBatch must contain for this recipe: field, shape and which stage needs it."""
    return [
        {"field": f, "shape": FIELD_SHAPES.get(f, ""), "needed_by": "; ".join(stages)}
        for f, stages in recipe_needs(recipe).items()
    ]


def explain_recipe(recipe: Recipe) -> dict[str, Any]:
    """A recipe resolved: its stages (plugin, parameters, role, source, summary), the batch fields it needs and the
    normaliser it expects."""
    from lossplug.pipeline import compile_recipe
    from lossplug.plugin_registry import doc_summary, registry

    reg = registry()
    compiled = compile_recipe(recipe)
    stages: list[tuple[str, Stage[AnyPlugin]]] = []
    stages += [(f"shapers[{i}]", s) for i, s in enumerate(compiled.shapers)]
    stages += [(f"filters[{i}]", s) for i, s in enumerate(compiled.filters)]
    if compiled.advantage is not None:
        stages.append(("advantage", compiled.advantage))
    stages += [(f"gates[{i}]", s) for i, s in enumerate(compiled.gates)]
    stages.append(("reduction", compiled.reduction))
    stages += [(f"regularizers[{i}]", s) for i, s in enumerate(compiled.regularizers)]
    stage_rows = []
    for where, stage in stages:
        p = stage.plugin
        role = f"{p.role} · {p.level}" if p.kind == "gate" else ""  # (only gates have a role)
        if p.kind == "advantage":
            role = "layouts: " + ", ".join(p.layouts)
        if p.kind == "shaper":
            role = "rewrites the reward" + (", state across steps" if getattr(stage, "controller", None) else "")
        if p.kind == "filter":
            role = "narrows the action mask"
        if p.kind == "regularizer":
            reg_stage = cast("RegularizerStage", stage)
            role = f"+ coef · {reg_stage.reduction.plugin.name}(term)" + (
                ", adaptive coefficient" if reg_stage.controller is not None else ""
            )
        stage_rows.append(
            {
                "stage": where,
                "plugin": p.name,
                "params": stage.params.model_dump(),
                "role": role,
                "source": distribution(reg.origin(p.kind, p.name)),
                "summary": doc_summary(p.doc),
            }
        )
        # a stage made of other plugins (the advantage ``mix``) names each of them on a row of its own, under it
        for label, sub, sub_params, sub_role in getattr(stage.params, "sub_stages", list)():
            stage_rows.append(
                {
                    "stage": f"{where}.{label}",
                    "plugin": sub.name,
                    "params": sub_params.model_dump(),
                    "role": sub_role,
                    "source": distribution(reg.origin(sub.kind, sub.name)),
                    "summary": doc_summary(sub.doc),
                }
            )
    red = compiled.reduction
    normalizer = "Normalizer(action_tokens=…, sequences=…) over the whole optimizer step (all micro-batches, ranks)"
    if red.plugin.name == "fixed" and getattr(red.params, "budget", "absent") is None:
        normalizer += "; budget=… (e.g. max_completion_length) — the recipe sets none"
    preset_source = reg.presets[recipe.name].source if recipe.name in reg.presets else ""
    packed = compiled.advantage is not None and "packed" in compiled.advantage.plugin.layouts
    return {
        "name": recipe.name,
        "source": preset_source,
        "recipe": recipe.to_dict(),
        "yaml": recipe.to_yaml(),
        "stages": stage_rows,
        "needs": recipe_fields(recipe),
        "normalizer": normalizer,
        "packed_advantage": packed,
    }


# ---------------------------------------------------------------------------------------------------------------------
# The plugin catalogue: every registered plugin as a Markdown section, generated from the registry (the docs site
# builds its catalogue page with :func:`catalogue_markdown` on every build, so the page cannot drift from the code).

#: A citation is a paragraph of a plugin's docstring — or, when that has none, of its module's docstring — that starts
#: with one of these labels: ``Paper:`` for the publication a plugin implements, ``Reference:`` for the trainer
#: function or convention it reproduces (reductions, engine corrections). The paragraph ends at the next blank line.
CITATION_LABELS = ("Paper:", "Reference:")

#: a section title per kind, in recipe order ("Shapers", "Filters", "Advantages", …)
_KIND_TITLES = {kind: f"{kind.capitalize()}s" for kind in KINDS}
_ROLES = re.compile(r":(?:class|func|meth|mod|data|attr|obj):`~?([^`]+)`")


def _paragraphs(text: str) -> list[str]:
    return [p.strip("\n").rstrip() for p in re.split(r"\n[ \t]*\n", text or "") if p.strip()]


def _is_citation(paragraph: str) -> bool:
    return paragraph.lstrip().startswith(CITATION_LABELS)


def citations(plugin: AnyPlugin) -> list[str]:
    """The plugin's citations (see :data:`CITATION_LABELS`): the labelled paragraphs of its own docstring, else of
    its module's docstring; each joined into one line, label included. Empty when it cites nothing."""
    found = [p for p in _paragraphs(plugin.doc) if _is_citation(p)]
    if not found:
        found = [p for p in _paragraphs(inspect.getdoc(inspect.getmodule(plugin.fn)) or "") if _is_citation(p)]
    return [" ".join(line.strip() for line in p.strip().splitlines()) for p in found]


def formula(plugin: AnyPlugin) -> str:
    """The plugin's docstring without its citations: by convention its first line states the formula."""
    return "\n\n".join(p for p in _paragraphs(plugin.doc) if not _is_citation(p))


def catalogue_problems(reg: Registry | None = None, *, builtin_only: bool = True) -> list[str]:
    """What keeps the catalogue from being complete: a plugin without a formula (docstring), a parameter without a
    description, a plugin without a citation. Empty when every (built-in) plugin is fully documented."""
    from lossplug.plugin_registry import BUILTIN_SOURCE, registry

    reg = reg or registry()
    problems = []
    for kind, plugins in reg.plugins.items():
        for name, plugin in plugins.items():
            if builtin_only and reg.origin(kind, name) != BUILTIN_SOURCE:
                continue
            if not formula(plugin):
                problems.append(f"{kind} '{name}': no docstring stating its formula")
            problems += [
                f"{kind} '{name}': parameter '{row['name']}' has no description"
                for row in parameters(plugin)
                if not row["description"].strip()
            ]
            if not citations(plugin):
                problems.append(
                    f"{kind} '{name}': no citation (a 'Paper: …' or 'Reference: …' paragraph in its "
                    "docstring or its module's)"
                )
    return problems


def _md(text: str) -> str:
    """reStructuredText-flavoured docstring → Markdown: roles become code spans, ``::`` introduces the indented
    (code) block that follows it, and a doctest paragraph (``>>>``) becomes a fenced ``pycon`` block — Markdown would
    read its ``x["a"]["b"]`` as reference links."""
    text = _ROLES.sub(lambda m: f"``{m.group(1)}``", text)
    text = re.sub(r"::(\n\s*\n)", r":\1", text)
    return "\n\n".join(
        f"```pycon\n{p}\n```" if p.lstrip().startswith(">>>") else p for p in re.split(r"\n[ \t]*\n", text)
    )


def _cite(text: str) -> str:
    """Citation text → Markdown: arXiv ids and URLs become links."""
    text = re.sub(r"(?<![\w/<])(https?://[^\s)>,;]+[^\s)>,;.])", r"<\1>", text)
    return re.sub(r"arXiv:(\d{4}\.\d{4,5})", r"[arXiv:\1](https://arxiv.org/abs/\1)", text)


def _cell(value: Any) -> str:
    text = "—" if value is None or value == "" else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _plugin_markdown(kind: str, name: str, plugin: AnyPlugin, source: str, details_of: dict[str, str]) -> list[str]:
    info = plugin_info(kind, name, plugin, source)
    what = " · ".join(str(x) for x in (kind, info["role"], info["level"]) if x)
    module = getattr(plugin.fn, "__module__", "")
    out = [f"### `{name}`", "", f"*{what}* — `{module}`", ""]
    lines = formula(plugin).splitlines() or ["—"]
    out += [f"**Formula** — {_md(lines[0])}", ""]
    if len(lines) > 1:
        out += [_md("\n".join(lines[1:])), ""]
    rows = parameters(plugin)
    if rows:
        out += ["| parameter | type | default | constraint | description |", "|---|---|---|---|---|"]
        out += [
            f"| `{r['name']}` | `{_cell(r['type'])}` | "
            f"{'required' if r['required'] else '`' + _cell(repr(r['default'])) + '`'} | {_cell(r['constraint'])} | "
            f"{_cell(_md(r['description']))} |"
            for r in rows
        ]
    else:
        out.append("No parameters.")
    out.append("")
    needs = (
        ", ".join(f"`{f}`" for f in info["needs"])
        or "none: it reads the gates' objective, the action mask and "
        "the step's population (a Normalizer), not batch fields"
    )
    extra = " (depends on the parameters; shown for the defaults)" if info["requires_depends_on_params"] else ""
    out += [f"**Batch fields** — {needs}{extra}"]
    if info["layouts"]:
        out[-1] += f"; layouts: {', '.join(info['layouts'])}"
    if info["min_group_size"]:
        out[-1] += f"; at least {info['min_group_size']} rollouts per group"
    out.append("")
    for citation in citations(plugin):
        label, _, rest = citation.partition(":")
        out += [f"**{label}** — {_cite(_md(rest.strip()))}", ""]
    module_doc = info["module_doc"]
    if module_doc and module in details_of:
        out += [f"Details: see [`{details_of[module]}`](#{details_of[module]}).", ""]
    elif module_doc:
        details_of[module] = name
        body = "\n\n".join(p for p in _paragraphs(module_doc) if not _is_citation(p))
        out += ["**Details**", "", _md(body), ""]
    return out


def catalogue_markdown(
    reg: Registry | None = None, *, builtin_only: bool = True, title: str = "Plugin catalogue"
) -> str:
    """The plugin catalogue as one Markdown page: for every (built-in) advantage, gate, reduction and regularizer its
    kind, role and level, formula, parameter table (type, default, constraint, description), the batch fields it
    needs, its citations and its module's documentation; then the presets with their sources."""
    from lossplug.plugin_registry import BUILTIN_SOURCE, registry

    reg = reg or registry()
    out = [
        f"# {title}",
        "",
        "Generated from the plugin registry when the documentation is built (`lossplug.cli.describe."
        "catalogue_markdown`): every built-in plugin as `lossplug show NAME` describes it. Gates return per-token "
        "**objectives** (to maximise); the loss is `−reduce(objective)`; a regularizer's per-token term is added "
        "to it as `coef · reduce(term)`.",
        "",
    ]
    details_of: dict[str, str] = {}
    for kind in KINDS:
        plugins = {
            n: p
            for n, p in reg.plugins.get(kind, {}).items()
            if not builtin_only or reg.origin(kind, n) == BUILTIN_SOURCE
        }
        if not plugins:
            continue
        out += [f"## {_KIND_TITLES[kind]}", "", " · ".join(f"[`{n}`](#{n})" for n in plugins), ""]
        for name, plugin in plugins.items():
            out += _plugin_markdown(kind, name, plugin, reg.origin(kind, name), details_of)
    presets = {n: p for n, p in reg.presets.items() if not builtin_only or p.origin == BUILTIN_SOURCE}
    if presets:
        out += [
            "## Presets",
            "",
            "Named recipes: `Recipe.preset(NAME)`, `recipe=NAME` in the adapters, `lossplug recipe explain NAME`.",
            "",
            "| preset | advantage | gates | reduction | source |",
            "|---|---|---|---|---|",
        ]
        for name, preset in presets.items():
            recipe = Recipe.load(preset.recipe).to_dict()
            stage = lambda s: (
                "—"
                if not s
                else (f"`{s['name']}` " + ", ".join(f"{k}={v}" for k, v in s.items() if k != "name")).strip()
            )
            out.append(
                f"| `{name}` | {_cell(stage(recipe.get('advantage')))} | "
                f"{_cell('; '.join(stage(g) for g in recipe.get('gates') or []))} | "
                f"{_cell(stage(recipe.get('reduction')))} | {_cite(_cell(preset.source))} |"
            )
        out.append("")
    return "\n".join(out)
