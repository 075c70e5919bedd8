"""Plugin isolation, with real installed distributions (``.dist-info`` + ``entry_points.txt`` on ``sys.path``).

``tests/core/test_plugin_registry.py`` already covers import errors, bad hook signatures, register hooks that raise,
non-plugin objects, duplicates and the basic disable / allow-list switches. This file adds what it does not:

* a third-party plugin raising inside a **per-batch** hook (``lossplug_validate_batch``, ``lossplug_extra_metrics``)
  is a :class:`PluginError` naming the entry point and its distribution, telling how to leave it out — and leaving
  it out with the allow-list makes every recipe run again;
* the exact semantics of ``LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD`` values and of the ``LOSSPLUG_PLUGINS`` allow-list;
* a broken distribution next to a working one: the working one's plugins and every built-in still run;
* a hook-name typo, an entry point without any hook, and a plugin module calling ``sys.exit`` at import are each
  reported as broken plugins instead of being ignored or ending the process.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

import lossplug
from lossplug import PluginError, PolicyBatch, Recipe, RecipeError
from lossplug.plugin_registry import LossplugPluginWarning

GATE = """
import lossplug


@lossplug.gate("{gate}")
def g(inp, p):
    \"\"\"A · logp.\"\"\"
    return lossplug.GateOutput(objective=inp.advantage * inp.logp)


@lossplug.hookimpl
def lossplug_register_gates(register):
    register(g)
"""

REGULARIZER = """
import lossplug


@lossplug.regularizer("{name}")
def r(inp, p):
    \"\"\"(logp − old_logp)².\"\"\"
    return (inp.logp - inp.old_logp).square()


@lossplug.hookimpl
def lossplug_register_regularizers(register):
    register(r)
"""

RAISING_REGULARIZER = """
import lossplug


@lossplug.regularizer("{name}")
def r(inp, p):
    \"\"\"A regularizer with a bug.\"\"\"
    raise RuntimeError("reference model not loaded")


@lossplug.hookimpl
def lossplug_register_regularizers(register):
    register(r)
"""

RAISING_VALIDATOR = """
import lossplug


@lossplug.hookimpl
def lossplug_validate_batch(batch, recipe):
    return {}["needs_a_key_nobody_set"]
"""

RAISING_METRICS = """
import lossplug


@lossplug.hookimpl
def lossplug_extra_metrics(batch, objective, recipe):
    raise RuntimeError("metrics server unreachable")
"""


def rebuild(monkeypatch=None, **env):
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    lossplug.plugin_registry.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LossplugPluginWarning)
        return lossplug.registry()


def batch():
    return PolicyBatch(
        logp=torch.full((2, 3), -1.0, requires_grad=True),
        old_logp=torch.full((2, 3), -1.0),
        action_mask=torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool),
        advantage=torch.tensor([1.0, -1.0]),
    )


def gates():
    return set(lossplug.registry().plugins["gate"])


# ---------------------------------------------------------------------------------------------------------------------
# Per-batch hooks


def test_a_validator_that_raises_names_its_entry_point_and_distribution_and_the_way_out(site, monkeypatch):
    site.add("lpy-strict", "lpy_strict", RAISING_VALIDATOR)
    site.add("lpy-gates", "lpy_gates", GATE.format(gate="lpy_gate"))
    rebuild()
    with pytest.raises(PluginError) as info:
        lossplug.policy_loss(batch(), "dapo")
    msg = str(info.value)
    assert "entry point 'lpy_strict = lpy_strict' of distribution 'lpy-strict 0.1'" in msg
    assert "lossplug_validate_batch raised KeyError: 'needs_a_key_nobody_set'" in msg
    assert "LOSSPLUG_PLUGINS" in msg
    assert isinstance(info.value.__cause__, KeyError)  # the plugin author keeps the original traceback
    # leaving the broken distribution out with the allow-list: everything runs again
    rebuild(monkeypatch, LOSSPLUG_PLUGINS="lpy-gates")
    assert torch.isfinite(lossplug.policy_loss(batch(), "dapo").loss)
    assert torch.isfinite(lossplug.policy_loss(batch(), {"gates": ["lpy_gate"], "reduction": "token"}).loss)


def test_a_metrics_hook_that_raises_names_its_distribution_and_metrics_off_skips_it(site):
    site.add("lpy-metrics", "lpy_metrics", RAISING_METRICS)
    rebuild()
    with pytest.raises(
        PluginError,
        match="distribution 'lpy-metrics 0.1'.*lossplug_extra_metrics raised RuntimeError: metrics server unreachable",
    ):
        lossplug.policy_loss(batch(), "dapo")
    result = lossplug.policy_loss(batch(), "dapo", metrics=False)  # metric hooks only run when metrics are asked for
    assert torch.isfinite(result.loss)


def test_with_validate_off_no_plugin_validator_runs(site):
    site.add("lpy-strict", "lpy_strict", RAISING_VALIDATOR)
    rebuild()
    b = PolicyBatch.unchecked(**batch().fields())
    assert torch.isfinite(lossplug.policy_loss(b, "dapo", validate="off", metrics=False).loss)


# ---------------------------------------------------------------------------------------------------------------------
# A broken distribution next to a working one


def test_a_broken_distribution_does_not_take_down_a_working_one(site):
    site.add("lpy-broken", "lpy_broken", "import a_module_that_is_not_installed\n")
    site.add("lpy-gates", "lpy_gates", GATE.format(gate="lpy_gate"))
    lossplug.plugin_registry.reset()
    with pytest.warns(LossplugPluginWarning, match="lpy-broken 0.1': failed to import: ModuleNotFoundError"):
        reg = lossplug.registry()
    assert "lpy_gate" in reg.plugins["gate"]
    assert torch.isfinite(lossplug.policy_loss(batch(), {"gates": ["lpy_gate"], "reduction": "token"}).loss)
    for preset in ("dapo", "grpo", "dr_grpo"):  # every built-in recipe is unaffected
        Recipe.preset(preset)
    # the broken one is named wherever its absence shows
    with pytest.raises(
        RecipeError, match="failed to load: entry point 'lpy_broken = lpy_broken' of distribution 'lpy-broken 0.1'"
    ):
        Recipe.model_validate({"gates": ["lpy_missing_gate"], "reduction": "token"})
    assert any("lpy-broken" in str(b) for b in lossplug.registry().broken)


def regularized(name: str) -> dict:
    return {"gates": ["ppo_clip"], "reduction": "token", "regularizers": [{"name": name, "coef": 0.1}]}


def test_a_third_party_regularizer_that_raises_is_named_and_the_allow_list_leaves_it_out(site, monkeypatch):
    # the fourth plugin kind is isolated like the others: a regularizer's bug names its distribution, and leaving
    # that distribution out keeps a working regularizer distribution and the built-in regularizers running
    site.add("lpy-bad-reg", "lpy_bad_reg", RAISING_REGULARIZER.format(name="lpy_bad_reg"))
    site.add("lpy-reg", "lpy_reg", REGULARIZER.format(name="lpy_reg"))
    rebuild()
    assert {"lpy_bad_reg", "lpy_reg"} <= set(lossplug.registry().plugins["regularizer"])
    with pytest.raises(
        PluginError,
        match=r"recipe\.regularizers\[0\] \(lpy_bad_reg, from entry point 'lpy_bad_reg = lpy_bad_reg' of "
        r"distribution 'lpy-bad-reg 0\.1'\) raised RuntimeError: reference model not loaded",
    ):
        lossplug.policy_loss(batch(), regularized("lpy_bad_reg"))
    assert torch.isfinite(lossplug.policy_loss(batch(), regularized("lpy_reg")).loss)
    rebuild(monkeypatch, LOSSPLUG_PLUGINS="lpy-reg")
    assert "lpy_bad_reg" not in lossplug.registry().plugins["regularizer"]
    assert torch.isfinite(lossplug.policy_loss(batch(), regularized("lpy_reg")).loss)
    ref = dict(batch().fields(), ref_logp=torch.full((2, 3), -1.2))
    assert torch.isfinite(lossplug.policy_loss(PolicyBatch(**ref), regularized("kl")).loss)  # built-ins unaffected
    with pytest.raises(RecipeError, match="unknown regularizer plugin 'lpy_bad_reg'"):
        Recipe.model_validate(regularized("lpy_bad_reg"))


# ---------------------------------------------------------------------------------------------------------------------
# LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD and LOSSPLUG_PLUGINS


@pytest.mark.parametrize(
    "value,disabled",
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("yes", True),
        (" 1 ", True),
        ("0", False),
        ("", False),
        ("no", False),
    ],
)
def test_disable_autoload_values(site, monkeypatch, value, disabled):
    site.add("lpy-gates", "lpy_gates", GATE.format(gate="lpy_gate"))
    rebuild(monkeypatch, LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD=value)
    assert ("lpy_gate" not in gates()) is disabled
    assert "ppo_clip" in gates()  # built-ins are never entry points


def test_disable_wins_over_the_allow_list_and_spares_in_process_plugins(site, monkeypatch):
    site.add("lpy-gates", "lpy_gates", GATE.format(gate="lpy_gate"))

    class InProcess:
        @lossplug.hookimpl
        def lossplug_register_gates(self, register):
            @lossplug.gate("lpy_in_process")
            def g(inp, p):
                """A · logp."""
                return lossplug.GateOutput(objective=inp.advantage * inp.logp)

            register(g)

    plugin = InProcess()
    lossplug.register_plugin(plugin, "in-process")
    try:
        rebuild(monkeypatch, LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD="1", LOSSPLUG_PLUGINS="lpy-gates")
        assert "lpy_gate" not in gates() and "lpy_in_process" in gates()
        rebuild(monkeypatch, LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD=None, LOSSPLUG_PLUGINS="someone-else")
        assert "lpy_gate" not in gates() and "lpy_in_process" in gates()  # the allow-list is about entry points
    finally:
        lossplug.unregister_plugin(plugin)


def test_allow_list_parsing(site, monkeypatch):
    site.add("lpy-a", "lpy_a", GATE.format(gate="lpy_gate_a"))
    site.add("lpy-b", "lpy_b", GATE.format(gate="lpy_gate_b"))
    rebuild(monkeypatch, LOSSPLUG_PLUGINS=" lpy-a , lpy_b ,, ")  # a distribution and an entry-point name
    assert {"lpy_gate_a", "lpy_gate_b"} <= gates()
    rebuild(monkeypatch, LOSSPLUG_PLUGINS="")  # set but empty: no entry point at all
    assert not {"lpy_gate_a", "lpy_gate_b"} & gates()
    assert "ppo_clip" in gates()
    rebuild(monkeypatch, LOSSPLUG_PLUGINS="lpy-A")  # names are matched exactly
    assert "lpy_gate_a" not in gates()


def test_an_excluded_broken_distribution_is_never_imported(site, monkeypatch):
    site.add("lpy-broken", "lpy_broken", "raise RuntimeError('imported!')\n")
    site.add("lpy-gates", "lpy_gates", GATE.format(gate="lpy_gate"))
    monkeypatch.setenv("LOSSPLUG_PLUGINS", "lpy-gates")
    lossplug.plugin_registry.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LossplugPluginWarning)
        reg = lossplug.registry()
    assert not reg.broken and "lpy_broken" not in sys.modules


# ---------------------------------------------------------------------------------------------------------------------
# Mistakes that used to pass silently (or end the process)


def test_a_hook_name_typo_is_reported(site):
    site.add(
        "lpy-typo",
        "lpy_typo",
        """
import lossplug

@lossplug.hookimpl
def lossplug_register_gate(register):
    pass
""",
    )
    lossplug.plugin_registry.reset()
    with pytest.warns(
        LossplugPluginWarning,
        match="lpy-typo 0.1': implements unknown hook\\(s\\) "
        "'lossplug_register_gate' \\(did you mean 'lossplug_register_gates'\\?\\)",
    ):
        lossplug.registry()


def test_an_entry_point_without_hooks_is_reported(site):
    site.add("lpy-nohooks", "lpy_nohooks", "VALUE = 1\n")
    lossplug.plugin_registry.reset()
    with pytest.warns(LossplugPluginWarning, match="lpy-nohooks 0.1': implements no lossplug hook"):
        lossplug.registry()


def test_a_plugin_calling_sys_exit_at_import_is_contained(site):
    site.add("lpy-exit", "lpy_exit", "raise SystemExit(3)\n")
    lossplug.plugin_registry.reset()
    with pytest.warns(LossplugPluginWarning, match="lpy-exit 0.1'.*SystemExit"):
        lossplug.registry()


def test_an_allow_list_naming_nothing_installed_is_reported(site, monkeypatch):
    monkeypatch.setenv("LOSSPLUG_PLUGINS", "lpy-not-installed")
    lossplug.plugin_registry.reset()
    with pytest.warns(LossplugPluginWarning, match="LOSSPLUG_PLUGINS names 'lpy-not-installed', but no installed"):
        lossplug.registry()
