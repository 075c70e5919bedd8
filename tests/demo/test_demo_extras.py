"""The demo's helpers without their extra: one lossplug error naming the package and `pip install 'lossplug[...]'`,
raised before anything is built or trained (TRL and matplotlib are hidden here, not uninstalled)."""

from __future__ import annotations

import sys

import pytest

import lossplug.demo as demo
from lossplug.contracts import MissingExtra


def _without(monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises, as where it is not installed


@pytest.mark.parametrize("hidden", ["trl", "transformers", "datasets", "matplotlib"])
def test_run_demo_and_run_compare_name_the_demo_extra(monkeypatch, tmp_path, hidden):
    _without(monkeypatch, hidden)
    with pytest.raises(MissingExtra) as info:
        demo.run_demo("grpo", demo.FAST, tmp_path / "run", quiet=True)
    assert str(info.value) == (
        f"lossplug.demo.run_demo needs {hidden}, which is not installed: pip install 'lossplug[demo]'"
    )
    with pytest.raises(MissingExtra, match=r"run_compare needs .*pip install 'lossplug\[demo\]'"):
        demo.run_compare(["grpo"], demo.FAST, tmp_path / "cmp", quiet=True)
    assert not (tmp_path / "run").exists() and not (tmp_path / "cmp").exists()


@pytest.mark.parametrize(
    ("figure", "args"),
    [
        (demo.plot_run, ([], "curves.png")),
        (demo.run_figure, ([],)),
        (demo.plot_compare, ({}, "compare.png")),
        (demo.compare_figure, ({},)),
    ],
)
def test_the_figures_name_the_plot_extra(monkeypatch, tmp_path, figure, args):
    _without(monkeypatch, "matplotlib")
    with pytest.raises(MissingExtra) as info:
        figure(*args)
    assert str(info.value).endswith("needs matplotlib, which is not installed: pip install 'lossplug[plot]'")
    assert info.value.__cause__ is None and (info.value.__context__ is None or info.value.__suppress_context__)
