"""The ``lossplug`` command line (typer + rich).

Every command imports what it needs when it runs (torch, the registry, safetensors, matplotlib), so ``--help`` is
instant. Text that comes from plugins (docstrings, summaries) is printed without rich markup: ``[B, T]`` stays
``[B, T]``. Exit codes: 0 — fine; 1 — a check failed (contract violations, a failing conformance check, an unknown
name); 2 — the input could not be read or understood (a file that is not a batch dump, a bad recipe, bad usage).
"""

from __future__ import annotations

import json
import re
import sys
from enum import Enum
from pathlib import Path
from typing import Any, List, Optional

import typer

from lossplug.contracts.errors import LossplugError

app = typer.Typer(
    help="lossplug — a pluggable, validated loss layer for LLM RL inside TRL and verl.\n\n"
         "Plugins (advantages, gates, reductions) are selected by name in a recipe; batches are checked against "
         "one schema.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
recipe_app = typer.Typer(help="Resolve recipes and say what a batch must contain for them.", no_args_is_help=True)
plot_app = typer.Typer(help="Plot the plugins' behaviour (PNG; needs matplotlib).", no_args_is_help=True)
app.add_typer(recipe_app, name="recipe")
app.add_typer(plot_app, name="plot")

KIND_ORDER = ("advantage", "gate", "reduction")

#: what each batch field is, for `recipe explain` and `validate`
FIELD_SHAPES = {
    "logp": "[B, T] float — current policy, carries the gradient",
    "action_mask": "[B, T] bool — True on policy actions",
    "old_logp": "[B, T] float — training engine before the update",
    "behavior_logp": "[B, T] float — rollout engine that sampled the tokens",
    "ref_logp": "[B, T] float — frozen reference policy",
    "advantage": "[B] or [B, T] float",
    "reward": "[B] or [B, T] float",
    "value": "[B, T] float — critic V_old",
    "group_id": "[B] int — prompt group",
    "trajectory_id": "[B] int",
    "terminated": "[B] bool — ended in a terminal state",
    "final_value": "[B] float — value of the real final observation (truncated rows)",
    "next_value": "[N] float — V(s_{t+1})",
    "boundary": "[N] bool — the trace resets after this transition",
}


class Kind(str, Enum):
    advantage = "advantage"
    gate = "gate"
    reduction = "reduction"
    preset = "preset"


class ContractChoice(str, Enum):
    auto = "auto"
    policy = "policy"
    packed = "packed"


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def _text(s: str, style: str = ""):
    from rich.text import Text

    return Text(s, style=style)  # plugin-provided text: never parsed as markup


def _fail(message: str, code: int = 2):
    _console(stderr=True).print(_text(f"error: {message}", "bold red"))
    raise typer.Exit(code)


def _distribution(origin: str) -> str:
    """'lossplug-example-plugin 0.1.0' from an entry-point origin; the origin itself otherwise."""
    m = re.search(r"of distribution '([^']+)'", origin)
    return m.group(1) if m else origin


def _parse_assignments(items: Optional[List[str]], what: str) -> dict[str, Any]:
    import yaml

    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            _fail(f"{what} must look like key=value, got {item!r}")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            out[key.strip()] = value
    return out


def _registry():
    import warnings

    from lossplug.plugin_registry import LossplugPluginWarning, registry

    with warnings.catch_warnings():  # broken plugins are shown by the commands themselves, in red
        warnings.simplefilter("ignore", LossplugPluginWarning)
        return registry()


def _required(plugin, params=None) -> list[str]:
    """The batch fields a plugin reads — with ``params``, or with its defaults (``requires`` may depend on them)."""
    if not hasattr(plugin, "required_fields"):
        return list(getattr(plugin, "requires", ()))
    try:
        return list(plugin.required_fields(params if params is not None else plugin.params()))
    except Exception:  # parameters without defaults: only a fixed declaration can be shown
        return [] if callable(plugin.requires) else list(plugin.requires)


def _needs(plugin) -> list[str]:
    kind = plugin.kind
    requires = _required(plugin)
    if kind == "gate":
        return list(dict.fromkeys(["logp", "action_mask", "advantage", *requires]))
    if kind == "advantage":
        base = ["logp", "action_mask"] if "padded" in plugin.layouts else []
        extra = ["group_id"] if plugin.min_group_size > 0 and "group_id" not in requires else []
        return list(dict.fromkeys(base + requires + extra))
    return []


def _params_line(params: dict) -> str:
    return "  ".join(f"{n}={p['default']!r}" if not p["required"] else f"{n}=<required>" for n, p in params.items())


# ---------------------------------------------------------------------------------------------------------------------
# list


@app.command("list")
def list_cmd(
    kind: Optional[Kind] = typer.Option(None, "--kind", "-k", help="Only this kind."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """Every plugin by kind, with parameters, defaults and source distribution; broken plugins in red."""
    import lossplug

    reg = _registry()
    rows = lossplug.list_plugins()
    for row in rows:
        row["distribution"] = _distribution(row["source"])
    broken = [{"origin": b.origin, "error": b.error} for b in reg.broken]
    duplicates = [{"kind": k, "name": n, "sources": list(v)} for (k, n), v in reg.duplicates.items()]
    kinds = [kind.value] if kind else [*KIND_ORDER, "preset"]
    rows = [r for r in rows if r["kind"] in kinds]
    if as_json:
        typer.echo(json.dumps({"plugins": rows, "broken": broken, "duplicates": duplicates}, indent=2, default=str))
        return

    from rich.table import Table

    console = _console()
    for k in kinds:
        mine = [r for r in rows if r["kind"] == k]
        console.print(_text(f"{k}s ({len(mine)})", "bold underline"))
        grid = Table.grid(padding=(0, 2), pad_edge=True)
        grid.add_column(no_wrap=True, style="bold cyan")
        grid.add_column(ratio=1)
        for r in mine:
            detail = _text("")
            facts = []
            if r["role"]:
                facts.append(f"{r['role']} · {r['level']}")
            if r["requires"]:
                facts.append("needs " + ", ".join(r["requires"]))
            if facts:
                detail.append(" · ".join(facts) + "   ", "magenta")
            detail.append(f"from {r['distribution']}", "dim")
            if r["summary"]:
                detail.append("\n" + r["summary"])
            if r["params"]:
                detail.append("\n" + _params_line(r["params"]), "green")
            grid.add_row(_text(r["name"]), detail)
        console.print(grid)
        console.print()
    if broken or duplicates:
        console.print(_text("plugins that cannot be used", "bold red"))
        for b in broken:
            console.print(_text(f"  ✗ {b['origin']}: {b['error']}", "red"))
        for d in duplicates:
            console.print(_text(f"  ✗ {d['kind']} '{d['name']}' is registered more than once: "
                                f"{' and '.join(d['sources'])}", "red"))


# ---------------------------------------------------------------------------------------------------------------------
# show


def _constraints(field) -> str:
    ops = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤", "multiple_of": "multiple of", "min_length": "min length",
           "max_length": "max length"}
    parts = []
    for meta in field.metadata:
        for attr, sym in ops.items():
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sym} {value}")
    return ", ".join(parts)


def _type_name(annotation) -> str:
    text = getattr(annotation, "__name__", None) if not getattr(annotation, "__args__", None) else None
    return text or str(annotation).replace("typing.", "").replace("NoneType", "None")


def _plugin_info(kind: str, name: str, plugin, source: str) -> dict[str, Any]:
    import inspect

    module_doc = inspect.getdoc(sys.modules.get(getattr(plugin.fn, "__module__", ""), None)) or ""
    return {
        "kind": kind, "name": name, "source": source, "distribution": _distribution(source),
        "role": getattr(plugin, "role", None), "level": getattr(plugin, "level", None),
        "requires": _required(plugin), "requires_depends_on_params": callable(getattr(plugin, "requires", None)),
        "needs": _needs(plugin),
        "layouts": list(getattr(plugin, "layouts", ())) or None,
        "min_group_size": getattr(plugin, "min_group_size", None),
        "doc": plugin.doc, "module_doc": module_doc if module_doc.strip() != plugin.doc.strip() else "",
        "params_schema": plugin.params.model_json_schema(),
    }


def _print_plugin(console, info: dict[str, Any], plugin) -> None:
    from rich.rule import Rule
    from rich.table import Table

    console.print(Rule(_text(f"{info['kind']} {info['name']}  ·  {info['distribution']}", "bold")))
    console.print(_text(info["doc"] or "(no docstring)", "bold"), soft_wrap=True)
    facts = []
    if info["role"]:
        facts.append(f"role: {info['role']} gate, {info['level']} level")
    if info["layouts"]:
        facts.append(f"layouts: {', '.join(info['layouts'])}")
    if info["min_group_size"]:
        facts.append(f"needs ≥ {info['min_group_size']} rollouts per group")
    if info["needs"]:
        facts.append("batch fields: " + ", ".join(info["needs"])
                     + (" (with the default parameters; others may need more)"
                        if info["requires_depends_on_params"] else ""))
    for fact in facts:
        console.print(_text(fact, "magenta"))
    if info["module_doc"]:
        console.print()
        console.print(_text(info["module_doc"]), soft_wrap=True)
    console.print()
    fields = plugin.params.model_fields
    if not fields:
        console.print(_text("parameters: none", "dim"))
        return
    table = Table(title="parameters", title_justify="left", show_lines=False)
    for col in ("name", "type", "default", "constraint", "description"):
        table.add_column(col, overflow="fold")
    for pname, f in fields.items():
        default = "<required>" if f.is_required() else repr(f.default)
        table.add_row(_text(pname, "bold cyan"), _text(_type_name(f.annotation)), _text(default),
                      _text(_constraints(f)), _text(f.description or ""))
    console.print(table)


@app.command("show")
def show_cmd(
    name: str = typer.Argument(..., help="Plugin or preset name."),
    kind: Optional[Kind] = typer.Option(None, "--kind", "-k", help="Only this kind, when the name is ambiguous."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output (with the JSON schema)."),
):
    """A plugin's formula (docstring), its parameter schema, and the batch fields it needs."""
    from lossplug.contracts.errors import did_you_mean

    reg = _registry()
    kinds = [kind.value] if kind else list(KIND_ORDER)
    found = [(k, reg.plugins[k][name]) for k in kinds if k in reg.plugins and name in reg.plugins[k]]
    is_preset = name in reg.presets and (kind is None or kind.value == "preset")
    if not found and not is_preset:
        known = sorted({n for k in KIND_ORDER for n in reg.plugins[k]} | set(reg.presets))
        _fail(f"no plugin or preset named '{name}'{did_you_mean(name, known)}; `lossplug list` shows them all", 1)
    infos = [_plugin_info(k, name, p, reg.origin(k, name)) for k, p in found]
    if as_json:
        out: dict[str, Any] = {"plugins": infos}
        if is_preset:
            out["preset"] = _explain_data(name)
        typer.echo(json.dumps(out, indent=2, default=str))
        return
    console = _console()
    for info, (_, plugin) in zip(infos, found):
        _print_plugin(console, info, plugin)
    if is_preset:
        if found:
            console.print()
        _print_explain(console, _explain_data(name))


# ---------------------------------------------------------------------------------------------------------------------
# recipe explain


def _load_recipe(source: str):
    import lossplug
    from lossplug.contracts import LossplugError

    try:
        if Path(source).is_file():
            return lossplug.Recipe.from_file(source)
        return lossplug.Recipe.load(source)
    except LossplugError as err:
        _fail(str(err))


def _recipe_needs(recipe) -> list[dict[str, str]]:
    """What a PolicyBatch must contain for this recipe: field, shape and which stage needs it."""
    from lossplug.pipeline import compile_recipe

    compiled = compile_recipe(recipe)
    needs: dict[str, list[str]] = {"logp": ["always"], "action_mask": ["always"]}

    def add(field: str, who: str) -> None:
        needs.setdefault(field, [])
        if who not in needs[field]:
            needs[field].append(who)

    if compiled.advantage is not None:
        adv = compiled.advantage.plugin
        for f in _required(adv, compiled.advantage.params):
            add(f, f"advantage '{adv.name}'")
        if adv.min_group_size > 0:
            add("group_id", f"advantage '{adv.name}' (≥ {adv.min_group_size} rollouts per group)")
    else:
        add("advantage", "the recipe has no advantage stage, so advantages come with the batch")
    for i, stage in enumerate(compiled.gates):
        for f in _required(stage.plugin, stage.params):
            add(f, f"gates[{i}] '{stage.plugin.name}'")
    return [{"field": f, "shape": FIELD_SHAPES.get(f, ""), "needed_by": "; ".join(who)} for f, who in needs.items()]


def _explain_data(source: str) -> dict[str, Any]:
    recipe = _load_recipe(source)
    from lossplug.pipeline import compile_recipe

    reg = _registry()
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
                           "source": _distribution(reg.origin(p.kind, p.name)),
                           "summary": p.doc.splitlines()[0] if p.doc else ""})
    red = compiled.reduction
    normalizer = "Normalizer(action_tokens=…, sequences=…) over the whole optimizer step (all micro-batches, ranks)"
    budget = getattr(red.params, "budget", "absent")
    if red.plugin.name == "fixed" and budget is None:
        normalizer += "; budget=… (e.g. max_completion_length) — the recipe sets none"
    preset_source = reg.presets[recipe.name].source if recipe.name in reg.presets else ""
    packed = compiled.advantage is not None and "packed" in compiled.advantage.plugin.layouts
    return {"name": recipe.name, "source": preset_source, "recipe": recipe.to_dict(), "yaml": recipe.to_yaml(),
            "stages": stage_rows, "needs": _recipe_needs(recipe), "normalizer": normalizer,
            "packed_advantage": packed}


def _print_explain(console, data: dict[str, Any]) -> None:
    from rich.rule import Rule
    from rich.table import Table

    title = f"recipe {data['name']}" if data["name"] else "recipe"
    console.print(Rule(_text(title, "bold")))
    if data["source"]:
        console.print(_text(data["source"], "dim"), soft_wrap=True)
    console.print(_text("\nresolved (every default filled in):", "bold"))
    console.print(_text(data["yaml"].rstrip()))
    console.print(_text("\nstages", "bold"))
    grid = Table.grid(padding=(0, 2), pad_edge=True)
    grid.add_column(no_wrap=True)
    grid.add_column(no_wrap=True, style="bold cyan")
    grid.add_column(ratio=1)
    for s in data["stages"]:
        detail = _text("")
        if s["role"]:
            detail.append(s["role"] + "   ", "magenta")
        detail.append(f"from {s['source']}", "dim")
        if s["summary"]:
            detail.append("\n" + s["summary"])
        grid.add_row(_text(s["stage"]), _text(s["plugin"]), detail)
    console.print(grid)
    table = Table(title="the batch (lossplug.PolicyBatch) must contain", title_justify="left")
    for col in ("field", "shape", "needed by"):
        table.add_column(col, overflow="fold")
    for n in data["needs"]:
        table.add_row(_text(n["field"], "bold green"), _text(n["shape"]), _text(n["needed_by"]))
    console.print(table)
    if data["packed_advantage"]:
        console.print(_text("the advantage stage also accepts packed transitions (lossplug.PackedTransitions)",
                            "dim"))
    console.print(_text(f"per micro-batch: {data['normalizer']}", "dim"), soft_wrap=True)


@recipe_app.command("explain")
def recipe_explain_cmd(
    source: str = typer.Argument(..., metavar="PRESET|FILE", help="A preset name or a recipe YAML/JSON file."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """The resolved recipe and what a batch must contain for it."""
    data = _explain_data(source)
    if as_json:
        data.pop("yaml")
        typer.echo(json.dumps(data, indent=2, default=str))
        return
    _print_explain(_console(), data)


# ---------------------------------------------------------------------------------------------------------------------
# validate


class UnreadableFile(LossplugError):
    """A batch file that cannot be read (missing, truncated, not safetensors/JSON, a pickle)."""


_PICKLE_HINT = ("lossplug never unpickles a file (unpickling runs arbitrary code); save the tensors with "
                "safetensors.torch.save_file(tensors, 'batch.safetensors') instead")


def _load_json(path: Path) -> dict[str, Any]:
    import torch

    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UnreadableFile(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise UnreadableFile(f"{path}: expected a JSON object mapping field names to (nested) lists, got "
                             f"{type(data).__name__}")
    out = {}
    for name, value in data.items():
        dtype = None
        if isinstance(value, dict):
            if "data" not in value:
                raise UnreadableFile(f"{path}: field '{name}': an object needs 'data' (and optionally 'dtype')")
            dtype_name = value.get("dtype")
            if dtype_name is not None:
                dtype = getattr(torch, str(dtype_name), None)
                if not isinstance(dtype, torch.dtype):
                    raise UnreadableFile(f"{path}: field '{name}': unknown dtype {dtype_name!r}")
            value = value["data"]
        if value is None:
            continue
        try:
            out[name] = torch.tensor(value, dtype=dtype)
        except (TypeError, ValueError, RuntimeError) as err:
            raise UnreadableFile(f"{path}: field '{name}' is not a rectangular array of numbers/booleans "
                                 f"({err})") from None
    return out


def _load_safetensors(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(9)
        n = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
        looks_safetensors = len(head) == 9 and head[8:9] == b"{" and 0 < n <= size - 8
        if not looks_safetensors and (head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in
                                                                        (b"\x02", b"\x03", b"\x04", b"\x05"))):
            raise UnreadableFile(f"{path} looks like a pickle or torch.save file. {_PICKLE_HINT}")
        if len(head) < 9:
            raise UnreadableFile(f"{path} is {size} bytes: too short to be a safetensors file")
        if n > size - 8 or n > 100_000_000:
            raise UnreadableFile(f"{path} is not a safetensors file, or it is truncated: its header claims "
                                 f"{n} bytes but the file has {size - 8} after the length prefix")
        fh.seek(8)
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise UnreadableFile(f"{path} is not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise UnreadableFile(f"{path} is not a safetensors file: its header is not a JSON object")
    data_size = size - 8 - n
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2):
            raise UnreadableFile(f"{path}: tensor '{key}' has no valid data_offsets: not a safetensors file")
        if offsets[1] > data_size:
            raise UnreadableFile(f"{path} is truncated: tensor '{key}' needs bytes up to {offsets[1]} of the data "
                                 f"section, the file has {data_size}")
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise UnreadableFile("reading .safetensors needs the safetensors package: pip install safetensors") from None
    try:
        return load_file(str(path))
    except Exception as err:  # safetensors' own error type differs across versions
        raise UnreadableFile(f"{path}: safetensors could not read it: {err}") from None


def load_batch_file(path: Path) -> dict[str, Any]:
    """The tensors of a batch dump: safetensors, or JSON for small ones. Never unpickles."""
    if not path.exists():
        raise UnreadableFile(f"no such file: {path}")
    if path.is_dir():
        raise UnreadableFile(f"{path} is a directory")
    if path.suffix.lower() in (".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt"):
        raise UnreadableFile(f"{path}: refusing a {path.suffix} file. {_PICKLE_HINT}")
    with path.open("rb") as fh:
        first = fh.read(64).lstrip()
    if path.suffix.lower() == ".json" or first[:1] == b"{":
        return _load_json(path)
    return _load_safetensors(path)


def _infer_contract(keys: set[str], choice: ContractChoice):
    from lossplug import PackedTransitions, PolicyBatch

    if choice == ContractChoice.policy:
        return PolicyBatch
    if choice == ContractChoice.packed:
        return PackedTransitions
    if keys & {"logp", "action_mask", "old_logp", "behavior_logp", "advantage"}:
        return PolicyBatch
    if keys & {"next_value", "boundary"}:
        return PackedTransitions
    raise UnreadableFile(f"cannot tell the contract from the fields {sorted(keys)}: a PolicyBatch has logp and "
                         "action_mask, PackedTransitions have next_value and boundary; pass --contract policy|packed")


def _validate(tensors: dict[str, Any], contract, recipe) -> tuple[list, Any]:
    """Every violation: the contract's, then the recipe's field requirements. Returns (violations, batch or None)."""
    import torch

    from lossplug import BatchValidationError, PolicyBatch, Violation

    violations: list = []
    batch = None
    try:
        batch = contract(**tensors)
    except BatchValidationError as err:
        violations.extend(err.violations)
        # The contract stops at the first layer of problems (unknown fields; then dtypes and shapes, before the
        # value rules). Name everything at once: check again without unknown fields, with 0/1 masks as bool.
        retry = {k: v for k, v in tensors.items() if k in contract.model_fields}
        for name in ("action_mask", "terminated", "boundary"):
            t = retry.get(name)
            if t is not None and t.dtype != torch.bool and not t.is_complex() and bool(((t == 0) | (t == 1)).all()):
                retry[name] = t.bool()
        if retry.keys() != tensors.keys() or any(retry[k] is not tensors[k] for k in retry):
            try:
                contract(**retry)
            except BatchValidationError as err2:
                violations.extend(v for v in err2.violations if v not in violations)
    if recipe is None:
        return violations, batch
    from lossplug.pipeline import _group_violations, compile_recipe
    from lossplug.plugin_registry import plugin_manager

    compiled = compile_recipe(recipe)
    name = recipe.name or "the recipe"
    if contract is PolicyBatch:
        for need in _recipe_needs(recipe):
            if need["field"] not in tensors:
                violations.append(Violation(need["field"], f"required by {need['needed_by']} ({name}), but the "
                                                           "file has none"))
        if batch is not None and compiled.advantage is not None and batch.group_id is not None:
            violations += _group_violations(batch, compiled.advantage.plugin, "recipe.advantage")
    else:
        adv = compiled.advantage
        if adv is None or "packed" not in adv.plugin.layouts:
            what = f"advantage '{adv.plugin.name}' works on {', '.join(adv.plugin.layouts)} batches" if adv else \
                "the recipe has no advantage stage"
            violations.append(Violation("<batch>", f"packed transitions feed only an advantage stage that accepts "
                                                   f"them; {what} ({name})"))
        else:
            missing = [f for f in _required(adv.plugin, adv.params) if f not in tensors]
            violations += [Violation(f, f"required by advantage '{adv.plugin.name}' ({name}), but the file has "
                                        "none") for f in missing]
    if batch is not None and not violations and compiled.has_validators:
        for found in plugin_manager().hook.lossplug_validate_batch(batch=batch, recipe=recipe):
            violations.extend(found or ())
    return violations, batch


@app.command("validate")
def validate_cmd(
    file: Path = typer.Argument(..., help="A batch dump: .safetensors, or .json (field → nested lists) for small "
                                          "ones. Pickles are refused."),
    contract: ContractChoice = typer.Option(ContractChoice.auto, "--contract", "-c",
                                            help="policy (PolicyBatch) or packed (PackedTransitions); auto infers "
                                                 "it from the field names."),
    recipe: Optional[str] = typer.Option(None, "--recipe", "-r", metavar="PRESET|FILE",
                                         help="Also check the fields this recipe's plugins need."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """Check a batch dump against the contracts; exit 1 naming every violation (field, rule, rows)."""
    try:
        tensors = load_batch_file(file)
        model = _infer_contract(set(tensors), contract)
    except UnreadableFile as err:
        _fail(str(err))
    recipe_obj = _load_recipe(recipe) if recipe else None
    violations, batch = _validate(tensors, model, recipe_obj)
    fields = {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")} for k, v in tensors.items()}
    ok = not violations
    if as_json:
        typer.echo(json.dumps({"file": str(file), "contract": model.__name__, "recipe": recipe, "valid": ok,
                               "fields": fields,
                               "violations": [{"field": v.field, "rule": v.rule, "where": v.where}
                                              for v in violations]}, indent=2))
        raise typer.Exit(0 if ok else 1)

    from rich.table import Table

    console = _console()
    table = Table(title=f"{file.name} → {model.__name__}", title_justify="left")
    for col in ("field", "shape", "dtype"):
        table.add_column(col)
    for k, v in fields.items():
        table.add_row(_text(k, "bold"), _text(str(v["shape"])), _text(v["dtype"]))
    console.print(table)
    against = model.__name__ + (f" and recipe '{recipe_obj.name or recipe}'" if recipe_obj else "")
    if ok:
        extra = ""
        if batch is not None and hasattr(batch, "action_mask"):
            extra = f" (B={batch.batch_size}, {int(batch.action_mask.sum())} action tokens)"
        console.print(_text(f"✓ valid against {against}{extra}", "bold green"))
        return
    table = Table(title=f"✗ {len(violations)} violation{'s' if len(violations) != 1 else ''} of {against}",
                  title_justify="left", title_style="bold red")
    for col in ("field", "rule", "where"):
        table.add_column(col, overflow="fold")
    for v in violations:
        table.add_row(_text(v.field, "bold red"), _text(v.rule), _text(v.where))
    console.print(table)
    raise typer.Exit(1)


# ---------------------------------------------------------------------------------------------------------------------
# check (the conformance kit)


@app.command("check")
def check_cmd(
    name: str = typer.Argument(..., help="A registered plugin name."),
    kind: Optional[Kind] = typer.Option(None, "--kind", "-k", help="advantage, gate or reduction, if ambiguous."),
    param: Optional[List[str]] = typer.Option(None, "--param", "-p", metavar="KEY=VALUE",
                                              help="A parameter to test with (repeatable)."),
    skip: Optional[List[str]] = typer.Option(None, "--skip", metavar="CHECK", help="A check to skip (repeatable)."),
):
    """Run the conformance kit (lossplug.testing) against a plugin; exit 1 if any check fails."""
    from rich.table import Table

    from lossplug.testing import check_plugin

    if kind == Kind.preset:
        _fail("presets are recipes, not plugins: try `lossplug recipe explain`")
    params = _parse_assignments(param, "--param")
    try:
        report = check_plugin(name, kind=kind.value if kind else None, params=params, skip=skip or ())
    except (LookupError, TypeError, ValueError) as err:
        _fail(str(err), 1)
    console = _console()
    table = Table(title=report.title, title_justify="left")
    for col in ("check", "result", "detail"):
        table.add_column(col, overflow="fold")
    marks = {"passed": ("✓ passed", "green"), "failed": ("✗ failed", "bold red"), "skipped": ("– skipped", "dim")}
    for r in report.results:
        mark, style = marks[r.status]
        table.add_row(_text(r.check, "bold"), _text(mark, style), _text(r.message or r.summary))
    console.print(table)
    if not report.ok:
        console.print(_text(f"✗ {len(report.failures)} check(s) failed", "bold red"))
        raise typer.Exit(1)
    console.print(_text(f"✓ {report.name} conforms", "bold green"))


# ---------------------------------------------------------------------------------------------------------------------
# plot gates


def _gate_specs(specs: Optional[List[str]]) -> list[dict[str, Any]]:
    """'name' or 'name:key=value,key=value' → recipe specs; default: every update gate, dual-clip, corrections."""
    if specs:
        out = []
        for spec in specs:
            name, _, rest = spec.partition(":")
            params = _parse_assignments([kv for kv in rest.split(",") if kv], "--gate parameters")
            out.append({"name": name.strip(), **params})
        return out
    reg = _registry()
    gates = reg.plugins["gate"]
    update = sorted(n for n, p in gates.items() if p.role == "update")
    out = []
    for n in update:
        out.append({"name": n})
        if n == "ppo_clip":
            out.append({"name": "ppo_clip", "dual_clip_c": 3.0})
    out += [{"name": n} for n in sorted(n for n, p in gates.items() if p.role == "correction")]
    return out


def gate_coefficients(spec: dict[str, Any], ratios, advantage: float):
    """∂J/∂logp per token, by autograd through the real plugin and ``lossplug.policy_loss``.

    Update gates: one single-token response per ratio ``r = π_θ/π_old`` (``behavior_logp = old_logp``, so ratios
    against the behaviour policy are ``r`` too). Corrections: composed after ``reinforce`` at ``r = 1``, one
    response per engine ratio ``ρ = π_old/π_behaviour``.
    """
    import torch

    import lossplug

    reg = _registry()
    plugin = reg.lookup("gate", spec["name"], "plot")
    r = torch.as_tensor(ratios, dtype=torch.float64).reshape(-1, 1)
    base = torch.full_like(r, -10.0)
    if plugin.role == "correction":
        ref = "reinforce" if "reinforce" in reg.plugins["gate"] else "ppo_clip"
        gates = [ref, spec]
        logp, old, behavior = base.clone(), base, base - r.log()
    else:
        gates = [spec]
        logp, old, behavior = base + r.log(), base, base
    logp.requires_grad_(True)
    n = r.shape[0]
    batch = lossplug.PolicyBatch(logp=logp, old_logp=old, behavior_logp=behavior, ref_logp=old,
                                 action_mask=torch.ones_like(r, dtype=torch.bool),
                                 advantage=torch.full((n,), float(advantage), dtype=torch.float64))
    recipe = lossplug.Recipe.model_validate({"gates": gates, "reduction": "token"})
    loss = lossplug.policy_loss(batch, recipe, metrics=False).loss  # = −Σ J / n
    (grad,) = torch.autograd.grad(loss, logp)
    return (-n * grad).reshape(-1).detach().numpy()


def plot_gates(path: Path, specs: list[dict[str, Any]], ratio_max: float = 4.0, points: int = 321) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    reg = _registry()
    ratios = np.linspace(0.02, ratio_max, points)
    cols = min(4, len(specs))
    rows = (len(specs) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False, sharey=True)
    for ax, spec in zip(axes.flat, specs):
        plugin = reg.lookup("gate", spec["name"], "plot")
        correction = plugin.role == "correction"
        for adv, color, label in ((1.0, "tab:blue", "A = +1"), (-1.0, "tab:red", "A = −1")):
            coef = gate_coefficients(spec, ratios, adv)
            ax.plot(ratios, coef, color=color, lw=2, label=label)
            ax.plot(ratios, ratios * adv, color=color, lw=0.8, ls=":", alpha=0.6)
        params = ", ".join(f"{k}={v}" for k, v in spec.items() if k != "name")
        ax.set_title(spec["name"] + (f" ({params})" if params else "") + (" · correction" if correction else ""),
                     fontsize=10)
        ax.axhline(0, color="0.6", lw=0.6)
        ax.axvline(1, color="0.6", lw=0.6)
        xlabel = "engine ratio ρ = π_old / π_behaviour" if correction else "ratio r = π_θ / π_old"
        if not correction and "behavior_logp" in _required(plugin, plugin.params.model_validate(
                {k: v for k, v in spec.items() if k != "name"})):
            xlabel += "  (= π_θ / π_behaviour here)"
        ax.set_xlabel(xlabel, fontsize=8)
        ax.grid(alpha=0.25)
        ax.set_ylim(-ratio_max - 0.2, ratio_max + 0.2)
    for ax in axes.flat[len(specs):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("∂J/∂logp (gradient coefficient)", fontsize=8)
    axes.flat[0].legend(fontsize=8, loc="upper left")
    fig.suptitle("Gradient coefficient ∂J/∂logp of each gate vs the ratio, by autograd through the plugins "
                 "(dotted: unclipped r·A)", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@plot_app.command("gates")
def plot_gates_cmd(
    out: Path = typer.Option(Path("lossplug-gates.png"), "--out", "-o", help="Where to write the PNG."),
    gate: Optional[List[str]] = typer.Option(None, "--gate", "-g", metavar="NAME[:K=V,...]",
                                             help="A gate to plot, with parameters (repeatable; default: every "
                                                  "registered gate, plus PPO dual-clip)."),
    ratio_max: float = typer.Option(4.0, "--ratio-max", min=1.1, help="Right end of the ratio axis."),
):
    """A PNG of each gate's gradient coefficient ∂J/∂logp against the ratio, for A > 0 and A < 0."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        _fail("plotting needs matplotlib: pip install matplotlib")
    from lossplug.contracts import LossplugError

    specs = _gate_specs(gate)
    try:
        path = plot_gates(out, specs, ratio_max=ratio_max)
    except LossplugError as err:
        _fail(str(err))
    _console().print(_text(f"wrote {path} ({len(specs)} gates)", "green"))


# ---------------------------------------------------------------------------------------------------------------------
# demo


@app.command("demo")
def demo_cmd(
    recipe: str = typer.Option("dapo", "--recipe", "-r", metavar="PRESET|FILE",
                               help="The recipe to train with: a preset name or a YAML/JSON file."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Optimizer steps (default 200; 60 with --fast)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the model init, the prompts and the sampling (the same for "
                                               "every recipe of --compare)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o",
                                       help="The run folder (default runs/<timestamp>-<recipe>/); with --compare, the "
                                            "folder for one sub-folder per recipe and compare.png."),
    compare: Optional[str] = typer.Option(None, "--compare", metavar="R1,R2,...",
                                          help="Train each of these recipes (comma-separated presets or files) on the "
                                               "same seeds and plot them side by side, e.g. grpo,dapo,gspo,sapo,cispo."),
    fast: bool = typer.Option(False, "--fast", help="The test settings: 60 steps and a smaller held-out set."),
    quiet: bool = typer.Option(False, "--quiet", "-q",
                               help="No live display: one plain line per held-out evaluation (for CI logs)."),
):
    """Train a tiny model from scratch with TRL's GRPOTrainer and a lossplug recipe — on CPU, with no hub access —
    and show that it learns.

    The task: a prompt ends in a digit d, the reward is 1 when the first word of the completion is (d+1) mod 10.
    Writes recipe.yaml, provenance.json, versions.json, metrics.jsonl, summary.json and curves.png to the run
    folder. Exit 1 if a run did not learn (reward up by less than 0.2 or no held-out gain).
    """
    import lossplug.adapters.demo as demo  # lazy: torch, transformers and TRL load only when the demo runs

    from lossplug.contracts import LossplugError

    settings = (demo.FAST if fast else demo.DEFAULT).replace(steps=steps, seed=seed)
    console = _console()
    try:
        if compare:
            recipes = [r.strip() for r in compare.split(",") if r.strip()]
            if not recipes:
                _fail("--compare needs at least one recipe, e.g. --compare grpo,dapo")
            path, results = demo.run_compare(recipes, settings, out, quiet=quiet, console=console)
            runs = list(results.values())
        else:
            runs = [demo.run_demo(recipe, settings, out, quiet=quiet, console=console)]
            path = None
    except (LossplugError, ValueError) as err:
        _fail(str(err))

    from rich.table import Table

    table = Table(title=f"lossplug demo · task successor · seed {settings.seed} · {settings.steps} steps",
                  title_justify="left")
    for col in ("recipe", "reward", "held-out", "time", "run folder"):
        table.add_column(col, overflow="fold")
    for run in runs:
        s = run.summary
        r, h = s["reward"], s["heldout"]
        table.add_row(_text(s["recipe"], "bold"),
                      _text("no reward logged" if r["start"] is None else f"{r['start']:.2f} → {r['end']:.2f}"),
                      _text(f"{h['before']:.2f} → {h['after']:.2f}"),
                      _text(f"{s['wall_s']:.0f}s ({s['cpu_s']:.0f}s CPU)"), _text(str(run.out_dir)))
    console.print(table)
    if path is not None:
        console.print(_text(f"wrote {path}", "green"))
    else:
        console.print(_text(f"wrote {', '.join(runs[0].summary['files'])} to {runs[0].out_dir}", "green"))
    failed = [run.summary["recipe"] for run in runs if not run.learned]
    if failed:
        console.print(_text(f"✗ did not learn clearly: {', '.join(failed)}", "bold red"))
        raise typer.Exit(1)
    console.print(_text("✓ learned: the reward rose clearly and the held-out score improved", "bold green"))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
