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


# ---------------------------------------------------------------------------------------------------------------------
# "This year's papers" and "What users ask for": five columns each — what, what it computes or asked, the recipe that
# does it, a status, and the test that proves it (or why it cannot run yet)

ASKED, PAPERS = "What users ask for", "This year's papers"
ISSUE_LINK = re.compile(
    r"https://github\.com/(huggingface/trl|verl-project/verl|OpenRLHF/OpenRLHF)/(?:issues|pull)/(\d+)"
)
#: the requests issue 31 names: each has its row
REQUESTS = {
    "huggingface/trl": {4525, 7291, 7298, 4543, 6789, 5226},
    "verl-project/verl": {479, 1654, 2540, 3683, 7244, 5252},
    "OpenRLHF/OpenRLHF": {1184},
}
#: the papers issue 31 names (arXiv ids; UP-GRPO and TreeRL/TreePO have none): each has its row
ARXIV = {"2510.06062", "2510.18927", "2506.14758", "2504.19599", "2601.22801", "2508.03772", "2604.06159"}
ARXIV |= {"2505.16826", "2505.11821", "2510.14967", "2606.30406"}
STATUSES = ("runs", "partly", "cannot yet")
#: what a row's recipe is merged onto (the stages it names replace these), as the framework rows onto their base
BASE = {"advantage": "grpo", "gates": ["ppo_clip"], "reduction": "token"}


def table_rows(section: str, header: str) -> list[list[str]]:
    body = SECTIONS[section][1]
    lines = [line for line in body.splitlines() if line.startswith("| ")]
    assert lines and lines[0].startswith(header), f"'{section}': the table has moved or lost its header"
    return [cells(line) for line in lines[1:]]


def asked_rows() -> list[list[str]]:
    return table_rows(ASKED, "| request (issue) |")


def paper_rows() -> list[list[str]]:
    return table_rows(PAPERS, "| paper |")


def test_every_request_the_field_makes_has_a_row():
    assert ASKED in SECTIONS, f"docs/field.md has no '## {ASKED}' section"
    found: dict[str, set[int]] = {}
    for row in asked_rows():
        for repo, number in ISSUE_LINK.findall(row[0]):
            found.setdefault(repo, set()).add(int(number))
    for repo, numbers in REQUESTS.items():
        assert numbers <= found.get(repo, set()), f"{repo}: no row for {sorted(numbers - found.get(repo, set()))}"


def test_every_paper_has_a_row_and_each_plugin_cites_its_paper():
    assert PAPERS in SECTIONS, f"docs/field.md has no '## {PAPERS}' section"
    rows = paper_rows()
    found = {a for row in rows for a in re.findall(r"arXiv:(\d{4}\.\d{5})", row[0])}
    assert ARXIV <= found, f"no row for arXiv {sorted(ARXIV - found)}"
    assert any("UP-GRPO" in row[0] for row in rows) and any("TreeRL" in row[0] for row in rows)
    from lossplug.cli.describe import citations

    reg = lossplug.registry().plugins
    for row in rows:
        arxiv = re.findall(r"arXiv:(\d{4}\.\d{5})", row[0])
        for text in re.findall(r"`(\{[^`]+\})`", row[2]):
            override = yaml.safe_load(text)
            new = plugin_names(lossplug.Recipe.model_validate({**BASE, **override}), tuple(override))
            new -= BEFORE_THIS_YEAR
            for name in new:  # `lossplug show NAME` prints these citations
                cited = " ".join(c for plugins in reg.values() if name in plugins for c in citations(plugins[name]))
                assert all(a in cited for a in arxiv[:1]), f"{name}: its docstring does not cite arXiv:{arxiv[0]}"


#: plugins a paper row may use besides its own (the surrounding recipe)
BEFORE_THIS_YEAR = {"grpo", "ppo_clip", "gae", "token", "response", "sequence_sum", "reinforce", "icepop", "mix"}


def check_row(row: list[str], where: str) -> None:
    first, what, answer, status, proof = row
    assert len(what) > 20, f"{where}: say what it computes or what was asked"
    assert status in STATUSES, f"{where}: status must be one of {STATUSES}, got {status!r}"
    if status == "cannot yet":
        assert len(proof) > 40, f"{where}: say why it cannot run yet and what it waits on"
        return
    recipes = re.findall(r"`(\{[^`]+\})`", answer + " " + proof)
    assert recipes, f"{where}: a {status!r} row shows the recipe that does it"
    tests = re.findall(r"`(tests/[\w/]+\.py)(?:::\w+)?`", proof)
    assert tests, f"{where}: name the test that proves it"
    for path in tests:
        assert (ROOT / path).is_file(), f"{where}: {path} does not exist"
    for text in recipes:
        override = yaml.safe_load(text)
        user = re.search(r"name: (user_\w+)", text)
        if user:  # a user's own plugin (the TRL #4525 row): the test named registers it from a package of its own
            assert any(f'"{user.group(1)}"' in (ROOT / path).read_text() for path in tests), where
            continue
        merged = {**BASE, **override}
        recipe = lossplug.Recipe.model_validate({key: value for key, value in merged.items() if value is not None})
        unknown = {name for name in plugin_names(recipe, tuple(override)) if not registered(name)}
        assert not unknown, f"{where}: {sorted(unknown)} not registered"


@pytest.mark.parametrize("index", range(len(asked_rows()) if ASKED in SECTIONS else 0))
def test_each_request_names_a_recipe_that_builds_and_its_proof_or_says_why_not(index):
    row = asked_rows()[index]
    assert ISSUE_LINK.search(row[0]), f"'{ASKED}' row {index + 1}: link the issue or pull request"
    check_row(row, f"'{ASKED}' row {index + 1} ({row[0][:40]}…)")


@pytest.mark.parametrize("index", range(len(paper_rows()) if PAPERS in SECTIONS else 0))
def test_each_paper_names_a_recipe_that_builds_and_its_proof_or_says_why_not(index):
    row = paper_rows()[index]
    check_row(row, f"'{PAPERS}' row {index + 1} ({row[0][:40]}…)")
