"""examples/lossplug-example-plugin: a real, separately packaged third-party plugin.

It is pip-installed (no network: --no-deps --no-build-isolation --no-index) into a temporary directory, never into
the environment running the tests, so nothing here depends on CI having installed it and no other test sees its
gate. Tests that run in this process put that directory on sys.path; the fresh-process test gets it on PYTHONPATH.
"""

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import lossplug
from lossplug.cli import app
from lossplug.testing import check_plugin, install_isolated

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lossplug-example-plugin"
DIST = "lossplug-example-plugin 0.1.0"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The example, pip-installed into a temporary target; (target dir, env for subprocesses, seconds it took)."""
    target = tmp_path_factory.mktemp("example") / "site"
    start = time.perf_counter()
    try:
        env = install_isolated(EXAMPLE, target)
    except RuntimeError as err:
        pytest.fail(
            f"could not pip-install the example plugin into a temporary directory (this needs setuptools "
            f"in the test interpreter); install it instead with `pip install -e {EXAMPLE}`:\n{err}"
        )
    return target, env, time.perf_counter() - start


@pytest.fixture
def on_path(installed, monkeypatch, fresh_registry):
    target = installed[0]
    monkeypatch.syspath_prepend(str(target))
    monkeypatch.delenv("LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("LOSSPLUG_PLUGINS", raising=False)
    yield target
    sys.modules.pop("lossplug_example_plugin", None)


def test_the_example_is_its_own_distribution_registered_only_by_entry_point():
    import tomllib

    meta = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "lossplug-example-plugin"
    assert any(d.startswith("lossplug") for d in meta["project"]["dependencies"])
    assert meta["project"]["entry-points"]["lossplug"] == {"tanh_clip": "lossplug_example_plugin"}
    assert "tanh_clip" not in lossplug.registry().plugins["gate"]  # not built in, not installed here


def test_install_is_quick_and_leaves_the_checkout_clean(installed):
    target, _, seconds = installed
    assert (target / "lossplug_example_plugin" / "__init__.py").is_file()
    assert list(target.glob("lossplug_example_plugin-0.1.0.dist-info/entry_points.txt"))
    assert not list(EXAMPLE.glob("*.egg-info")) and not (EXAMPLE / "build").exists()
    assert seconds < 60, f"pip install took {seconds:.1f}s"


def test_lossplug_list_shows_it_with_its_distribution(on_path):
    data = json.loads(CliRunner().invoke(app, ["list", "--kind", "gate", "--json"]).output)
    (row,) = [r for r in data["plugins"] if r["name"] == "tanh_clip"]
    assert row["distribution"] == DIST
    assert row["source"] == f"entry point 'tanh_clip = lossplug_example_plugin' of distribution '{DIST}'"
    assert row["role"] == "update" and row["requires"] == ["old_logp"]
    assert row["params"]["eps_high"]["default"] == 0.28
    text = CliRunner().invoke(app, ["list", "--kind", "gate"], env={"COLUMNS": "200"}).output
    assert f"from {DIST}" in text
    show = CliRunner().invoke(app, ["show", "tanh_clip"], env={"COLUMNS": "200"}).output
    assert "A ≥ 0:  J = A · min(r, 1 + ε_high · tanh((r − 1) / ε_high))" in show


def test_it_passes_the_conformance_kit_and_runs_in_a_recipe(on_path):
    report = check_plugin("tanh_clip")
    assert report.ok, str(report)
    assert report.source.endswith(f"of distribution '{DIST}'")
    import torch

    batch = lossplug.PolicyBatch(
        logp=torch.tensor([[-1.0, -0.2]], requires_grad=True),
        old_logp=torch.tensor([[-1.0, -1.2]]),
        action_mask=torch.ones(1, 2, dtype=torch.bool),
        advantage=torch.tensor([1.0]),
    )
    result = lossplug.policy_loss(batch, {"gates": [{"name": "tanh_clip", "eps_high": 0.2}], "reduction": "token"})
    (grad,) = torch.autograd.grad(result.loss, batch.logp)
    # token 0 at ratio 1: the policy gradient A; token 1 at ratio e ≈ 2.7: damped smoothly, not cut to 0
    assert grad[0, 0].item() == pytest.approx(-0.5)
    assert 0 < -grad[0, 1].item() < 0.01
    assert "tanh_clip/saturated_frac" in result.metrics


def test_a_fresh_process_finds_it_through_pytest_and_the_entry_point(installed, tmp_path):
    """A plugin author's view: the example's own 2-line conformance test, `--lossplug-conformance`, and the
    marker, in a new interpreter that knows the example only through its installed metadata."""
    _, env, _ = installed
    (tmp_path / "test_author.py").write_text((EXAMPLE / "tests" / "test_conformance.py").read_text())
    (tmp_path / "test_marker.py").write_text(
        textwrap.dedent("""
        import pytest

        @pytest.mark.lossplug_conformance("tanh_clip", params={"eps_low": 0.1}, skip={"docstring": "demo"})
        def test_marked(lossplug_check):
            lossplug_check()
    """)
    )
    env = {**env, "PYTEST_ADDOPTS": "", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            "--lossplug-conformance",
            "tanh_clip,no_such_gate",
            "-rfs",
            "test_author.py",
            "test_marker.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert "unrecognized arguments: --lossplug-conformance" not in out, (
        "lossplug's pytest11 entry point is not installed: reinstall lossplug (pip install -e .)\n" + out
    )
    from lossplug.testing.kit import CHECKS

    n = sum("gate" in c.kinds for c in CHECKS.values())  # checks that apply to a gate
    assert n == 12
    assert f"1 failed, {3 * n - 1} passed, 1 skipped" in out, out
    assert "lossplug-conformance[no_such_gate]" in out and "unknown gate plugin 'no_such_gate'" in out
    assert proc.returncode == 1


def _code(text: str) -> list[str]:
    """Code lines without comments, blank lines and the module docstring."""
    import ast
    import io
    import tokenize

    tree = ast.parse(text)
    if ast.get_docstring(tree):
        text = "\n".join(text.splitlines()[tree.body[0].end_lineno :])
    out = []
    for line in text.splitlines():
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(line + "\n").readline) if t.type == tokenize.COMMENT]
        if tokens:
            line = line[: tokens[0].start[1]]
        if line.strip():
            out.append(line.rstrip())
    return out


def test_the_readme_shows_the_real_plugin_in_30_lines_and_it_conforms():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Write a gate plugin in 30 lines", 1)[1].split("\n## ", 1)[0]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    source = (EXAMPLE / "lossplug_example_plugin" / "__init__.py").read_text()
    assert [row.strip() for row in _code(block)] == [row.strip() for row in _code(source) if row.strip()]
    assert len(_code(block)) <= 30
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    report = check_plugin(namespace["tanh_clip"])
    assert report.ok, str(report)
    tests_block = section.split("```python\n", 2)[2].split("```", 1)[0]
    assert _code(tests_block) == _code((EXAMPLE / "tests" / "test_conformance.py").read_text())
    assert len(tests_block.strip().splitlines()) == 3
