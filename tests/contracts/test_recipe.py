"""Recipes: parsing, presets, and errors that name the stage, the plugin, the parameter and the allowed values."""

import json

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
    b = Recipe.model_validate({"gates": [{"name": "ppo_clip", "params": {"eps_low": 0.2}}], "reduction": {"name": "token"}})
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
    with pytest.raises(RecipeError, match=r"recipe.advantage \(grpo\): parameter 'scale': Input should be 'group', 'batch' or 'none' \(got 'grp'\)"):
        Recipe.model_validate({"advantage": {"name": "grpo", "scale": "grp"}, "gates": "ppo_clip", "reduction": "token"})
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
        with pytest.raises(RecipeError, match=r"recipe.gates\[0\] \(unit_weight\): the first gate must be an update gate"):
            Recipe.model_validate({"gates": ["unit_weight"], "reduction": "token"})
        with pytest.raises(RecipeError, match=r"recipe.gates\[1\] \(ppo_clip\): gates after the first must be detached"):
            Recipe.model_validate({"gates": ["ppo_clip", "ppo_clip"], "reduction": "token"})
        Recipe.model_validate({"gates": ["ppo_clip", "unit_weight"], "reduction": "token"})
        assert lossplug.registry().origin("gate", "unit_weight") == "in-process plugin 'unit-weight'"
    finally:
        lossplug.unregister_plugin(plugin)
    with pytest.raises(RecipeError, match="unknown gate plugin 'unit_weight'"):
        Recipe.model_validate({"gates": ["ppo_clip", "unit_weight"], "reduction": "token"})


def test_recipe_is_immutable():
    recipe = Recipe.preset("dapo")
    with pytest.raises(Exception):
        recipe.reduction = recipe.reduction


def test_preset_override_of_the_same_plugin_merges_parameters():
    base = Recipe.preset("dapo")
    tweaked = Recipe.preset("dapo", gates=[{"name": "ppo_clip", "eps_high": 0.3}], advantage={"eps": 1e-4})
    assert tweaked.advantage.name == "grpo" and tweaked.advantage.params["eps"] == 1e-4
    assert tweaked.advantage.params["scale"] == base.advantage.params["scale"]
    replaced = Recipe.preset("dapo", advantage={"name": "rloo"})
    assert replaced.advantage.name == "rloo" and replaced.advantage.params == {}
    assert Recipe.model_validate({"preset": "dapo", "reduction": {"name": "fixed", "budget": 8}}).reduction.params == {"budget": 8}


def test_equality_ignores_the_compiled_cache():
    used = Recipe.load("grpo")
    lossplug.compile_recipe(used)
    assert used == Recipe.preset("grpo") and hash(used) == hash(Recipe.preset("grpo"))
    assert used != Recipe.preset("dapo")
