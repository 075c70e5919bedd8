"""Every import of the package is declared: a user's ``pip install lossplug`` (no extras) must run the core.

The dev environment holds every extra and all they bring (numpy arrives with matplotlib, trl and verl), so an
undeclared import passes every other test and fails only on a user's machine — as ``numpy`` in ``tools/kl.py`` once
made ``Recipe.preset("dapo")`` raise ModuleNotFoundError. The rules:

* an import that runs when a module is imported must be the standard library, lossplug itself or a **declared core
  dependency** (``[project].dependencies``; what those bring in turn may change under us and does not count);
* an import inside a function, or guarded by ``except ImportError``, may also be anything an **optional extra**
  brings (its requirements and theirs, read from the installed metadata) — it runs only on that extra's path;
* a few modules exist only for an extra (:data:`OPTIONAL_MODULES`) and may import its packages at import time; no
  other module may import them at import time.

The AST rules are backed by running the core-only CI check (``.ci/core_only_smoke.py``) with every package the
extras bring hidden, which also covers function-level imports on the core paths.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

#: modules that exist only for an extra, reached only through it (its entry point, or a user who installed it)
OPTIONAL_MODULES = {
    "lossplug.adapters.verl": "lossplug[verl]: loaded by verl's `verl.plugins` entry point, imports verl and numpy",
    "lossplug.adapters.trl.trainer": "lossplug[trl]: imported on first use of LossplugGRPOTrainer or attach",
    "lossplug.testing.pytest_plugin": "the pytest11 entry point: only pytest loads it, so pytest is there",
}

_GUARDS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _optional(module: str) -> bool:
    """An optional module, or a submodule of an optional package (reached only through it)."""
    return any(module == m or module.startswith(m + ".") for m in OPTIONAL_MODULES)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(spec: str) -> str:
    return _canonical(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec).group(1))


@cache
def _modules_of() -> dict[str, set[str]]:
    """distribution (canonical name) → the top-level modules it installs."""
    out: dict[str, set[str]] = {}
    for module, dists in metadata.packages_distributions().items():
        for dist in dists:
            out.setdefault(_canonical(dist), set()).add(module)
    return out


def core_modules() -> set[str]:
    dists = {_requirement_name(spec) for spec in PYPROJECT["project"]["dependencies"]}
    missing = sorted(d for d in dists if d not in _modules_of())
    assert not missing, f"declared core dependencies not installed here: {missing}"
    return set().union(*(_modules_of()[d] for d in dists))


def extra_modules() -> set[str]:
    """Every top-level module an optional extra brings: its requirements' closure, from the installed metadata."""
    from packaging.requirements import Requirement  # pytest's own dependency: always here when tests run

    extras = PYPROJECT["project"]["optional-dependencies"]
    pending = [_requirement_name(s) for specs in extras.values() for s in specs]
    seen: set[str] = set()
    while pending:
        dist = pending.pop()
        if dist in seen or dist == "lossplug":  # lossplug[trl,verl] in `all`: the other extras, listed already
            continue
        seen.add(dist)
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            pytest.skip(f"the extras' closure needs them installed; {dist} is not (pip install -e '.[all,dev]')")
        for spec in requires:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                pending.append(_canonical(req.name))
    return set().union(*(_modules_of().get(d, set()) for d in seen))


def package_files() -> dict[str, Path]:
    """module name → file, for every module of the distribution (through pyproject's package-dir mapping)."""
    mapping = PYPROJECT["tool"]["setuptools"]["package-dir"]
    modules = {}
    for package in PYPROJECT["tool"]["setuptools"]["packages"]:
        prefix = max((p for p in mapping if package == p or package.startswith(p + ".")), key=len)
        folder = (
            ROOT / mapping[prefix] / Path(*package[len(prefix) :].lstrip(".").split("."))
            if package != prefix
            else ROOT / mapping[prefix]
        )
        for path in folder.glob("*.py"):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def _guards_imports(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return handler.type is None or any(isinstance(k, ast.Name) and k.id in _GUARDS for k in kinds)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(module: str, source: str, is_package: bool = False) -> list[tuple[int, str, bool]]:
    """``(line, absolute module name, deferred)`` of every import in ``source``, the text of ``module``;
    ``deferred``: it does not run when the module is imported (inside a function) or the module copes with its
    absence (``except ImportError``). ``if TYPE_CHECKING:`` blocks never run and are left out."""
    found = []

    def absolute(node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module
        parts = module.split(".")
        base = parts[: len(parts) - node.level + (1 if is_package else 0)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit_all(stmts: list[ast.stmt], deferred: bool) -> None:
        for stmt in stmts:
            visit(stmt, deferred)

    def visit(node: ast.AST, deferred: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            deferred = True
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            return visit_all(node.orelse, deferred)
        elif isinstance(node, ast.Try) and any(_guards_imports(h) for h in node.handlers):
            visit_all(node.body, True)
            for handler in node.handlers:
                visit_all(handler.body, deferred)
            return visit_all(node.orelse + node.finalbody, deferred)
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, deferred) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            name = absolute(node)
            # `from lossplug.adapters import verl` may import the submodule lossplug.adapters.verl
            found.extend(
                (node.lineno, f"{name}.{a.name}" if name.split(".")[0] == "lossplug" else name, deferred)
                for a in node.names
            )
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))
            )
        ):
            found.append((node.lineno, node.args[0].value, deferred))
        for child in ast.iter_child_nodes(node):
            visit(child, deferred)

    visit(ast.parse(source), False)
    return found


def test_the_scan_sees_what_runs_at_import_time():
    source = """
import os
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    import never_runs
try:
    import optional_thing
except ImportError:
    optional_thing = None
class C:
    import in_a_class_body
def f():
    import in_a_function
    from .sibling import x
lazy = lambda: __import__("in_a_lambda")
importlib.import_module("by_name")
"""
    found = {name: deferred for _, name, deferred in imports("lossplug.tools.kl", source)}
    assert found == {
        "os": False,
        "typing": False,
        "optional_thing": True,
        "in_a_class_body": False,
        "in_a_function": True,
        "lossplug.tools.sibling.x": True,
        "in_a_lambda": True,
        "by_name": False,
    }
    assert [n for _, n, _ in imports("lossplug.tools", "from . import kl\nfrom ..ops import zero_off", True)] == [
        "lossplug.tools.kl",
        "lossplug.ops.zero_off",
    ]


def test_every_import_is_declared():
    core, extras = core_modules(), extra_modules()
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    files = package_files()
    assert set(OPTIONAL_MODULES) <= set(files), f"stale OPTIONAL_MODULES: {set(OPTIONAL_MODULES) - set(files)}"
    problems = []
    for module, path in sorted(files.items()):
        where = path.relative_to(ROOT)
        for line, name, deferred in imports(module, path.read_text(), path.stem == "__init__"):
            top = name.split(".")[0]
            if top in stdlib or top == "lossplug":
                needs_extra = next((m for m in OPTIONAL_MODULES if name == m or name.startswith(m + ".")), None)
                if needs_extra and not deferred and not _optional(module):
                    problems.append(
                        f"{where}:{line}: imports {needs_extra} at import time — it needs an extra "
                        f"({OPTIONAL_MODULES[needs_extra]}); import it inside the function that uses it"
                    )
                continue
            if not deferred and not _optional(module):
                if top not in core:
                    problems.append(
                        f"{where}:{line}: imports {name} at import time; {top} is neither the standard "
                        "library nor a declared dependency (declare it, or import it lazily on the "
                        "optional path that needs it)"
                    )
            elif top not in core and top not in extras:
                problems.append(
                    f"{where}:{line}: imports {name}; {top} is not brought by any declared dependency or extra"
                )
    assert not problems, "\n".join(problems)


def test_core_paths_run_with_every_extra_hidden():
    hidden = sorted(extra_modules() - _closure_of_core())
    assert "numpy" in hidden and "trl" in hidden  # the point: what only the extras bring
    code = (
        "import runpy, sys\n"
        f"for name in {hidden!r}:\n"
        "    sys.modules[name] = None  # `import name` raises ModuleNotFoundError, as in a core-only install\n"
        f"runpy.run_path({str(ROOT / '.ci' / 'core_only_smoke.py')!r}, run_name='__main__')\n"
    )
    env = {**os.environ, "LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the package alone, not what else is installed
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "core-only install: ok" in out.stdout


def _closure_of_core() -> set[str]:
    from packaging.requirements import Requirement

    pending = [_requirement_name(s) for s in PYPROJECT["project"]["dependencies"]]
    seen: set[str] = set()
    while pending:
        dist = pending.pop()
        if dist in seen:
            continue
        seen.add(dist)
        for spec in metadata.requires(dist) or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                pending.append(_canonical(req.name))
    return set().union(*(_modules_of().get(d, set()) for d in seen))
