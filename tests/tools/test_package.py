"""lossplug.tools: plain functions beside the plugins, below them in the dependency order."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "core" / "tools"
MODULES = sorted(p for p in TOOLS.glob("*.py") if p.name != "__init__.py")


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield node.lineno, [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            yield node.lineno, [(base, a.name) for a in node.names]


def test_the_five_tools_are_there():
    assert [p.stem for p in MODULES] == ["diagnostics", "dynamic_sampling", "kl", "reward_model", "value_loss"]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_a_tool_imports_contracts_and_core_only_never_a_private_name(path):
    # plugins may use a tool (gae shapes rewards with kl_shaped_rewards), so the reverse would be a cycle; a private
    # helper shared between modules belongs, public and documented, in a shared module (lossplug.ops, contracts)
    for line, names in _imports(path):
        for module, name in names:
            where = f"{path.name}:{line}"
            assert not module.startswith(("lossplug.plugins", "lossplug.adapters", "lossplug.demo")), (
                f"{where}: imports {module}"
            )
            internal = module.startswith((".", "lossplug"))
            assert not (internal and name and name.startswith("_")), f"{where}: imports the private {module}.{name}"
            assert not (internal and any(part.startswith("_") for part in module.lstrip(".").split(".") if part)), (
                f"{where}: imports the private module {module}"
            )


def test_importing_the_package_imports_no_tool_and_no_torch():
    code = (
        "import sys, lossplug.tools; print(sorted(m for m in sys.modules if m.startswith('lossplug.tools.')), "
        "'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["[]", "False"]
