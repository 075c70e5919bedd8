"""Recipes: parsing, presets, and errors that name the stage, the plugin, the parameter and the allowed values."""

import json

import pydantic
import pytest
import torch

import lossplug
from lossplug import Recipe, RecipeError

YAML = """
advantage: {name: grpo, scale: group}
gates:
  - {name: ppo_clip, eps_low: 0.2, eps_high: 0.28}
reduction: {name: token}
"""


def test_parse_yaml_fills_defaults_and_round_trips():
    recipe = Recipe.from_yaml(YAML)
    assert recipe.advantage.name == "grpo"
    assert recipe.gates[0].params["eps_high"] == 0.28
    assert recipe.gates[0].params["eps_low"] == 0.2
    assert recipe.advantage.params["std"] == "sample"  # default filled in, so the record is complete
    assert Recipe.from_yaml(recipe.to_yaml()) == recipe
    assert Recipe.from_json(recipe.to_json()) == recipe
    assert Recipe.load(recipe.to_dict()) == recipe


def test_string_and_nested_params_forms():
    a = Recipe.model_validate({"gates": "ppo_clip", "reduction": "token"})
    b = Recipe.model_validate(
        {"gates": [{"name": "ppo_clip", "params": {"eps_low": 0.2}}], "reduction": {"name": "token"}}
    )
    assert a == b and a.advantage is None


def test_presets_and_overrides():
    dapo = Recipe.preset("dapo")
    assert dapo.name == "dapo" and dapo.reduction.name == "token" and dapo.gates[0].params["eps_high"] == 0.28
    over = Recipe.preset("dapo", reduction="response")
    assert over.reduction.name == "response" and over.gates == dapo.gates
    assert Recipe.load("grpo").reduction.name == "response"


def test_load_from_files(tmp_path):
    (tmp_path / "r.yaml").write_text(YAML)
    (tmp_path / "r.json").write_text(json.dumps(Recipe.from_yaml(YAML).to_dict()))
    assert Recipe.load(str(tmp_path / "r.yaml")) == Recipe.load(tmp_path / "r.json")
    with pytest.raises(RecipeError, match="no such file"):
        Recipe.load(str(tmp_path / "missing.yaml"))
    (tmp_path / "bad.yaml").write_text("gates: [ppo_clip\n")
    with pytest.raises(RecipeError, match=r"bad.yaml: recipe: not valid YAML"):
        Recipe.load(str(tmp_path / "bad.yaml"))


def test_unknown_parameter_names_plugin_parameter_and_allowed():
    with pytest.raises(RecipeError) as info:
        Recipe.model_validate({"gates": [{"name": "ppo_clip", "eps_hgh": 0.3}], "reduction": "token"})
    msg = str(info.value)
    assert msg.startswith("recipe.gates[0] (ppo_clip): unknown parameter 'eps_hgh' (did you mean 'eps_high'?)")
    assert "allowed: eps_low, eps_high, dual_clip_c" in msg


def test_bad_parameter_values_name_the_rule_and_allowed_values():
    with pytest.raises(
        RecipeError,
        match=r"recipe.advantage \(grpo\): parameter 'scale': Input should be 'group', 'batch' or 'none' \(got 'grp'\)",
    ):
        Recipe.model_validate(
            {"advantage": {"name": "grpo", "scale": "grp"}, "gates": "ppo_clip", "reduction": "token"}
        )
    with pytest.raises(RecipeError, match=r"parameter 'eps_low': Input should be greater than 0 \(got -0.1\)"):
        Recipe.model_validate({"gates": {"name": "ppo_clip", "eps_low": -0.1}, "reduction": "token"})
    with pytest.raises(RecipeError, match=r"parameter 'budget': Input should be greater than 0"):
        Recipe.model_validate({"gates": "ppo_clip", "reduction": {"name": "fixed", "budget": -4}})
    with pytest.raises(RecipeError, match=r"parameter 'eps_high': Input should be a valid number"):
        Recipe.model_validate({"gates": {"name": "ppo_clip", "eps_high": "wide"}, "reduction": "token"})


def test_unknown_plugin_lists_available_and_suggests():
    with pytest.raises(RecipeError) as info:
        Recipe.model_validate({"gates": "ppo_clp", "reduction": "token"})
    msg = str(info.value)
    assert "recipe.gates[0]: unknown gate plugin 'ppo_clp' (did you mean 'ppo_clip'?)" in msg
    assert "available: " in msg and "ppo_clip" in msg
    with pytest.raises(RecipeError, match="unknown reduction plugin 'tokens' \\(did you mean 'token'\\?\\)"):
        Recipe.model_validate({"gates": "ppo_clip", "reduction": "tokens"})
    with pytest.raises(RecipeError, match="unknown preset 'dappo' \\(did you mean 'dapo'\\?\\)"):
        Recipe.preset("dappo")


def test_structure_errors():
    with pytest.raises(RecipeError, match="recipe.gates: needs at least one gate"):
        Recipe.model_validate({"reduction": "token"})
    with pytest.raises(RecipeError, match="recipe.reduction: required"):
        Recipe.model_validate({"gates": "ppo_clip"})
    with pytest.raises(RecipeError, match="unknown key 'gate' \\(did you mean 'gates'\\?\\)"):
        Recipe.model_validate({"gate": "ppo_clip", "reduction": "token"})
    with pytest.raises(RecipeError, match="recipe.advantage: needs a 'name'"):
        Recipe.model_validate({"advantage": {"scale": "group"}, "gates": "ppo_clip", "reduction": "token"})
    with pytest.raises(RecipeError, match="expected a mapping"):
        Recipe.model_validate(["ppo_clip"])


class UnitWeightPlugin:
    @lossplug.hookimpl
    def lossplug_register_gates(self, register):
        @lossplug.gate("unit_weight", role="correction")
        def unit_weight(inp, p):
            """Weight 1 everywhere."""
            return lossplug.GateOutput(weight=torch.ones_like(inp.logp))

        register(unit_weight)


def test_gate_roles_are_enforced():
    plugin = UnitWeightPlugin()
    lossplug.register_plugin(plugin, "unit-weight")
    try:
        with pytest.raises(
            RecipeError, match=r"recipe.gates\[0\] \(unit_weight\): the first gate must be an update gate"
        ):
            Recipe.model_validate({"gates": ["unit_weight"], "reduction": "token"})
        with pytest.raises(
            RecipeError, match=r"recipe.gates\[1\] \(ppo_clip\): gates after the first must be detached"
        ):
            Recipe.model_validate({"gates": ["ppo_clip", "ppo_clip"], "reduction": "token"})
        Recipe.model_validate({"gates": ["ppo_clip", "unit_weight"], "reduction": "token"})
        assert lossplug.registry().origin("gate", "unit_weight") == "in-process plugin 'unit-weight'"
    finally:
        lossplug.unregister_plugin(plugin)
    with pytest.raises(RecipeError, match="unknown gate plugin 'unit_weight'"):
        Recipe.model_validate({"gates": ["ppo_clip", "unit_weight"], "reduction": "token"})


def test_recipe_is_immutable():
    recipe = Recipe.preset("dapo")
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        recipe.reduction = recipe.reduction


def test_preset_override_of_the_same_plugin_merges_parameters():
    base = Recipe.preset("dapo")
    tweaked = Recipe.preset("dapo", gates=[{"name": "ppo_clip", "eps_high": 0.3}], advantage={"eps": 1e-4})
    assert tweaked.advantage.name == "grpo" and tweaked.advantage.params["eps"] == 1e-4
    assert tweaked.advantage.params["scale"] == base.advantage.params["scale"]
    replaced = Recipe.preset("dapo", advantage={"name": "rloo"})
    assert replaced.advantage.name == "rloo" and replaced.advantage.params == {}
    assert Recipe.model_validate({"preset": "dapo", "reduction": {"name": "fixed", "budget": 8}}).reduction.params == {
        "budget": 8
    }


def test_equality_ignores_the_compiled_cache():
    used = Recipe.load("grpo")
    lossplug.compile_recipe(used)
    assert used == Recipe.preset("grpo") and hash(used) == hash(Recipe.preset("grpo"))
    assert used != Recipe.preset("dapo")


# ---------------------------------------------------------------------------------------------------------------------
# Every stage's errors at once

TWO_BAD = {"advantage": {"name": "grpo", "scale": "grp"}, "gates": ["ppo_clip", "lpx_nope"], "reduction": "token"}
THREE_BAD = {**TWO_BAD, "reduction": {"name": "fixed", "budget": -4}}
TWO_BAD_LINES = (
    "recipe.advantage (grpo): parameter 'scale': Input should be 'group', 'batch' or 'none' (got 'grp')",
    "recipe.gates[1]: unknown gate plugin 'lpx_nope'",
)
THREE_BAD_LINES = TWO_BAD_LINES + ("recipe.reduction (fixed): parameter 'budget': Input should be greater than 0",)


def assert_reports(err: RecipeError, lines: tuple[str, ...]):
    msg = str(err)
    assert f"recipe: {len(lines)} stages have errors:" in msg
    reported = [line.strip() for line in msg.splitlines()[1:]]
    assert len(reported) == len(lines), msg
    for got, want in zip(reported, lines):  # in recipe order, one line per stage
        assert got.startswith(want), msg


@pytest.mark.parametrize(
    "data,lines", [(TWO_BAD, TWO_BAD_LINES), (THREE_BAD, THREE_BAD_LINES)], ids=["two-stages", "three-stages"]
)
def test_every_bad_stage_is_reported_at_once_by_the_constructor(data, lines):
    with pytest.raises(RecipeError) as info:
        Recipe(**data)
    assert_reports(info.value, lines)
    with pytest.raises(RecipeError) as info:
        Recipe.model_validate(data)
    assert_reports(info.value, lines)


@pytest.mark.parametrize(
    "data,lines", [(TWO_BAD, TWO_BAD_LINES), (THREE_BAD, THREE_BAD_LINES)], ids=["two-stages", "three-stages"]
)
def test_every_bad_stage_is_reported_at_once_from_a_yaml_file(tmp_path, data, lines):
    import yaml

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError) as info:
        Recipe.load(str(path))
    assert str(info.value).startswith(f"{path}: recipe: {len(lines)} stages have errors:")
    assert_reports(info.value, lines)


def test_structure_and_catalogue_errors_of_different_stages_are_reported_together():
    with pytest.raises(RecipeError) as info:
        Recipe.model_validate({"advantage": {"scale": "group"}, "gates": [], "reduction": "tokens"})
    assert_reports(
        info.value,
        (
            "recipe.advantage: needs a 'name'",
            "recipe.gates: needs at least one gate",
            "recipe.reduction: unknown reduction plugin 'tokens' (did you mean 'token'?)",
        ),
    )
    with pytest.raises(RecipeError) as info:  # a wrong role and a missing reduction
        Recipe.model_validate({"gates": ["tis", "lpx_nope"]})
    assert_reports(
        info.value,
        (
            "recipe.gates[0] (tis): the first gate must be an update gate",
            "recipe.gates[1]: unknown gate plugin 'lpx_nope'",
            "recipe.reduction: required",
        ),
    )


# ---------------------------------------------------------------------------------------------------------------------
# The seam: contracts holds the structure and the Catalogue protocol, core installs the plugin registry as catalogue


def test_contracts_never_names_core_not_even_in_a_string():
    import ast
    from pathlib import Path

    root = Path(lossplug.contracts.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("lossplug."):
                assert node.value.startswith("lossplug.contracts"), f"{path.name}: names {node.value!r}"


class OnlyGrpo:
    """A catalogue that knows one advantage, one gate, one reduction and no presets."""

    def check_stage(self, kind, spec, where, role=None):
        if spec.name != {"advantage": "grpo", "gate": "ppo_clip", "reduction": "token"}[kind]:
            raise RecipeError(f"{where}: not in this catalogue: '{spec.name}'")
        return spec

    def preset(self, name):
        raise RecipeError(f"no presets here ('{name}')")


def test_contracts_checks_stages_with_whatever_catalogue_is_installed():
    from lossplug.contracts import recipe as contract

    previous = contract.install_catalogue(OnlyGrpo())
    try:
        recipe = Recipe.model_validate({"gates": [{"name": "ppo_clip", "eps_low": 9}], "reduction": "token"})
        assert recipe.gates[0].params == {"eps_low": 9}  # this catalogue validates nothing
        with pytest.raises(
            RecipeError,
            match="recipe: 2 stages have errors:\n  recipe.gates\\[0\\]: not in this "
            "catalogue: 'sapo'\n  recipe.reduction: not in this catalogue",
        ):
            Recipe.model_validate({"gates": ["sapo"], "reduction": "response"})
        with pytest.raises(RecipeError, match="no presets here"):
            Recipe.preset("grpo")
        contract.install_catalogue(None)
        with pytest.raises(lossplug.LossplugError, match="no plugin catalogue is installed"):
            Recipe.preset("grpo")
    finally:
        contract.install_catalogue(previous)
    assert Recipe.preset("grpo").advantage.name == "grpo"


def test_importing_contracts_alone_installs_the_registry_lazily():
    import subprocess
    import sys

    code = (
        "import sys; from lossplug.contracts import Recipe; before = 'lossplug.plugin_registry' in sys.modules; "
        "r = Recipe.load('dapo'); print(before, 'lossplug.plugin_registry' in sys.modules, r.reduction.name)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "token"]


# ---------------------------------------------------------------------------------------------------------------------
# The regularizers stage

REGULARIZED = """
gates: [ppo_clip]
reduction: token
regularizers:
  - {name: kl, coef: 0.05, estimator: k3+}
  - {name: entropy, coef: 0.01, reduction: {name: fixed, budget: 64}}
"""


def test_regularizers_parse_fill_defaults_and_round_trip():
    recipe = Recipe.from_yaml(REGULARIZED)
    kl, entropy = recipe.regularizers
    assert kl.name == "kl" and kl.params["estimator"] == "k3+" and kl.params["ratio_weight"] == "none"
    assert kl.params["reduction"] is None and kl.params["population"] == "step"
    assert entropy.params["reduction"] == {"name": "fixed", "budget": 64.0}  # its own reduction, checked and filled
    assert Recipe.from_yaml(recipe.to_yaml()) == recipe and Recipe.from_json(recipe.to_json()) == recipe
    assert recipe.to_dict()["regularizers"][0] == {"name": "kl", **kl.params}
    assert recipe != Recipe.load({"gates": ["ppo_clip"], "reduction": "token"})


def test_regularizers_are_optional_and_one_may_be_given_alone():
    plain = Recipe.load({"gates": ["ppo_clip"], "reduction": "token"})
    assert plain.regularizers == () and "regularizers" not in plain.to_dict()  # records of older recipes unchanged
    assert Recipe.load({"gates": ["ppo_clip"], "reduction": "token", "regularizers": None}) == plain
    one = Recipe.load({"gates": ["ppo_clip"], "reduction": "token", "regularizers": "kl"})
    assert [r.name for r in one.regularizers] == ["kl"]
    assert Recipe.load({"gates": ["ppo_clip"], "reduction": "token", "regularizers": {"name": "kl"}}) == one
    assert Recipe.preset("dapo", regularizers=["entropy"]).regularizers[0].name == "entropy"


def test_regularizer_errors_are_reported_with_every_other_stage():
    with pytest.raises(RecipeError) as info:
        Recipe.model_validate(
            {
                "gates": ["ppo_clip"],
                "reduction": "tokens",
                "regularizers": [
                    {"name": "kll"},
                    {"name": "kl", "estimator": "k4"},
                    {"name": "entropy", "reduction": "tokn"},
                ],
            }
        )
    assert_reports(
        info.value,
        (
            "recipe.reduction: unknown reduction plugin 'tokens'",
            "recipe.regularizers[0]: unknown regularizer plugin 'kll' (did you mean 'kl'?)",
            "recipe.regularizers[1] (kl): parameter 'estimator'",
            "recipe.regularizers[2].reduction: unknown reduction plugin 'tokn' (did you mean 'token'?)",
        ),
    )


def test_regularizer_structure_errors():
    with pytest.raises(RecipeError, match="recipe.regularizers: must be a list of regularizers"):
        Recipe.load({"gates": ["ppo_clip"], "reduction": "token", "regularizers": 3})
    with pytest.raises(RecipeError, match="unknown key 'regularizer' \\(did you mean 'regularizers'\\?\\)"):
        Recipe.load({"gates": ["ppo_clip"], "reduction": "token", "regularizer": ["kl"]})
    with pytest.raises(RecipeError, match="recipe.regularizers\\[0\\]: unknown regularizer plugin 'ppo_clip'"):
        Recipe.load({"gates": ["ppo_clip"], "reduction": "token", "regularizers": ["ppo_clip"]})
