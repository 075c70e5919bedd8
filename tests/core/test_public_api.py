"""The public API is listed once — ``lossplug.__all__``, from the export table of ``core/__init__.py`` — and everything
else follows it: the names resolve, the type checkers' re-exports mirror the table, the docs' API page is generated
from ``__all__``."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

import lossplug

ROOT = Path(__file__).resolve().parents[2]


def test_every_public_name_resolves_from_its_module():
    assert lossplug.__all__ == ["hookimpl", *sorted(lossplug._WHERE)]
    assert len(set(lossplug.__all__)) == len(lossplug.__all__)
    for name in lossplug.__all__:
        value = getattr(lossplug, name)
        if name != "hookimpl":
            assert value is getattr(importlib.import_module(lossplug._WHERE[name]), name), name
    assert set(lossplug.__all__) <= set(dir(lossplug))


def _type_checking_reexports() -> dict[str, str]:
    """``name -> module`` of the ``X as X`` imports under ``if TYPE_CHECKING:`` in ``core/__init__.py``."""
    tree = ast.parse((ROOT / "core" / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    found: dict[str, str] = {}
    for node in block.body:
        if isinstance(node, ast.ImportFrom):
            module = f"lossplug.{node.module}" if node.level else node.module
            found.update({a.name: module for a in node.names if a.asname == a.name})
    return found


def test_the_type_checkers_reexports_mirror_the_export_table():
    """Type checkers cannot read the lazy table, so ``core/__init__.py`` re-exports each name statically for them;
    that block must name exactly the table's names, each from the table's module."""
    assert _type_checking_reexports() == lossplug._WHERE


def test_the_api_page_is_generated_from_all_and_documents_every_name():
    """``docs/api/lossplug.md`` is written from ``lossplug.__all__`` when the docs are built (never committed): every
    name once, under the module that defines it (mkdocstrings renders it from there)."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    spec = importlib.util.spec_from_file_location("docs_hook_generated", ROOT / "docs" / "hooks" / "generated.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    assert "api/lossplug.md" in hook.GENERATED_PAGES and not (ROOT / "docs" / "api" / "lossplug.md").exists()
    page = hook.api_page()
    documented: list[str] = []
    for section in re.split(r"^## ", page, flags=re.M)[1:]:
        module = re.match(r"`([\w.]+)`", section).group(1)
        members = re.findall(r"^        - (\w+)$", section, flags=re.M)
        assert all(getattr(importlib.import_module(module), name) is getattr(lossplug, name) for name in members)
        documented += members
    assert "`lossplug.hookimpl`" in page
    assert sorted(documented) == sorted(set(lossplug.__all__) - {"hookimpl"})
