"""The adapters without their trainer: one lossplug error naming the package and `pip install 'lossplug[...]'`, with
a short traceback (the trainer is hidden here, not uninstalled)."""

from __future__ import annotations

import importlib
import sys
import traceback

import pytest

from lossplug.contracts import MissingExtra


@pytest.mark.parametrize("name", ["attach", "LossplugGRPOTrainer"])
def test_the_trl_adapter_without_trl_names_the_trl_extra(monkeypatch, name):
    import lossplug.adapters.trl as adapter

    monkeypatch.delitem(vars(adapter), name, raising=False)  # resolved by the module's __getattr__, not a cache
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` raises, as where it is not installed
    with pytest.raises(MissingExtra) as info:
        getattr(adapter, name)
    assert str(info.value) == (
        f"lossplug.adapters.trl.{name} needs trl, which is not installed: pip install 'lossplug[trl]'"
    )
    text = "".join(traceback.format_exception(info.value))
    assert "During handling" not in text and "direct cause" not in text


def test_the_trl_adapter_module_itself_needs_no_trl(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)
    import lossplug.adapters.trl as adapter

    assert adapter.trl_equivalent  # the TRL-free part: GRPOConfig settings → recipe


@pytest.mark.parametrize("hidden", ["verl", "tensordict"])
def test_the_verl_adapter_without_verl_names_the_verl_extra(monkeypatch, hidden):
    monkeypatch.setitem(sys.modules, hidden, None)
    for module in [m for m in sys.modules if m == "lossplug.adapters.verl" or m.startswith("lossplug.adapters.verl.")]:
        monkeypatch.delitem(sys.modules, module)  # imported afresh here; the originals come back after the test
    with pytest.raises(MissingExtra) as info:
        importlib.import_module("lossplug.adapters.verl")
    assert str(info.value) == (
        f"lossplug.adapters.verl needs {hidden}, which is not installed: pip install 'lossplug[verl]'"
    )
    frames = [f.name for f in traceback.extract_tb(info.tb) if not f.filename.startswith("<frozen")]
    assert frames[-2:] == ["<module>", "require"]  # the package's first lines: nothing of verl's was imported
    assert len(frames) <= 4
