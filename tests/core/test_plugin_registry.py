"""The plugin manager: built-ins as ordinary plugins, real entry points from installed distributions, and loud but
contained failures (import errors, bad hooks, hooks that raise). A name registered by more than one distribution:
tests/core/test_plugin_name_clash.py."""

import importlib.metadata as md
import sys

import pytest
import torch

import lossplug
from lossplug import PluginError, Recipe, RecipeError
from lossplug.plugin_registry import BUILTIN_SOURCE, LossplugPluginWarning

GATE_MODULE = """
import torch
import lossplug
from pydantic import Field


class HalfParams(lossplug.Params):
    factor: float = Field(0.5, gt=0)


@lossplug.gate("{gate}", params=HalfParams, requires=("old_logp",))
def half_pg(inp, p):
    \"\"\"factor · A · logp.\"\"\"
    return lossplug.GateOutput(objective=p.factor * inp.advantage * inp.logp)


@lossplug.hookimpl
def lossplug_register_gates(register):
    register(half_pg)


@lossplug.hookimpl
def lossplug_register_presets(register):
    register("{gate}_preset", {{"gates": ["{gate}"], "reduction": "token"}}, source="test")
"""


def tiny_batch():
    return lossplug.PolicyBatch(
        logp=torch.full((2, 3), -1.0, requires_grad=True),
        old_logp=torch.full((2, 3), -1.0),
        action_mask=torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool),
        advantage=torch.tensor([1.0, -1.0]),
    )


def test_builtins_register_through_the_hooks():
    reg = lossplug.registry()
    assert reg.origin("gate", "ppo_clip") == BUILTIN_SOURCE
    assert {"grpo", "rloo"} <= set(reg.plugins["advantage"])
    assert {"response", "token", "fixed", "sequence_sum"} <= set(reg.plugins["reduction"])
    assert lossplug.plugin_manager().get_plugin("entrypoint:lossplug:gates") is sys.modules["lossplug.plugins.gates"]


def test_builtins_are_the_lossplug_distributions_own_entry_points():
    """Found like a third-party plugin (the ``lossplug`` entry-point group), one plugin module per family, each
    implementing the hook for what it defines."""
    from lossplug import plugin_discovery

    declared = {
        ep.name: ep.value
        for ep in md.entry_points(group="lossplug")
        if ep.dist is not None and ep.dist.name == "lossplug"
    }
    assert declared == {
        "shapers": "lossplug.plugins.shapers",
        "filters": "lossplug.plugins.filters",
        "advantages": "lossplug.plugins.advantages",
        "gates": "lossplug.plugins.gates",
        "reductions": "lossplug.plugins.reductions",
        "regularizers": "lossplug.plugins.regularizers",
        "presets": "lossplug.plugins.presets",
    }, "pyproject.toml's [project.entry-points.lossplug] changed: reinstall (pip install --no-deps -e .)"
    assert {ep.name for ep in plugin_discovery.select().builtin} == set(declared)
    hooks = {
        name: [c.name for c in lossplug.plugin_manager().get_hookcallers(sys.modules[value])]
        for name, value in declared.items()
    }
    assert hooks == {
        "shapers": ["lossplug_register_shapers"],
        "filters": ["lossplug_register_filters"],
        "advantages": ["lossplug_register_advantages"],
        "gates": ["lossplug_register_gates"],
        "reductions": ["lossplug_register_reductions"],
        "regularizers": ["lossplug_register_regularizers"],
        "presets": ["lossplug_register_presets"],
    }
    reg = lossplug.registry()
    for kind in ("advantage", "gate", "reduction", "regularizer"):
        assert {reg.origin(kind, name) for name in reg.plugins[kind]} == {BUILTIN_SOURCE}, kind


def test_entry_point_plugin_is_found_by_name_with_its_distribution(site):
    site.add("lpx-half", "lpx_half", GATE_MODULE.format(gate="half_pg"))
    reg = lossplug.registry()
    assert reg.origin("gate", "half_pg") == "entry point 'lpx_half = lpx_half' of distribution 'lpx-half 0.1'"
    recipe = Recipe.preset("half_pg_preset")
    batch = tiny_batch()
    result = lossplug.policy_loss(batch, recipe)
    result.loss.backward()
    # objective = ½·A·logp, token mean over 5 action tokens: (2·½·(−1) + 3·½·(+1)) / 5 = 0.1 → loss −0.1
    assert result.loss.item() == pytest.approx(-0.1)
    rows = [r for r in lossplug.list_plugins() if r["name"] == "half_pg"]
    assert rows[0]["source"].endswith("'lpx-half 0.1'") and rows[0]["params"]["factor"]["default"] == 0.5


def test_disable_autoload_and_allow_list(site, monkeypatch):
    site.add("lpx-half", "lpx_half", GATE_MODULE.format(gate="half_pg"))
    site.add("lpx-other", "lpx_other", GATE_MODULE.format(gate="other_pg"))
    monkeypatch.setenv("LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD", "1")
    lossplug.plugin_registry.reset()
    assert "half_pg" not in lossplug.registry().plugins["gate"]
    assert "ppo_clip" in lossplug.registry().plugins["gate"]  # the built-ins are lossplug's own: they always load
    monkeypatch.delenv("LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD")
    monkeypatch.setenv("LOSSPLUG_PLUGINS", "lpx-other")  # by distribution name
    lossplug.plugin_registry.reset()
    gates = lossplug.registry().plugins["gate"]
    assert "other_pg" in gates and "half_pg" not in gates and "ppo_clip" in gates
    monkeypatch.setenv("LOSSPLUG_PLUGINS", "lpx_half")  # by entry-point name
    lossplug.plugin_registry.reset()
    gates = lossplug.registry().plugins["gate"]
    assert "half_pg" in gates and "other_pg" not in gates


def test_a_third_party_entry_point_may_share_a_built_in_entry_points_name(site):
    site.add("lpx-half", "lpx_half", GATE_MODULE.format(gate="half_pg"), entry_name="gates")
    reg = lossplug.registry()
    assert reg.broken == []
    assert reg.origin("gate", "half_pg") == "entry point 'gates = lpx_half' of distribution 'lpx-half 0.1'"
    assert reg.origin("gate", "ppo_clip") == BUILTIN_SOURCE


def test_without_the_built_in_entry_points_the_registry_says_to_reinstall(fresh_registry, monkeypatch):
    from lossplug import plugin_discovery

    monkeypatch.setattr(plugin_discovery, "select", lambda: plugin_discovery.Selection((), (), ()))
    with pytest.raises(PluginError, match=r"declares none: reinstall lossplug .*pip install -e \."):
        lossplug.registry()


def test_import_error_names_the_entry_point_and_other_recipes_still_run(site):
    site.add("lpx-broken", "lpx_broken", "import no_such_module_anywhere\n")
    with pytest.warns(
        LossplugPluginWarning,
        match="entry point 'lpx_broken = lpx_broken' of distribution "
        "'lpx-broken 0.1': failed to import: ModuleNotFoundError",
    ):
        lossplug.registry()
    lossplug.policy_loss(tiny_batch(), "dapo")  # unaffected
    with pytest.raises(RecipeError, match="unknown gate plugin 'broken_gate'.*failed to load: entry point 'lpx_broken"):
        Recipe.model_validate({"gates": "broken_gate", "reduction": "token"})


def test_bad_hook_signature_is_reported(site):
    body = """
import lossplug

@lossplug.hookimpl
def lossplug_register_gates(register, unexpected_argument):
    pass
"""
    site.add("lpx-badhook", "lpx_badhook", body)
    with pytest.warns(LossplugPluginWarning, match="(?s)lpx-badhook 0.1': bad plugin: .*unexpected_argument"):
        lossplug.registry()


def test_hook_that_raises_is_reported(site):
    body = """
import lossplug

@lossplug.hookimpl
def lossplug_register_gates(register):
    raise RuntimeError("boom")
"""
    site.add("lpx-raises", "lpx_raises", body)
    with pytest.warns(
        LossplugPluginWarning, match="lpx-raises 0.1': lossplug_register_gates raised RuntimeError: boom"
    ):
        lossplug.registry()


def test_registering_a_non_plugin_object_is_reported(site):
    body = """
import lossplug

@lossplug.hookimpl
def lossplug_register_gates(register):
    register(lambda inp, p: None)
"""
    site.add("lpx-notaplugin", "lpx_notaplugin", body)
    with pytest.warns(LossplugPluginWarning, match="which is not a GatePlugin"):
        lossplug.registry()


# ---------------------------------------------------------------------------------------------------------------------
# call_hook: every hook call, with blame


class _Says:
    """An in-process plugin whose validate hook returns ``answer`` (or raises it)."""

    def __init__(self, answer):
        self.answer = answer

    @lossplug.hookimpl
    def lossplug_validate_batch(self, batch, recipe):
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


class _Wraps:
    @lossplug.hookimpl(wrapper=True)
    def lossplug_validate_batch(self, batch, recipe):
        return (yield)


@pytest.fixture
def in_process(fresh_registry):
    added = []

    def add(plugin, name):
        lossplug.register_plugin(plugin, name)
        added.append(plugin)
        return plugin

    yield add
    for plugin in added:
        lossplug.unregister_plugin(plugin)


def test_call_hook_returns_results_in_pluggys_order_with_their_origin(in_process):
    from lossplug.plugin_registry import call_hook

    in_process(_Says(["first"]), "first-checks")
    in_process(_Says(None), "silent-checks")
    in_process(_Says(["second"]), "second-checks")
    got = call_hook("lossplug_validate_batch", batch=None, recipe=None)
    assert got == [("in-process plugin 'second-checks'", ["second"]), ("in-process plugin 'first-checks'", ["first"])]
    assert [r for _, r in got] == lossplug.plugin_manager().hook.lossplug_validate_batch(batch=None, recipe=None)


def test_call_hook_blames_the_plugin_and_keeps_the_cause(in_process):
    from lossplug.plugin_registry import HookError, call_hook

    in_process(_Says(ZeroDivisionError("division by zero in my check")), "buggy-checks")
    with pytest.raises(PluginError) as info:
        call_hook("lossplug_validate_batch", batch=None, recipe=None)
    err = info.value
    assert isinstance(err, HookError) and err.origin == "in-process plugin 'buggy-checks'"
    assert str(err) == (
        "in-process plugin 'buggy-checks': lossplug_validate_batch raised ZeroDivisionError: "
        "division by zero in my check"
    )
    assert isinstance(err.__cause__, ZeroDivisionError)


@pytest.mark.parametrize("raised", [lossplug.LossplugError("already explained"), MemoryError("out of memory")])
def test_call_hook_lets_lossplug_and_memory_errors_through(in_process, raised):
    from lossplug.plugin_registry import call_hook

    in_process(_Says(raised), "strict-checks")
    with pytest.raises(type(raised)) as info:
        call_hook("lossplug_validate_batch", batch=None, recipe=None)
    assert info.value is raised


def test_call_hook_refuses_hook_wrappers(in_process):
    from lossplug.plugin_registry import call_hook

    in_process(_Wraps(), "wrapping-checks")
    with pytest.raises(
        PluginError, match="in-process plugin 'wrapping-checks': lossplug_validate_batch does not support hook wrappers"
    ):
        call_hook("lossplug_validate_batch", batch=None, recipe=None)


def test_call_hook_on_error_contains_failures_and_runs_the_rest(in_process):
    from lossplug.plugin_registry import call_hook

    in_process(_Says(["kept"]), "good-checks")
    in_process(_Says(lossplug.LossplugError("a failure like any other here")), "strict-checks")
    in_process(_Wraps(), "wrapping-checks")
    failures = []
    got = call_hook("lossplug_validate_batch", on_error=failures.append, batch=None, recipe=None)
    assert got == [("in-process plugin 'good-checks'", ["kept"])]
    assert [(f.origin, f.problem) for f in failures] == [
        ("in-process plugin 'wrapping-checks'", "lossplug_validate_batch does not support hook wrappers"),
        (
            "in-process plugin 'strict-checks'",
            "lossplug_validate_batch raised LossplugError: a failure like any other here",
        ),
    ]


def test_call_hook_passes_arguments_that_depend_on_the_origin(in_process):
    from lossplug.plugin_registry import call_hook

    class Echo:
        @lossplug.hookimpl
        def lossplug_validate_batch(self, batch, recipe):
            return [batch, recipe]

    in_process(Echo(), "echo")
    got = call_hook("lossplug_validate_batch", batch="b", arguments_for=lambda origin: {"recipe": origin.upper()})
    assert got == [("in-process plugin 'echo'", ["b", "IN-PROCESS PLUGIN 'ECHO'"])]


def test_hook_origin_of_entry_points_built_ins_and_in_process_plugins(site):
    from lossplug.plugin_registry import hook_origin

    site.add("lpx-half", "lpx_half", GATE_MODULE.format(gate="half_pg"))
    lossplug.registry()
    assert hook_origin("entrypoint:lpx-half:lpx_half") == (
        "entry point 'lpx_half = lpx_half' of distribution 'lpx-half 0.1' "
        "(leave it out with the LOSSPLUG_PLUGINS allow-list, or uninstall "
        "it)"
    )
    assert hook_origin("entrypoint:lossplug:gates") == BUILTIN_SOURCE
    assert hook_origin("my-notebook-checks") == "in-process plugin 'my-notebook-checks'"


def test_a_register_hook_wrapper_is_a_broken_plugin_not_a_silent_one(site):
    body = """
import lossplug

@lossplug.hookimpl(wrapper=True)
def lossplug_register_gates(register):
    return (yield)
"""
    site.add("lpx-wrapper", "lpx_wrapper", body)
    with pytest.warns(
        LossplugPluginWarning, match="lpx-wrapper 0.1': lossplug_register_gates does not support hook wrappers"
    ):
        reg = lossplug.registry()
    assert reg.lookup("gate", "ppo_clip").name == "ppo_clip"


@pytest.mark.parametrize(
    "recipe,message",
    [
        ({"gates": ["kl"], "reduction": "token"}, r"'kl' is a regularizer plugin: it belongs under regularizers"),
        (
            {"gates": ["ppo_clip"], "regularizers": ["tis"], "reduction": "token"},
            r"'tis' is a gate plugin: it belongs under gates",
        ),
        ({"gates": ["ppo_clip"], "reduction": "grpo"}, r"'grpo' is an advantage plugin: it belongs under advantage"),
    ],
)
def test_a_plugin_in_the_wrong_stage_is_told_where_it_belongs(recipe, message):
    with pytest.raises(lossplug.RecipeError, match=message):
        lossplug.Recipe.load(recipe)
