"""A name registered by more than one distribution (lossplug.plugin_names): the built-in keeps its name, the newcomer
is reachable as ``<distribution>:<name>``, lossplug says so once; two third-party distributions make the bare name
ambiguous; one distribution registering a name twice is still refused. With real installed distributions
(``.dist-info`` + ``entry_points.txt`` on ``sys.path``, the ``site`` fixture of tests/conftest.py)."""

import json
import textwrap
import warnings

import pytest
import torch
from packaging.utils import canonicalize_name
from typer.testing import CliRunner

import lossplug
from lossplug import PluginError, Recipe, RecipeError
from lossplug.cli import app
from lossplug.plugin_names import canonical, canonical_provider, split
from lossplug.plugin_registry import BUILTIN_SOURCE, LossplugPluginWarning, PluginNameClashWarning

#: a gate ``factor · A · logp`` under any name (and a preset using it): nothing like the built-in ppo_clip
GATE_MODULE = """
import lossplug
from pydantic import Field


class ScaledParams(lossplug.Params):
    factor: float = Field({factor}, gt=0)


@lossplug.gate("{gate}", params=ScaledParams)
def scaled_pg(inp, p):
    \"\"\"factor · A · logp.\"\"\"
    return lossplug.GateOutput(objective=p.factor * inp.advantage * inp.logp, metrics={{"factor": lambda: inp.logp.new_tensor(p.factor)}})


@lossplug.hookimpl
def lossplug_register_gates(register):
    register(scaled_pg)
"""

PRESET_MODULE = """
import lossplug


@lossplug.hookimpl
def lossplug_register_presets(register):
    register("dapo", {"gates": ["reinforce"], "reduction": "response"}, source="not DAPO at all")
"""

WIDE = {"COLUMNS": "200", "NO_COLOR": "1"}


def cli(*args):
    result = CliRunner().invoke(app, list(args), env=WIDE)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"lossplug {' '.join(args)} raised instead of reporting") from result.exception
    return result


def gate_module(gate, factor=0.5):
    return GATE_MODULE.format(gate=gate, factor=factor)


def add_distribution(site, dist, modules, version="0.1"):
    """One installed distribution with several ``lossplug`` entry points (module name → its source)."""
    for module, body in modules.items():
        (site.path / module).mkdir()
        (site.path / module / "__init__.py").write_text(textwrap.dedent(body))
        site.modules.append(module)
    info = site.path / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("[lossplug]\n" + "".join(f"{m} = {m}\n" for m in modules))


def build_registry():
    """The registry, with every warning its build emitted."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reg = lossplug.registry()
    return reg, [w for w in caught if issubclass(w.category, LossplugPluginWarning)]


def tiny_batch():
    # A = (+1, −1); 2 and 3 action tokens; logp = old_logp = −1, so every update ratio is 1
    return lossplug.PolicyBatch(
        logp=torch.full((2, 3), -1.0, dtype=torch.float64, requires_grad=True),
        old_logp=torch.full((2, 3), -1.0, dtype=torch.float64),
        action_mask=torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool),
        advantage=torch.tensor([1.0, -1.0], dtype=torch.float64),
    )


def token_mean_loss_and_grad(objective_per_token):
    """The oracle: −(Σ over action tokens of the objective) / 5 action tokens, and its gradient in logp."""
    batch = tiny_batch()
    mask = batch.action_mask.to(torch.float64)
    a = batch.advantage[:, None]
    logp = batch.logp.detach().clone().requires_grad_(True)
    loss = -(objective_per_token(a, logp) * mask).sum() / mask.sum()
    loss.backward()
    return loss.detach(), logp.grad


# ---------------------------------------------------------------------------------------------------------------------
# A third-party gate named like a built-in


def test_a_third_party_ppo_clip_leaves_the_built_in_and_every_preset_working(site):
    site.add("my-gates", "my_gates", gate_module("ppo_clip"))
    reg, said = build_registry()
    assert reg.origin("gate", "ppo_clip") == BUILTIN_SOURCE
    assert reg.origin("gate", "my-gates:ppo_clip") == "entry point 'my_gates = my_gates' of distribution 'my-gates 0.1'"
    # said once, as a PluginNameClashWarning naming the built-in, the newcomer's distribution and its qualified name
    assert len(said) == 1 and said[0].category is PluginNameClashWarning
    message = str(said[0].message)
    assert "gate 'ppo_clip' is built in" in message and "'ppo_clip' stays lossplug's built-in" in message
    assert "distribution 'my-gates 0.1'" in message and "'my-gates:ppo_clip'" in message
    assert not reg.duplicates and not reg.ambiguous
    builtin_ppo = reg.lookup("gate", "ppo_clip")
    assert builtin_ppo.params.__name__ != "ScaledParams"

    # every preset compiles, and each of its stages is the built-in plugin of that name
    from lossplug.cli.describe import explain_recipe

    assert "dapo" in reg.presets and len(reg.presets) > 5
    for name in reg.presets:
        stages = explain_recipe(Recipe.preset(name))["stages"]
        assert all(s["source"] == BUILTIN_SOURCE for s in stages), (name, stages)
    # and runs: dapo's loss equals ppo_clip's (ratio 1: objective A) under the token mean
    result = lossplug.policy_loss(tiny_batch(), "dapo")  # (the batch carries its advantage)
    expected, _ = token_mean_loss_and_grad(lambda a, logp: a * torch.exp(logp - logp.detach()))
    assert result.loss.item() == pytest.approx(expected.item(), abs=1e-12)

    # the command from the report: exit 0, the built-in ppo_clip, and nothing said again
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        out = cli("recipe", "explain", "dapo")
        lossplug.registry()
    assert out.exit_code == 0, out.output
    assert "ppo_clip" in out.output and "from lossplug (built-in)" in out.output
    assert [w for w in again if issubclass(w.category, LossplugPluginWarning)] == []


@pytest.mark.parametrize("spelling", ["my-gates:ppo_clip", "My_Gates:ppo_clip", "my.gates:ppo_clip"])
def test_the_qualified_name_is_the_newcomer_in_a_recipe_and_a_policy_loss(site, spelling):
    site.add("my-gates", "my_gates", gate_module("ppo_clip"))
    build_registry()
    recipe = Recipe.from_yaml(f"gates: [{{name: '{spelling}', factor: 0.5}}]\nreduction: token\n")
    batch = tiny_batch()
    result = lossplug.policy_loss(batch, recipe)
    result.loss.backward()
    # the oracle: ½·A·logp, token mean over 5 action tokens: (2·½·(−1) + 3·½·(+1)) / 5 = 0.1 → loss −0.1
    expected, expected_grad = token_mean_loss_and_grad(lambda a, logp: 0.5 * a * logp)
    assert expected.item() == pytest.approx(-0.1)
    assert result.loss.item() == pytest.approx(expected.item(), abs=1e-12)
    torch.testing.assert_close(batch.logp.grad, expected_grad, rtol=0, atol=1e-12)
    # the compiled stage is the newcomer, under its qualified name (so messages and metrics say which one ran)
    compiled = lossplug.compile_recipe(recipe)
    assert compiled.update.plugin.name == "my-gates:ppo_clip"
    assert compiled.update.params.factor == 0.5
    assert result.metrics["my-gates:ppo_clip/factor"] == pytest.approx(0.5)
    # a dict recipe, and the built-in under its own qualified name, next to it
    builtin = lossplug.policy_loss(tiny_batch(), {"gates": ["lossplug:ppo_clip"], "reduction": "token"})
    assert builtin.loss.item() == pytest.approx(0.2)  # objective A at ratio 1: −(2 − 3)/5


def test_lossplug_list_show_and_explain_accept_the_qualified_newcomer(site, tmp_path):
    site.add("my-gates", "my_gates", gate_module("ppo_clip"))
    build_registry()
    data = json.loads(cli("list", "--kind", "gate", "--json").output)
    rows = {r["name"]: r for r in data["plugins"]}
    assert rows["ppo_clip"]["distribution"] == BUILTIN_SOURCE and rows["ppo_clip"]["qualified"] == "lossplug:ppo_clip"
    newcomer = rows["my-gates:ppo_clip"]
    assert newcomer["distribution"] == "my-gates 0.1" and newcomer["params"]["factor"]["default"] == 0.5
    assert data["duplicates"] == [] and [c["qualified"] for c in data["clashes"]] == [["my-gates:ppo_clip"]]
    text = cli("list", "--kind", "gate").output
    assert "my-gates:ppo_clip" in text and "names registered by more than one distribution" in text

    for spelling in ("my-gates:ppo_clip", "MY_GATES:ppo_clip"):
        shown = json.loads(cli("show", spelling, "--json").output)["plugins"]
        assert [p["distribution"] for p in shown] == ["my-gates 0.1"]
    shown = json.loads(cli("show", "lossplug:ppo_clip", "--json").output)["plugins"]
    assert [p["distribution"] for p in shown] == [BUILTIN_SOURCE]

    recipe_file = tmp_path / "mine.yaml"
    recipe_file.write_text("gates: [{name: my_gates:ppo_clip, factor: 2.0}]\nreduction: token\n")
    out = cli("recipe", "explain", str(recipe_file), "--json")
    assert out.exit_code == 0, out.output
    stage = json.loads(out.output)["stages"][0]
    assert (stage["plugin"], stage["source"], stage["params"]) == ("my-gates:ppo_clip", "my-gates 0.1", {"factor": 2.0})


# ---------------------------------------------------------------------------------------------------------------------
# Two third-party distributions, one distribution twice, in-process plugins, presets


def test_two_distributions_taking_the_same_new_name_make_the_bare_name_ambiguous(site):
    site.add("alpha-gates", "alpha_gates", gate_module("twin_pg", factor=0.5))
    site.add("beta-gates", "beta_gates", gate_module("twin_pg", factor=2.0))
    reg, said = build_registry()
    assert len(said) == 1 and said[0].category is PluginNameClashWarning
    assert "'alpha-gates:twin_pg' or 'beta-gates:twin_pg'" in str(said[0].message)
    with pytest.raises(PluginError) as info:
        Recipe.model_validate({"gates": ["twin_pg"], "reduction": "token"})
    message = str(info.value)
    assert "gate 'twin_pg' is registered more than once" in message
    assert "distribution 'alpha-gates 0.1' (as 'alpha-gates:twin_pg')" in message
    assert "distribution 'beta-gates 0.1' (as 'beta-gates:twin_pg')" in message
    # each qualified name is its own plugin: ½·A·logp vs 2·A·logp
    for qualified, factor in (("alpha-gates:twin_pg", 0.5), ("beta-gates:twin_pg", 2.0)):
        loss = lossplug.policy_loss(tiny_batch(), {"gates": [qualified], "reduction": "token"}).loss
        expected, _ = token_mean_loss_and_grad(lambda a, logp, f=factor: f * a * logp)
        assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    assert "twin_pg" not in reg.plugins["gate"]
    out = cli("show", "twin_pg")
    assert out.exit_code == 1 and "alpha-gates:twin_pg" in out.output and "beta-gates:twin_pg" in out.output
    names = {r["name"] for r in json.loads(cli("list", "--kind", "gate", "--json").output)["plugins"]}
    assert {"alpha-gates:twin_pg", "beta-gates:twin_pg"} <= names and "twin_pg" not in names


def test_a_name_registered_twice_inside_one_distribution_is_still_refused(site):
    add_distribution(
        site,
        "lpx-twice",
        {"lpx_twice_a": gate_module("twice_pg"), "lpx_twice_b": gate_module("twice_pg", 3.0)},
    )
    add_distribution(
        site, "lpx-twice-ppo", {"lpx_ppo_a": gate_module("ppo_clip"), "lpx_ppo_b": gate_module("ppo_clip")}
    )
    reg, said = build_registry()
    duplicated = [str(w.message) for w in said if "cannot be used until one is removed" in str(w.message)]
    assert len(duplicated) == 2
    for name in ("twice_pg", "lpx-twice:twice_pg"):
        with pytest.raises(PluginError) as info:
            reg.lookup("gate", name)
        assert "gate '" + name + "' is registered more than once, by entry point" in str(info.value)
        for module in ("lpx_twice_a", "lpx_twice_b"):
            assert f"entry point '{module} = {module}' of distribution 'lpx-twice 0.1'" in str(info.value)
    # a distribution that registers a built-in's name twice: the built-in still works, its qualified name does not
    assert reg.origin("gate", "ppo_clip") == BUILTIN_SOURCE
    with pytest.raises(PluginError, match="gate 'lpx-twice-ppo:ppo_clip' is registered more than once"):
        reg.lookup("gate", "lpx-twice-ppo:ppo_clip")


def test_an_in_process_plugin_is_qualified_by_the_name_it_was_registered_with(fresh_registry, register_gates):
    @lossplug.gate("ppo_clip")
    def notebook_ppo(inp, p):
        """A · logp."""
        return lossplug.GateOutput(objective=inp.advantage * inp.logp)

    register_gates(notebook_ppo, name="my_notebook.gates")
    reg, said = build_registry()
    assert len(said) == 1 and "in-process plugin 'my_notebook.gates'" in str(said[0].message)
    assert "'my-notebook-gates:ppo_clip'" in str(said[0].message)
    assert reg.origin("gate", "ppo_clip") == BUILTIN_SOURCE
    for spelling in ("my-notebook-gates:ppo_clip", "my_notebook.gates:ppo_clip"):
        assert reg.lookup("gate", spelling).fn is notebook_ppo.fn


def test_a_third_party_preset_named_like_a_built_in_one(site):
    site.add("my-presets", "my_presets", PRESET_MODULE)
    reg, said = build_registry()
    assert len(said) == 1 and "preset 'dapo' is built in" in str(said[0].message)
    assert reg.presets["dapo"].origin == BUILTIN_SOURCE
    assert Recipe.preset("dapo").gates[0].name == "ppo_clip"
    for spelling in ("my-presets:dapo", "my_presets:dapo"):
        theirs = Recipe.load(spelling)
        assert (theirs.name, theirs.gates[0].name, theirs.reduction.name) == (
            "my-presets:dapo",
            "reinforce",
            "response",
        )
    out = cli("recipe", "explain", "my_presets:dapo")
    assert out.exit_code == 0, out.output
    assert "not DAPO at all" in out.output


# ---------------------------------------------------------------------------------------------------------------------
# Qualified names without a clash, and the rules for names


def test_every_registered_name_has_a_qualified_spelling(site):
    site.add("Lpx_Half", "lpx_half", gate_module("half_pg"))
    reg, said = build_registry()
    assert said == []
    assert reg.lookup("gate", "lossplug:ppo_clip") is reg.lookup("gate", "ppo_clip")
    assert reg.lookup("gate", "lpx-half:half_pg") is reg.lookup("gate", "half_pg")  # the distribution's canonical name
    assert reg.lookup("gate", "Lpx_Half:half_pg") is reg.lookup("gate", "half_pg")  # and its name as declared
    assert reg.qualified_name("gate", "half_pg") == "lpx-half:half_pg"
    rows = {(r["kind"], r["name"]): r for r in lossplug.list_plugins()}
    assert rows[("gate", "half_pg")]["qualified"] == "lpx-half:half_pg"
    assert rows[("preset", "dapo")]["qualified"] == "lossplug:dapo"
    assert lossplug.Recipe.load("lossplug:dapo").gates[0].name == "ppo_clip"
    with pytest.raises(RecipeError, match="unknown gate plugin 'other-dist:half_pg'"):
        reg.lookup("gate", "other-dist:half_pg")
    from lossplug.testing import check_plugin

    assert check_plugin("lossplug:reinforce", checks=["output_contract"]).ok


@pytest.mark.parametrize("name", ["my-gates", "My_Gates", "my.gates", "my__gates", "MY-._gates", "lpx_half"])
def test_provider_names_are_canonical_as_packaging_makes_them(name):
    assert canonical_provider(name) == canonicalize_name(name)
    assert split(f"{name}:ppo_clip") == (canonicalize_name(name), "ppo_clip")
    assert canonical(f"{name}:ppo_clip") == f"{canonicalize_name(name)}:ppo_clip"
    assert canonical("ppo_clip") == "ppo_clip" and split("ppo_clip") == (None, "ppo_clip")


def test_a_plugin_name_with_a_colon_is_a_broken_plugin(site):
    site.add("lpx-colon", "lpx_colon", gate_module("a:b"))
    reg, said = build_registry()
    assert any("gate name 'a:b' must be a non-empty string without ':'" in str(w.message) for w in said)
    assert "a:b" not in reg.plugins["gate"] and reg.origin("gate", "ppo_clip") == BUILTIN_SOURCE


def test_the_built_in_catalogue_carries_qualified_names_and_no_clashes(fresh_registry, monkeypatch):
    from lossplug.cli import catalogue

    monkeypatch.setenv("LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD", "1")
    data = catalogue.live()
    assert data["clashes"] == [] and data["duplicates"] == []
    assert {r["qualified"] for r in data["rows"]} == {f"lossplug:{r['name']}" for r in data["rows"]}
    assert all(info["qualified"] == f"lossplug:{info['name']}" for info in data["plugins"].values())
