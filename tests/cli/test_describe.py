"""lossplug.cli.describe: plugins and recipes as plain data (what `lossplug show/list/recipe explain` render)."""

import lossplug
from lossplug.cli.describe import constraints, distribution, explain_recipe, parameters, plugin_info, recipe_fields


def test_parameters_give_type_default_constraint_and_description():
    plugin = lossplug.registry().plugins["gate"]["ppo_clip"]
    rows = {r["name"]: r for r in parameters(plugin)}
    assert rows["eps_low"] == {
        "name": "eps_low",
        "type": "float",
        "required": False,
        "default": 0.2,
        "constraint": "> 0, < 1",
        "description": "lower clip: ratios below 1 − eps_low are cut when A < 0",
    }
    assert rows["dual_clip_c"]["type"] == "float | None" and rows["dual_clip_c"]["default"] is None
    assert constraints(plugin.params.model_fields["log_ratio_clamp"]) == "> 0"


def test_plugin_info_names_role_needs_and_schema():
    reg = lossplug.registry()
    info = plugin_info("gate", "tis", reg.plugins["gate"]["tis"], reg.origin("gate", "tis"))
    assert info["role"] == "correction" and info["level"] == "token"
    assert info["requires"] == ["old_logp", "behavior_logp"]
    assert {"logp", "action_mask", "old_logp", "behavior_logp"} <= set(info["needs"])
    assert info["params_schema"]["properties"]["cap"]["default"] == 2.0
    assert info["distribution"] == info["source"]  # a built-in: no distribution to extract


def test_distribution_is_read_from_an_entry_point_origin():
    origin = "entry point 'tanh_clip' of distribution 'lossplug-example-plugin 0.1.0'"
    assert distribution(origin) == "lossplug-example-plugin 0.1.0"


def test_explain_recipe_lists_stages_fields_and_normaliser():
    data = explain_recipe(lossplug.Recipe.preset("dapo"))
    assert [s["stage"] for s in data["stages"]] == ["advantage", "gates[0]", "reduction"]
    assert data["stages"][1]["plugin"] == "ppo_clip" and data["stages"][1]["role"] == "update · token"
    fields = {row["field"]: row for row in data["needs"]}
    assert fields["reward"]["needed_by"].startswith("advantage") and fields["old_logp"]["shape"]
    assert data["needs"] == recipe_fields(lossplug.Recipe.preset("dapo"))
    assert "Normalizer" in data["normalizer"]


def test_explain_recipe_summarises_each_stage_with_its_whole_first_paragraph():
    data = explain_recipe(lossplug.Recipe.preset("dapo"))
    summary = {s["plugin"]: s["summary"] for s in data["stages"]}
    # ppo_clip's first paragraph runs over two docstring lines: the summary used to stop at "…for A < 0; with"
    assert summary["ppo_clip"] == (
        "PPO clip: min(r·A, clip(r, 1−eps_low, 1+eps_high)·A), optional dual-clip max(·, c·A) for A < 0; with "
        "``delta``: min(min(r, δ)·A, clip(r)·A)."
    )
    assert "\n" not in summary["grpo"] and summary["grpo"].endswith("exactly 0 for groups of equal rewards.")


def test_a_default_made_by_a_factory_is_shown_as_its_value():
    plugin = lossplug.registry().plugins["gate"]["bypass_rs"]
    rows = {r["name"]: r for r in parameters(plugin)}
    assert rows["rules"]["required"] is False and rows["rules"]["default"] == []  # was 'PydanticUndefined'
    listed = next(r for r in lossplug.list_plugins() if r["kind"] == "gate" and r["name"] == "bypass_rs")
    assert listed["params"]["rules"]["default"] == []
