"""The generated blocks of the docs (``<!-- generated: NAME -->`` markers, expanded by ``docs/hooks/generated.py``
when the site is built): every marker a page uses is one the hook knows, and the batch field table has a row per
field of each contract, in the contract's own words — checked without building the site."""

import importlib.util
import re
import types
from pathlib import Path

import pytest

from lossplug.contracts import PackedTransitions, PolicyBatch

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")

MARKER = re.compile(r"<!-- generated: (\w+) -->")


def hook():
    spec = importlib.util.spec_from_file_location("docs_hook_generated", ROOT / "docs" / "hooks" / "generated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pages_with(name):
    return [
        p.relative_to(ROOT / "docs").as_posix()
        for p in (ROOT / "docs").rglob("*.md")
        if name in MARKER.findall(p.read_text())
    ]


def test_every_generated_marker_in_the_docs_is_known_to_the_hook():
    known = set(hook().PLACEHOLDERS)
    used = {name for page in (ROOT / "docs").rglob("*.md") for name in MARKER.findall(page.read_text())}
    assert {"trl_equivalent", "batch_fields"} <= used
    assert used <= known, f"unknown generated blocks: {sorted(used - known)}"


def _tables(markdown):
    """contract name → its table's rows (cells), from the generated block."""
    tables, current = {}, None
    for line in markdown.splitlines():
        if m := re.fullmatch(r"\*\*`(\w+)`\*\*", line):
            current = tables.setdefault(m.group(1), [])
        elif line.startswith("| `") and current is not None:
            current.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]])
    return tables


def test_the_batch_field_table_has_a_row_per_field_of_each_contract():
    tables = _tables(hook().batch_fields_table())
    assert set(tables) == {"PolicyBatch", "PackedTransitions"}
    for contract in (PolicyBatch, PackedTransitions):
        rows = tables[contract.__name__]
        names = [re.match(r"`(\w+)`", row[0]).group(1) for row in rows]
        assert names == list(contract.FIELD_NAMES)  # every field, once, in declaration order
        for name, (field, shape, kind, source, rules, description) in zip(names, rows):
            spec = contract.SPECS[name]
            assert field.endswith("(required)") == contract.model_fields[name].is_required(), name
            assert (shape, kind) == (f"`{spec.shape_text}`", spec.kind), name
            assert source == (spec.source or "—"), name
            unescaped = rules.replace("\\", "").replace("&lt;", "<")
            assert all(rule in unescaped for rule in contract.field_rules(name)), name
            assert description.replace("\\", "") == (spec.description or spec.summary), name


def test_the_field_table_is_in_the_concepts_page_and_expands_there():
    assert pages_with("batch_fields") == ["concepts.md"]
    module = hook()
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_uri="concepts.md"))
    config = types.SimpleNamespace(docs_dir=str(ROOT / "docs"), repo_url=None)
    rendered = module.on_page_markdown((ROOT / "docs" / "concepts.md").read_text(), page, config, None)
    assert "<!-- generated:" not in rendered
    for name in PolicyBatch.FIELD_NAMES:
        assert re.search(rf"^\| `{name}`", rendered, flags=re.M), name
