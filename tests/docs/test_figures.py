"""The figures the README and the docs state stay true (``docs/hooks/figures.py``): every ``<!-- figure: NAME -->``
is a known figure whose committed value is the one computed from the repository; the README's test count is checked
by every run of the whole suite and by no run of a subset; the counts written in prose (verl's estimators and loss
modes) are verl's; every install command takes the lock."""

from __future__ import annotations

import importlib.util
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def figures():
    spec = importlib.util.spec_from_file_location("docs_hooks_figures", ROOT / "docs" / "hooks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_figure_is_known_and_equals_what_it_is_computed_from():
    module = figures()
    used = {name for path in module.files() for name, _ in module.figures_in(path.read_text())}
    assert {"tests", "loss_step_ratio", "packed_gae_speedup"} <= used
    assert used <= module.KNOWN, f"unknown figures: {sorted(used - module.KNOWN)}"
    assert module.stale() == [], (
        "stale figures (file, name, committed, computed); rewrite: python docs/hooks/figures.py"
    )


def test_the_readme_states_the_test_count_as_a_figure():
    module = figures()
    assert isinstance(module.readme_test_count(), int)
    readme = (ROOT / "README.md").read_text()
    assert not re.search(r"\b\d{1,2},\d{3} tests pass", readme), "the test count outside its figure drifts"


def test_a_figure_is_rewritten_in_place_and_its_neighbours_are_left_alone():
    module = figures()
    text = "a <!-- figure: tests -->1<!-- /figure --> b <!-- figure: check_share -->2 %<!-- /figure -->"
    assert module.rewritten(text, {"tests": "7,000"}) == text.replace("-->1<", "-->7,000<")
    assert module.figures_in(text) == [("tests", "1"), ("check_share", "2 %")]


def _config(*args, invocation_dir=ROOT, keyword="", markexpr="", ignore=None, ignore_glob=None):
    return types.SimpleNamespace(
        args=list(args),
        invocation_params=types.SimpleNamespace(dir=invocation_dir),
        option=types.SimpleNamespace(keyword=keyword, markexpr=markexpr, ignore=ignore, ignore_glob=ignore_glob),
    )


@pytest.mark.parametrize(
    ("config", "deselected", "whole"),
    [
        (_config("tests"), 0, True),  # `python -m pytest -q`: testpaths
        (_config(str(ROOT / "tests")), 0, True),
        (_config(".", invocation_dir=ROOT / "tests"), 0, True),  # run from inside tests/
        (_config("tests/cli"), 0, False),
        (_config("tests/cli", "tests/docs"), 0, False),
        (_config("tests/docs/test_figures.py::test_the_readme_states_the_test_count_as_a_figure"), 0, False),
        (_config("tests", keyword="figures"), 0, False),
        (_config("tests", markexpr="not slow"), 0, False),
        (_config("tests", ignore=["tests/bench"]), 0, False),
        (_config("tests"), 3, False),  # --deselect, --lf, --sw
        (_config("."), 0, False),  # the repository root holds other tests (the example plugin's)
    ],
)
def test_only_a_run_of_the_whole_suite_compares_the_test_count(config, deselected, whole):
    assert figures().whole_suite(config, deselected) is whole


def test_a_count_other_than_the_readme_figure_fails_a_whole_run_and_says_how_to_rewrite_it():
    module = figures()
    stated = module.readme_test_count()
    assert module.test_count_problem(stated) is None
    problem = module.test_count_problem(stated + 1, skipped_modules=2)
    assert f"{stated:,}" in problem and f"{stated + 1:,}" in problem
    assert "python docs/hooks/figures.py tests" in problem and "2 test modules were skipped" in problem

    check = module.ReadmeTestCount()
    items = [object()] * (stated + 1)
    session = types.SimpleNamespace(config=_config("tests"), items=items, exitstatus=0)
    check.pytest_collection_finish(session)
    check.pytest_sessionfinish(session, exitstatus=0)
    assert session.exitstatus == 1 and check.problem == module.test_count_problem(stated + 1)

    subset = types.SimpleNamespace(config=_config("tests/cli"), items=items, exitstatus=0)
    quiet = module.ReadmeTestCount()
    quiet.pytest_collection_finish(subset)
    quiet.pytest_sessionfinish(subset, exitstatus=0)
    assert subset.exitstatus == 0 and quiet.problem is None


NUMBERS = {"ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16}


def test_the_verl_page_counts_verls_estimators_and_loss_modes():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    page = (ROOT / "docs" / "verl.md").read_text()
    estimators = re.search(r"verl's (\d+) estimators", page)
    modes = re.search(r"verl's (\w+) loss modes", page)
    assert estimators and modes, "docs/verl.md states how many estimators and loss modes verl has"
    assert int(estimators.group(1)) == len(core_algos.AdvantageEstimator)
    verls_own = set(core_algos.POLICY_LOSS_REGISTRY) - {"lossplug"}  # lossplug registers itself when verl loads it
    assert NUMBERS.get(modes.group(1), modes.group(1)) == len(verls_own), sorted(verls_own)


def test_every_install_command_in_the_docs_takes_the_lock():
    """mkdocs.yml's comment once named constraints/cpu.txt (the hand-set pins, not the lock)."""
    texts = {path: (ROOT / path).read_text() for path in ("README.md", "CONTRIBUTING.md", "mkdocs.yml")}
    texts |= {p.relative_to(ROOT).as_posix(): p.read_text() for p in (ROOT / "docs").glob("*.md")}
    constraints = [
        (path, m.group(1))
        for path, text in texts.items()
        for m in re.finditer(r"pip install[^\n]*?-c ([\w./-]+)", text)
    ]
    assert len(constraints) >= 5
    assert [(path, c) for path, c in constraints if c != "constraints/cpu-lock.txt"] == []
