"""lossplug.needs: which batch fields a plugin or a recipe needs — the one answer the CLI, the registry's listing,
the adapters and the conformance kit share."""

import pytest
from pydantic import Field

import lossplug
from lossplug.contracts import Violation
from lossplug.needs import (
    FIELD_SHAPES,
    ON_POLICY_HINT,
    batch_fields,
    missing_field,
    one_line_each,
    recipe_needs,
    required_fields,
)


def plugin(kind, name):
    return lossplug.registry().plugins[kind][name]


class NeedsAKey(lossplug.Params):
    key: str = Field(description="no default on purpose")


@lossplug.gate("needs_a_key", params=NeedsAKey, requires=lambda p: ("old_logp",) if p.key else ())
def needs_a_key(inp, p):
    """A gate whose needs depend on a parameter without a default."""
    return lossplug.GateOutput(objective=inp.advantage * inp.logp)


@lossplug.gate("fixed_with_required_param", params=NeedsAKey, requires=("ref_logp",))
def fixed_with_required_param(inp, p):
    """A fixed declaration next to a parameter without a default."""
    return lossplug.GateOutput(objective=inp.advantage * inp.logp)


def test_required_fields_with_the_defaults_or_given_parameters():
    gae = plugin("advantage", "gae")
    assert required_fields(plugin("gate", "ppo_clip")) == ("old_logp",)
    assert required_fields(gae) == ("reward", "value")
    assert required_fields(gae, gae.params(kl_coef=0.1)) == ("reward", "value", "old_logp", "ref_logp")
    assert required_fields(plugin("gate", "reinforce")) == ()


def test_required_fields_without_buildable_defaults_answers_only_a_fixed_declaration():
    assert required_fields(needs_a_key) == ()  # depends on a parameter that has no default
    assert required_fields(needs_a_key, NeedsAKey(key="x")) == ("old_logp",)
    assert required_fields(fixed_with_required_param) == ("ref_logp",)


def test_required_fields_of_duck_typed_plugins():
    class Declared:
        requires = ("reward",)

    class Computed:
        @staticmethod
        def requires(params):
            return ("value",)

    assert required_fields(Declared()) == ("reward",)
    assert required_fields(Computed()) == ()  # no parameters to ask with
    assert required_fields(Computed(), params=object()) == ("value",)


def test_batch_fields_of_each_kind():
    assert batch_fields(plugin("gate", "cispo")) == ("logp", "action_mask", "advantage", "old_logp")
    assert batch_fields(plugin("advantage", "grpo")) == ("logp", "action_mask", "reward", "group_id")
    assert batch_fields(plugin("advantage", "rloo"))[-1] == "group_id"
    assert batch_fields(plugin("reduction", "token")) == ()


def test_recipe_needs_names_every_stage_that_needs_a_field():
    needs = recipe_needs("dapo")
    assert list(needs)[:2] == ["logp", "action_mask"] and needs["logp"] == ("always",)
    assert needs["reward"] == ("advantage 'grpo'",) and needs["old_logp"] == ("gates[0] 'ppo_clip'",)
    recipe = lossplug.Recipe.model_validate({"gates": ["ppo_clip", "icepop"], "reduction": "token"})
    needs = recipe_needs(recipe)
    assert "no advantage stage" in needs["advantage"][0]
    assert needs["behavior_logp"] == ("gates[1] 'icepop'",)
    assert needs["old_logp"] == ("gates[0] 'ppo_clip'", "gates[1] 'icepop'")
    assert "group_id" in recipe_needs({"advantage": "rloo", "gates": ["ppo_clip"], "reduction": "token"})
    assert set(FIELD_SHAPES) >= {f for r in ("dapo", "ppo", "grpo") for f in recipe_needs(r)}


def test_an_estimator_with_a_group_size_is_named_once_for_group_id():
    assert recipe_needs("rloo")["group_id"] == ("advantage 'rloo' (≥ 2 rollouts per group)",)
    assert recipe_needs("rloo")["reward"] == ("advantage 'rloo'",)
    assert recipe_needs("dapo")["group_id"] == ("advantage 'grpo'",)  # groups of one are allowed: no size to state


def test_missing_fields_merge_into_one_line_per_field():
    violations = [
        missing_field("old_logp", ("recipe.gates[0] (ppo_clip)",), "this PolicyBatch has none"),
        Violation("logp", "must be finite on action positions", "(row 1, pos 2)"),
        missing_field("behavior_logp", ("recipe.gates[1] (icepop)",), "this PolicyBatch has none"),
        missing_field("old_logp", ("recipe.gates[1] (icepop)",), "this PolicyBatch has none"),
        missing_field("old_logp", ("recipe.gates[1] (icepop)",), "this PolicyBatch has none"),
        Violation("logp", "must be finite on action positions", "(row 1, pos 2)"),
    ]
    assert [str(v) for v in one_line_each(violations)] == [
        "old_logp: required by recipe.gates[0] (ppo_clip), recipe.gates[1] (icepop), but this PolicyBatch has none"
        + ON_POLICY_HINT,
        "logp: must be finite on action positions — (row 1, pos 2)",
        "behavior_logp: required by recipe.gates[1] (icepop), but this PolicyBatch has none",
    ]
    # a field missing for two different reasons stays two lines; the hint is only for a field that can be given
    odd = [missing_field("old_logp", ("a",), "this PolicyBatch has none"), missing_field("old_logp", ("b",), "x")]
    assert [v.rule for v in one_line_each(odd)] == [
        "required by a, but this PolicyBatch has none" + ON_POLICY_HINT,
        "required by b, but x",
    ]


def test_the_registry_listing_uses_the_same_answer():
    reg = lossplug.registry()
    for row in lossplug.list_plugins():
        if row["kind"] != "preset":
            assert row["requires"] == list(required_fields(reg.plugins[row["kind"]][row["name"]])), row["name"]


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "tis", "icepop"])
def test_gates_always_need_logp_mask_and_advantage(name):
    assert batch_fields(plugin("gate", name))[:3] == ("logp", "action_mask", "advantage")
