"""The shape of the core package: its modules import one way, stay small, and read the plugin kinds from one table.

* No two modules of ``core/`` import each other, directly or around a loop — module-level, function-level and
  ``TYPE_CHECKING`` imports all count, and so does a package's lazy export table (names of modules in string
  constants of an ``__init__``, imported on first use).
* No module over 700 lines, no function over 80 (docstrings excluded) — the CLI package (``core/cli/``) is checked
  by its own suite.
* The plugin kinds are spelled once: ``lossplug.contracts.recipe.PLUGIN_KINDS`` names them and their recipe keys,
  :data:`lossplug.kinds.KINDS` binds each to its plugin class and hook, and the registry, the kit and recipes read
  those.
"""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import lossplug
from lossplug.contracts import recipe as contract
from lossplug.kinds import KINDS

CORE = Path(lossplug.__file__).parent
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 700, 80


def _module_name(path: Path) -> str:
    parts = ["lossplug", *path.relative_to(CORE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _core_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in CORE.rglob("*.py")}


def _enclosing(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module → the core modules it imports (every import statement, wherever it sits)."""
    modules = _core_modules()
    outside = ("lossplug.contracts", "lossplug.plugins", "lossplug.adapters")
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
                module = ".".join(base + [node.module] if node.module else base) if node.level else node.module or ""
                # `from package import submodule` depends on the submodule (its package is loaded anyway)
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
            elif path.name == "__init__.py" and isinstance(node, ast.Constant) and isinstance(node.value, str):
                targets = [t for t in (node.value, f"{name}.{node.value}") if t in modules]
            for target in targets:
                if not target.startswith("lossplug") or target.startswith(outside):
                    continue
                found = _enclosing(target, modules)
                if found is not None and found != name:
                    deps.add(found)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_core_modules_import_one_way():
    graph = import_graph()
    assert "lossplug.pipeline" in graph["lossplug.control"]  # the graph sees what it should
    assert "lossplug.recipe_catalogue" in graph["lossplug"]  # function-level imports count
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def test_no_module_over_700_lines_and_no_function_over_80():
    too_long = []
    for path in sorted(CORE.rglob("*.py")):
        if path.relative_to(CORE).parts[0] == "cli":
            continue
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(CORE)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _function_lines(node) > MAX_FUNCTION_LINES:
                too_long.append(f"{path.relative_to(CORE)}:{node.lineno} {node.name}: {_function_lines(node)} lines")
    assert too_long == []


def test_one_table_of_plugin_kinds():
    from lossplug import hookspecs, plugin_registry
    from lossplug.testing import kit

    assert (
        list(KINDS)
        == list(contract.PLUGIN_KINDS)
        == [
            "shaper",
            "filter",
            "advantage",
            "gate",
            "reduction",
            "regularizer",
        ]
    )
    assert contract.STAGES == ("shapers", "filters", "advantage", "gates", "reduction", "regularizers")
    for name, kind in KINDS.items():
        assert kind.name == name and kind.plugin_class.kind == name
        assert kind.recipe_key == contract.PLUGIN_KINDS[name]
        assert callable(getattr(hookspecs, kind.hook))
    assert plugin_registry.KINDS is KINDS
    assert kit.KINDS == tuple(KINDS)
    assert set(lossplug.registry().plugins) == set(KINDS)


def test_a_plugin_in_the_wrong_stage_is_told_its_recipe_key():
    import pytest

    with pytest.raises(lossplug.RecipeError, match="'icepop' is a gate plugin: it belongs under gates"):
        lossplug.Recipe.model_validate({"gates": ["ppo_clip"], "reduction": "icepop"})


def test_the_package_is_a_plain_module_and_contracts_asks_it_for_the_catalogue():
    assert type(sys.modules["lossplug"]) is types.ModuleType
    from lossplug.recipe_catalogue import CATALOGUE

    assert lossplug.default_recipe_catalogue() is CATALOGUE
    assert contract.installed_catalogue() is CATALOGUE


def test_a_recipe_keeps_what_it_was_compiled_into():
    recipe = lossplug.Recipe.preset("grpo")
    assert recipe.compiled is None
    compiled = lossplug.compile_recipe(recipe)
    assert recipe.compiled is compiled and lossplug.compile_recipe(recipe) is compiled
    assert recipe == lossplug.Recipe.preset("grpo")  # the cache is not part of the recipe's value
