"""docs/field.md — the other frameworks' losses as recipes — stays true: every framework has its section with its
source, every row's recipe builds against the catalogue (merged onto the section's base recipe), a row that says it
needs a new plugin names a registered plugin its recipe uses, a row that says the trainer must cooperate says why,
and the summary's totals are the rows'."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

import lossplug

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "field.md"
FRAMEWORKS = ("SkyRL", "AReaL", "prime-rl", "ROLL", "NeMo-RL", "slime", "rLLM", "OpenRLHF")
STAGES = ("shapers", "filters", "advantage", "gates", "reduction", "regularizers")
TRAINER = "needs the trainer's cooperation: "
GAP = "no plugin yet: "
STATUS = re.compile(r"^(covered|trainer|gap|new: `(?P<plugin>[a-z0-9_]+)`)$")


@dataclass(frozen=True)
class Row:
    framework: str
    option: str
    recipe: str
    status: str
    line: int

    @property
    def new_plugin(self) -> str | None:
        match = STATUS.match(self.status)
        return match.group("plugin") if match else None

    def __str__(self) -> str:
        return f"{self.framework} line {self.line}: {self.option}"


def cells(line: str) -> list[str]:
    """The cells of a Markdown table row; a ``|`` inside a code span is not a separator."""
    out, cell, in_code = [], "", False
    for char in line.strip()[1:-1]:
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            out.append(cell.strip())
            cell = ""
        else:
            cell += char
    return [*out, cell.strip()]


def sections(text: str) -> dict[str, tuple[int, str]]:
    """``## Title`` → (line number of the title, the section's text)."""
    found: dict[str, tuple[int, str]] = {}
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("## ")]
    for start, end in zip(starts, [*starts[1:], len(lines)]):
        found[lines[start][3:].strip()] = (start + 1, "\n".join(lines[start:end]))
    return found


def framework_rows(name: str, first_line: int, body: str) -> list[Row]:
    rows = []
    header = f"| {name} (options) |"
    in_table = False
    for offset, line in enumerate(body.splitlines()):
        if line.startswith(header):
            in_table = True
            continue
        if in_table and line.startswith("|---"):
            continue
        if in_table and line.startswith("|"):
            option, recipe, status, _notes = cells(line)
            rows.append(Row(name, option, recipe, status, first_line + offset))
        elif in_table:
            break
    return rows


TEXT = PAGE.read_text()
SECTIONS = sections(TEXT)
ROWS = [row for name in FRAMEWORKS if name in SECTIONS for row in framework_rows(name, *SECTIONS[name])]
NEW_PLUGINS = {row.new_plugin for row in ROWS if row.new_plugin}


def code_span(text: str) -> str:
    match = re.fullmatch(r"`([^`]+)`", text.strip())
    assert match, f"expected one `code span`, got {text!r}"
    return match.group(1)


def base_recipe(name: str) -> dict:
    match = re.search(r"^Base recipe: `([^`]+)`", SECTIONS[name][1], flags=re.M)
    assert match, f"the {name} section states no base recipe"
    return yaml.safe_load(match.group(1))


def build(row: Row) -> tuple[lossplug.Recipe, tuple[str, ...]]:
    """The row's recipe — a ``preset `name``` or a mapping of stages merged onto the section's base recipe — and the
    stages the row itself sets (all of them for a preset)."""
    preset = re.fullmatch(r"preset `([a-z0-9_]+)`", row.recipe)
    if preset:
        return lossplug.Recipe.preset(preset.group(1)), STAGES
    override = yaml.safe_load(code_span(row.recipe))
    assert isinstance(override, dict) and override and set(override) <= set(STAGES), (
        f"{row}: a recipe replaces stages among {STAGES}, got {override!r}"
    )
    merged = {**base_recipe(row.framework), **override}
    recipe = lossplug.Recipe.model_validate({key: value for key, value in merged.items() if value is not None})
    return recipe, tuple(override)


def plugin_names(recipe: lossplug.Recipe, stages: tuple[str, ...] = STAGES) -> set[str]:
    """The plugins the given stages of a built recipe name (an advantage's ``task`` estimator included)."""
    names: set[str] = set()
    for key in ("shapers", "filters"):
        if key in stages:
            names |= {spec.name for spec in getattr(recipe, key)}
    if "gates" in stages:
        names |= {gate.name for gate in recipe.gates}
    if "regularizers" in stages:
        names |= {reg.name for reg in recipe.regularizers}
    if "reduction" in stages and recipe.reduction:
        names.add(recipe.reduction.name)
    if "advantage" in stages and recipe.advantage:
        names.add(recipe.advantage.name)
        task = recipe.advantage.params.get("task")
        names |= {task if isinstance(task, str) else task["name"]} if task else set()
    return names


def registered(name: str) -> bool:
    return any(name in plugins for plugins in lossplug.registry().plugins.values())


def test_every_framework_has_a_section_with_its_source_and_a_base_recipe_that_builds():
    for name in FRAMEWORKS:
        assert name in SECTIONS, f"docs/field.md has no '## {name}' section"
        body = SECTIONS[name][1]
        source = re.search(r"^Source: (.+)$", body, flags=re.M)
        assert source, f"the {name} section does not cite its source"
        assert re.search(r"`[a-z-]+` \d+\.\d+\.\d+|commit `[0-9a-f]{40}`", body), f"{name}: no version or commit"
        lossplug.Recipe.model_validate(base_recipe(name))
        assert framework_rows(name, *SECTIONS[name]), f"the {name} section has no table rows"


@pytest.mark.parametrize("row", ROWS, ids=str)
def test_each_row_is_a_recipe_that_builds_or_a_reason(row):
    match = STATUS.match(row.status)
    assert match, f"{row}: status must be covered, new: `plugin`, trainer or gap, got {row.status!r}"
    if row.status == "trainer":
        assert row.recipe.startswith(TRAINER) and len(row.recipe) > len(TRAINER) + 20, f"{row}: say why"
        return
    if row.status == "gap":
        assert row.recipe.startswith(GAP) and len(row.recipe) > len(GAP) + 20, f"{row}: say what is missing"
        return
    if row.new_plugin:
        assert registered(row.new_plugin), f"{row}: plugin {row.new_plugin!r} is not registered (not merged yet?)"
    recipe, stages = build(row)
    names = plugin_names(recipe, stages)
    if row.new_plugin:
        assert row.new_plugin in names, f"{row}: the recipe does not use {row.new_plugin!r}"
    else:
        assert not names & NEW_PLUGINS, f"{row}: 'covered' but uses the new plugin(s) {names & NEW_PLUGINS}"


def test_the_summary_totals_are_the_rows():
    summary = SECTIONS["Summary"][1].splitlines()
    table = [cells(line) for line in summary if line.startswith("| ") and not line.startswith("| framework")]
    assert [row[0] for row in table] == list(FRAMEWORKS)
    for name, _source, total, covered, new, trainer, gap in table:
        rows = [row for row in ROWS if row.framework == name]
        counts = {
            "covered": sum(row.status == "covered" for row in rows),
            "new": sum(row.new_plugin is not None for row in rows),
            "trainer": sum(row.status == "trainer" for row in rows),
            "gap": sum(row.status == "gap" for row in rows),
        }
        stated = {"covered": int(covered), "new": int(new), "trainer": int(trainer), "gap": int(gap)}
        assert (int(total), stated) == (len(rows), counts), name
    overall = re.search(
        r"In all: (\d+) rows — (\d+) covered, (\d+) by a new plugin, (\d+) need the trainer, (\d+) gaps", TEXT
    )
    assert overall, "the summary states no overall totals"
    assert [int(n) for n in overall.groups()] == [
        len(ROWS),
        sum(row.status == "covered" for row in ROWS),
        len([row for row in ROWS if row.new_plugin]),
        sum(row.status == "trainer" for row in ROWS),
        sum(row.status == "gap" for row in ROWS),
    ]


def test_the_page_is_in_the_site_nav_and_the_readme():
    assert "field.md" in (ROOT / "mkdocs.yml").read_text()
    assert "](docs/field.md)" in (ROOT / "README.md").read_text()
