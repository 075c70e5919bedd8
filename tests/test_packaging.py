"""The distribution: folder mapping, wheel contents, import cost and the one-way dependency rule."""

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
MAPPING = {
    "lossplug": "core",
    "lossplug.contracts": "contracts",
    "lossplug.plugins": "plugins",
    "lossplug.adapters": "adapters",
}


def folder_of(package: str) -> Path:
    for prefix in sorted(MAPPING, key=len, reverse=True):
        if package == prefix or package.startswith(prefix + "."):
            rest = package[len(prefix) :].lstrip(".")
            return ROOT / MAPPING[prefix] / Path(*rest.split(".")) if rest else ROOT / MAPPING[prefix]
    raise AssertionError(package)


def test_packages_list_matches_the_folders_on_disk():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == MAPPING
    listed = set(config["packages"])
    on_disk = set()
    for package, folder in MAPPING.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            on_disk.add(".".join([package, *rel.parts]) if rel.parts else package)
    assert listed == on_disk, f"pyproject packages vs folders: missing {on_disk - listed}, stale {listed - on_disk}"
    for package in listed:
        assert (folder_of(package) / "__init__.py").is_file()


@pytest.mark.slow
def test_wheel_contains_exactly_the_lossplug_package(tmp_path):
    # build from a copy: an in-tree build leaves build/ and *.egg-info behind, which shadow the installed
    # distribution's entry points whenever the checkout is on sys.path
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "*.egg-info", "__pycache__", "runs", ".hypothesis", ".pytest_cache"
        ),
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("lossplug-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"lossplug", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    assert "lossplug/__init__.py" in names and "lossplug/contracts/batch.py" in names
    assert "lossplug/plugins/gates/ppo_clip.py" in names
    assert "lossplug/py.typed" in names  # PEP 561: type checkers read the package's annotations
    assert not any(n.startswith(("tests/", "core/")) for n in names)


def test_import_is_fast_and_imports_no_trainer():
    bare = subprocess.run(
        [sys.executable, "-c", "import sys, lossplug; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert bare == ["False"]  # names resolve lazily: lossplug's pytest plugin costs other projects nothing
    code = (
        "import time, sys; import torch; t = time.perf_counter(); import lossplug; lossplug.Recipe; "
        "dt = time.perf_counter() - t; print(dt, 'trl' in sys.modules, 'verl' in sys.modules, "
        "'lossplug.plugin_registry' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    seconds, trl, verl, builtins = float(out[0]), out[1], out[2], out[3]
    assert (trl, verl) == ("False", "False")
    assert builtins == "False"  # the registry is built on first use, not at import
    assert seconds < 1.0, f"import lossplug took {seconds:.2f}s beyond torch"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


#: The imports against the direction, (file, module). The demo (`lossplug demo`) trains with the TRL adapter, and the
#: tiny-trainer helpers of `lossplug.testing.tiny` build TRL trainers for plugin authors' tests: both sit on top of
#: the adapters like a user's script; so does `lossplug verl`, which checks a verl config with the verl adapter's own
#: code. They import inside functions (checked below), so `import lossplug`,
#: `lossplug --help` and lossplug's pytest plugin never import TRL.
UPWARD_EXCEPTIONS = {
    ("core/demo/training.py", "lossplug.adapters.trl"),
    ("core/testing/tiny.py", "lossplug.adapters.trl"),
    ("core/testing/tiny.py", "trl"),
    ("core/cli/verl_commands.py", "lossplug.adapters.verl"),
}


@pytest.mark.parametrize(
    "folder,forbidden",
    [
        (
            "contracts",
            (
                "lossplug.plugins",
                "lossplug.adapters",
                "lossplug.pipeline",
                "lossplug.plugin_registry",
                "lossplug.plugin",
                "trl",
                "verl",
            ),
        ),
        ("core", ("lossplug.adapters", "trl", "verl")),
        ("plugins", ("lossplug.adapters", "trl", "verl")),
    ],
)
def test_dependencies_point_one_way(folder, forbidden):
    for path in (ROOT / folder).rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for name in imported_modules(path):
            if (rel, name) in UPWARD_EXCEPTIONS:
                continue
            assert not any(name == f or name.startswith(f + ".") for f in forbidden), f"{path}: imports {name}"


def _imports_outside_functions(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path`` that runs when the module is imported."""
    tree = ast.parse(path.read_text())
    inside_functions = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(fn)
    }
    type_checking_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If)  # never run
        and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    skipped = inside_functions | type_checking_only
    out = []
    for node in ast.walk(tree):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module]
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
            else []
        )
        out += [(node.lineno, n) for n in names if id(node) not in skipped]
    return out


def test_the_cli_imports_the_demo_lazily():
    tree = ast.parse((ROOT / "core" / "cli" / "app.py").read_text())
    found = sum(
        1
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for n in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
        if n.startswith(("lossplug.demo", "lossplug.adapters"))
    )
    assert found >= 1
    for line, name in _imports_outside_functions(ROOT / "core" / "cli" / "app.py"):
        assert not name.startswith(("lossplug.demo", "lossplug.adapters")), (
            f"core/cli/app.py line {line}: module-level import of {name}"
        )
    code = "import sys, lossplug.cli; print(*(m in sys.modules for m in ('trl', 'lossplug.demo', 'torch')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "False"]


@pytest.mark.parametrize("rel,module", sorted(UPWARD_EXCEPTIONS))
def test_imports_against_the_direction_stay_inside_functions(rel, module):
    for line, name in _imports_outside_functions(ROOT / rel):
        assert not (name == module or name.startswith(module + ".")), (
            f"{rel} line {line}: module-level import of {name}"
        )


def test_the_demo_and_the_tiny_helpers_import_no_trainer():
    code = (
        "import sys, lossplug.demo, lossplug.testing.tiny; "
        "print([m for m in ('trl', 'transformers', 'datasets', 'torch', 'matplotlib') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_contracts_import_only_torch_pydantic_and_the_standard_library():
    allowed = {"torch", "pydantic", "yaml", "__future__", "lossplug.contracts"} | set(sys.stdlib_module_names)
    for path in (ROOT / "contracts").rglob("*.py"):
        for name in imported_modules(path):
            assert name.split(".")[0] in allowed or name.startswith("lossplug.contracts"), f"{path}: {name}"
