"""lossplug.extras: a helper that needs an optional package fails with one lossplug error naming the package and the
``pip install 'lossplug[EXTRA]'`` line, with a short traceback (no chained ModuleNotFoundError)."""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys
import traceback
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

import lossplug
from lossplug.contracts import LossplugError, MissingExtra
from lossplug.extras import EXTRA_MODULES, EXTRA_OF, require, requires_extra

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(extra: str) -> set[str]:
    """The top-level modules ``pip install 'lossplug[extra]'`` brings, from pyproject and the installed metadata."""
    modules_of: dict[str, set[str]] = {}
    for module, dists in metadata.packages_distributions().items():
        for dist in dists:
            modules_of.setdefault(_canonical(dist), set()).add(module)
    pending = [Requirement(spec) for spec in EXTRAS[extra]]
    seen: set[str] = set()
    while pending:
        req = pending.pop()
        if _canonical(req.name) == "lossplug":
            pending += [Requirement(spec) for sub in req.extras for spec in EXTRAS[sub]]
            continue
        if _canonical(req.name) in seen:
            continue
        seen.add(_canonical(req.name))
        for spec in metadata.requires(req.name) or []:
            sub = Requirement(spec)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}):
                pending.append(sub)
    return set().union(*(modules_of.get(dist, set()) for dist in seen))


@pytest.mark.parametrize("extra", sorted(EXTRA_MODULES))
def test_each_extra_exists_and_installs_the_modules_it_is_named_for(extra):
    assert extra in EXTRAS, f"pyproject.toml has no extra '{extra}'"
    try:
        closure = _closure(extra)
    except metadata.PackageNotFoundError as err:
        pytest.skip(f"the extra '{extra}' is not installed here: {err}")
    assert set(EXTRA_MODULES[extra]) <= closure


def test_every_module_names_one_extra():
    assert EXTRA_OF["trl"] == "trl" and EXTRA_OF["transformers"] == "trl" and EXTRA_OF["matplotlib"] == "plot"
    assert EXTRA_OF["verl"] == "verl"
    assert set(EXTRA_OF) == {m for modules in EXTRA_MODULES.values() for m in modules}


def _hide(monkeypatch, *modules):
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # `import module` raises, as where it is not installed


def test_require_names_the_missing_package_and_the_pip_line(monkeypatch):
    _hide(monkeypatch, "matplotlib")
    with pytest.raises(MissingExtra) as info:
        require("plot", "my_plot")
    err = info.value
    assert str(err) == "my_plot needs matplotlib, which is not installed: pip install 'lossplug[plot]'"
    assert (err.package, err.extra, err.name) == ("matplotlib", "plot", "matplotlib")
    # one lossplug error that old `except ImportError` code still catches
    assert isinstance(err, LossplugError) and isinstance(err, ModuleNotFoundError)
    assert lossplug.MissingExtra is MissingExtra
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)


def test_require_passes_when_everything_is_installed():
    require("trl", "anything")
    require("plot", "anything")


def test_a_decorated_helper_fails_before_it_runs_with_a_short_traceback(monkeypatch):
    ran = []

    @requires_extra("trl")
    def build(x: int) -> int:
        ran.append(x)
        return x

    assert build(3) == 3 and build.__name__ == "build"
    _hide(monkeypatch, "datasets")
    with pytest.raises(MissingExtra) as info:
        build(4)
    assert ran == [3]
    assert str(info.value) == (
        f"{__name__}.test_a_decorated_helper_fails_before_it_runs_with_a_short_traceback.<locals>.build needs "
        "datasets, which is not installed: pip install 'lossplug[trl]'"
    )
    text = "".join(traceback.format_exception(info.value))
    assert "During handling" not in text and "direct cause" not in text
    assert len(traceback.extract_tb(info.tb)) <= 3  # the caller, the wrapper, require


def test_an_import_that_fails_inside_the_helper_is_named_too():
    @requires_extra("verl")
    def build() -> None:
        raise ModuleNotFoundError("No module named 'omegaconf.nodes'", name="omegaconf.nodes")

    with pytest.raises(MissingExtra, match=r"needs omegaconf, which is not installed: pip install 'lossplug\[verl\]'"):
        build()


def test_other_import_errors_pass_through_untouched():
    @requires_extra("trl")
    def build() -> None:
        raise ModuleNotFoundError("No module named 'my_reward_model'", name="my_reward_model")

    with pytest.raises(ModuleNotFoundError) as info:
        build()
    assert not isinstance(info.value, MissingExtra)


def test_an_unknown_extra_is_a_programming_error():
    with pytest.raises(KeyError, match="no_such_extra"):
        require("no_such_extra", "x")
