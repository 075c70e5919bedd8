"""The rollout side of a recipe: shapers and filters run once per batch, in the recipe's order, before the advantage
(lossplug.rollout); what they return is checked with the plugin named; what a filter drops leaves the advantage's
group statistics and comes back as the action mask the adapters hand to the trainer."""

from __future__ import annotations

import types

import pytest
import torch

import lossplug
from lossplug import PolicyBatch

PLAIN = {"gates": ["ppo_clip"], "reduction": "token"}


def batch(**over) -> PolicyBatch:
    """Three prompt groups of two; group 1's rewards are equal; rows of different lengths."""
    B, T = 6, 5
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:] = False
    mask[4, 1:] = False
    fields = dict(
        logp=-torch.rand(B, T, generator=g, dtype=torch.float64),
        action_mask=mask,
        old_logp=-torch.rand(B, T, generator=g, dtype=torch.float64),
        ref_logp=-torch.rand(B, T, generator=g, dtype=torch.float64),
        reward=torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, -1.0], dtype=torch.float64),
        group_id=torch.tensor([0, 0, 1, 1, 2, 2]),
    )
    return PolicyBatch(**{**fields, **over})


def recipe(**stages) -> dict:
    return {**PLAIN, "advantage": "grpo", **stages}


@pytest.fixture
def plugin(fresh_registry):
    """Register an in-process plugin module made of the given hook implementations; unregistered after the test."""
    registered = []

    def register(**hooks):
        module = types.SimpleNamespace(**{name: lossplug.hookimpl(fn) for name, fn in hooks.items()})
        lossplug.register_plugin(module, f"test-rollout-{len(registered)}")
        registered.append(module)

    yield register
    for module in registered:
        lossplug.unregister_plugin(module)


def shaper_returning(make):
    @lossplug.shaper("custom_shaper")
    def custom(inp, p):
        """A test shaper."""
        return make(inp)

    def lossplug_register_shapers(register):
        register(custom)

    return lossplug_register_shapers


def filter_returning(make):
    @lossplug.filter("custom_filter")
    def custom(inp, p):
        """A test filter."""
        return make(inp)

    def lossplug_register_filters(register):
        register(custom)

    return lossplug_register_filters


# ---------------------------------------------------------------------------------------------------------------------
# Recipes


def test_a_recipe_lists_shapers_and_filters_before_the_advantage_and_round_trips():
    r = lossplug.Recipe.model_validate(
        recipe(shapers=[{"name": "reward_scale", "scale": 2.0}, "reward_clip"], filters="zero_variance")
    )
    assert [s.name for s in r.shapers] == ["reward_scale", "reward_clip"]
    assert [f.name for f in r.filters] == ["zero_variance"]
    data = r.to_dict()
    assert list(data)[:3] == ["shapers", "filters", "advantage"]
    assert lossplug.Recipe.model_validate(data) == r
    assert lossplug.Recipe.from_yaml(r.to_yaml()) == r


def test_a_wrong_shaper_or_filter_is_named_with_its_stage():
    with pytest.raises(lossplug.RecipeError) as info:
        lossplug.Recipe.model_validate(recipe(shapers=["reward_clp"], filters=[{"name": "zero_variance", "x": 1}]))
    text = str(info.value)
    assert "recipe.shapers[0]" in text and "reward_clip" in text  # the suggestion
    assert "recipe.filters[0]" in text and "x" in text
    with pytest.raises(lossplug.RecipeError, match=r"recipe.shapers: must be a list"):
        lossplug.Recipe.model_validate(recipe(shapers=3))


def test_shapers_and_filters_are_listed_beside_the_other_kinds():
    rows = lossplug.list_plugins()
    kinds = {r["kind"] for r in rows}
    assert {"shaper", "filter"} <= kinds
    names = {(r["kind"], r["name"]) for r in rows}
    assert {("shaper", "kl_in_reward"), ("shaper", "reward_clip"), ("filter", "zero_variance")} <= names


# ---------------------------------------------------------------------------------------------------------------------
# Order and effect


def test_shapers_run_in_the_recipe_order():
    b = batch()
    scale_then_clip = lossplug.estimate_advantages(
        b, recipe(shapers=[{"name": "reward_scale", "scale": 3.0}, {"name": "reward_clip", "low": -1, "high": 1}])
    )
    clip_then_scale = lossplug.estimate_advantages(
        b, recipe(shapers=[{"name": "reward_clip", "low": -1, "high": 1}, {"name": "reward_scale", "scale": 3.0}])
    )
    r = b.reward
    assert torch.equal(scale_then_clip.reward, (3 * r).clamp(-1, 1))
    assert torch.equal(clip_then_scale.reward, 3 * r.clamp(-1, 1))


def test_the_advantage_sees_the_shaped_reward():
    b = batch()
    shaped = lossplug.estimate_advantages(b, recipe(shapers=[{"name": "reward_clip", "low": 0.0, "high": 1.0}]))
    by_hand = lossplug.estimate_advantages(b.replace(reward=b.reward.clamp(0, 1)), recipe())
    torch.testing.assert_close(shaped.advantage, by_hand.advantage, rtol=0, atol=0)


def test_a_filtered_response_leaves_the_group_statistics_and_gets_advantage_zero():
    b = batch()
    res = lossplug.estimate_advantages(b, recipe(filters=["zero_variance"]))
    kept = torch.tensor([True, True, False, False, True, True])
    assert torch.equal(res.action_mask, b.action_mask & kept.unsqueeze(-1))
    assert torch.equal(res.advantage[~kept], torch.zeros(2, dtype=res.advantage.dtype))
    subset = PolicyBatch(**{k: v[kept] for k, v in b.fields().items()})
    alone = lossplug.compute_advantages(subset, recipe())
    torch.testing.assert_close(res.advantage[kept], alone, rtol=0, atol=0)
    assert float(res.metric_tensors["filter/zero_variance/dropped_responses"]) == pytest.approx(2 / 6)
    assert float(res.metric_tensors["rollout/kept_responses"]) == pytest.approx(4 / 6)


def test_a_token_filter_narrows_the_mask_and_the_rows_it_empties_leave(plugin):
    plugin(lossplug_register_filters=filter_returning(lambda inp: torch.arange(5).expand(6, 5) < 2))
    b = batch()
    res = lossplug.estimate_advantages(b, recipe(filters=["custom_filter"]))
    assert torch.equal(res.action_mask, b.action_mask & (torch.arange(5) < 2))
    assert res.action_mask[4].sum() == 1  # its one action token survives
    tokens = float(res.metric_tensors["filter/custom_filter/dropped_tokens"])
    assert tokens == pytest.approx(1 - int(res.action_mask.sum()) / int(b.action_mask.sum()))


def test_a_filter_can_only_narrow(plugin):
    plugin(lossplug_register_filters=filter_returning(lambda inp: torch.ones(6, 5, dtype=torch.bool)))
    b = batch()
    res = lossplug.estimate_advantages(b, recipe(filters=["custom_filter"]))
    assert torch.equal(res.action_mask, b.action_mask)


def test_when_every_response_is_filtered_nothing_is_learnt_and_nothing_raises():
    b = batch(reward=torch.tensor([1.0, 1.0, 0.5, 0.5, 2.0, 2.0], dtype=torch.float64))
    res = lossplug.estimate_advantages(b, recipe(filters=["zero_variance"]))
    assert not res.action_mask.any()
    assert torch.equal(res.advantage, torch.zeros(6, dtype=torch.float64))
    assert float(res.metric_tensors["rollout/kept_responses"]) == 0.0


def test_the_stages_see_what_earlier_stages_left(plugin):
    seen = {}

    def record(inp):
        seen["reward"] = inp.batch.reward.clone()
        seen["rows"] = inp.rows.clone()
        return torch.ones(6, dtype=torch.bool)

    plugin(lossplug_register_filters=filter_returning(record))
    b = batch()
    lossplug.estimate_advantages(
        b, recipe(shapers=[{"name": "reward_scale", "scale": 2.0}], filters=["zero_variance", "custom_filter"])
    )
    assert torch.equal(seen["reward"], 2 * b.reward)
    assert seen["rows"].tolist() == [True, True, False, False, True, True]


# ---------------------------------------------------------------------------------------------------------------------
# What a stage returns is checked, naming it


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda inp: [1.0] * 6, "must return the reward as a tensor"),
        (lambda inp: torch.zeros(3, dtype=torch.float64), "returned a reward of shape [3]"),
        (lambda inp: torch.zeros(6, dtype=torch.int64), "dtype torch.int64"),
        (lambda inp: inp.batch.reward.masked_fill(torch.arange(6) == 4, float("nan")), "not finite: row [4]"),
    ],
)
def test_a_shaper_output_that_breaks_the_contract_is_named(plugin, make, message):
    plugin(lossplug_register_shapers=shaper_returning(make))
    with pytest.raises(lossplug.PluginError) as info:
        lossplug.estimate_advantages(batch(), recipe(shapers=["custom_shaper"]))
    assert "recipe.shapers[0] (custom_shaper)" in str(info.value) and message in str(info.value)


def test_a_per_token_reward_cannot_become_per_response(plugin):
    plugin(lossplug_register_shapers=shaper_returning(lambda inp: inp.batch.reward.sum(-1)))
    token_reward = torch.where(batch().action_mask, 0.5, 0.0).to(torch.float64)
    with pytest.raises(lossplug.PluginError, match=r"shape \[6\]; the batch's is \[6, 5\]"):
        lossplug.estimate_advantages(batch(reward=token_reward), recipe(shapers=["custom_shaper"]))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda inp: torch.ones(6), "must return a bool keep mask"),
        (lambda inp: torch.ones(6, 4, dtype=torch.bool), "keep mask of shape [6, 4]"),
    ],
)
def test_a_filter_output_that_breaks_the_contract_is_named(plugin, make, message):
    plugin(lossplug_register_filters=filter_returning(make))
    with pytest.raises(lossplug.PluginError) as info:
        lossplug.estimate_advantages(batch(), recipe(filters=["custom_filter"]))
    assert "recipe.filters[0] (custom_filter)" in str(info.value) and message in str(info.value)


def test_a_bug_inside_a_shaper_names_it(plugin):
    plugin(lossplug_register_shapers=shaper_returning(lambda inp: 1 / 0))
    with pytest.raises(lossplug.PluginError, match=r"recipe.shapers\[0\] \(custom_shaper, from .*ZeroDivisionError"):
        lossplug.estimate_advantages(batch(), recipe(shapers=["custom_shaper"]))


# ---------------------------------------------------------------------------------------------------------------------
# Bad input


def test_a_field_a_shaper_reads_is_required_naming_the_stage():
    b = PolicyBatch(**{k: v for k, v in batch().fields().items() if k != "ref_logp"})
    with pytest.raises(lossplug.BatchValidationError) as info:
        lossplug.estimate_advantages(b, recipe(shapers=["kl_in_reward"]))
    assert "ref_logp" in str(info.value) and "recipe.shapers[0] (kl_in_reward)" in str(info.value)


def test_a_non_finite_reward_is_named_before_any_shaping():
    with pytest.raises(lossplug.BatchValidationError) as info:
        PolicyBatch(
            **{**batch().fields(), "reward": torch.tensor([1.0, float("inf"), 0, 0, 1, 0], dtype=torch.float64)}
        )
    assert "reward: must be finite — row [1]" in str(info.value)


def test_the_rollout_stages_need_a_reward():
    b = PolicyBatch(**{k: v for k, v in batch().fields().items() if k != "reward"})
    with pytest.raises(lossplug.BatchValidationError, match=r"reward"):
        lossplug.estimate_advantages(b, {**PLAIN, "advantage": "opd", "shapers": ["reward_clip"]})


def test_a_packed_batch_has_no_rollout_stages_yet():
    from lossplug.testing import batches

    packed = lossplug.PackedTransitions(**batches.packed_fields())
    with pytest.raises(lossplug.LossplugError, match="PackedTransitions batch has no rollout stages"):
        lossplug.estimate_advantages(packed, {**PLAIN, "advantage": "gae", "shapers": ["reward_clip"]})


# ---------------------------------------------------------------------------------------------------------------------
# State across steps


def test_a_shapers_controller_is_the_recipes_and_survives_a_registry_rebuild(plugin):
    r = lossplug.Recipe.model_validate(
        recipe(
            shapers=[{"name": "kl_in_reward", "coef": 0.1, "controller": "adaptive", "target_kl": 0.01, "horizon": 10}]
        )
    )
    lossplug.estimate_advantages(batch(), r)
    state = lossplug.controller_state(r)
    assert list(state) == ["shapers[0]"] and state["shapers[0]"]["value"] != 0.1
    plugin(lossplug_register_filters=filter_returning(lambda inp: inp.rows))  # rebuilds the registry
    assert lossplug.controller_state(r) == state
    lossplug.estimate_advantages(batch(), r)
    assert lossplug.controller_state(r) != state


def test_a_fixed_coefficient_does_not_move():
    r = lossplug.Recipe.model_validate(recipe(shapers=[{"name": "kl_in_reward", "coef": 0.1}]))
    for _ in range(2):
        res = lossplug.estimate_advantages(batch(), r)
    assert lossplug.controller_state(r) == {"shapers[0]": {"value": 0.1}}
    assert float(res.metric_tensors["shaper/kl_in_reward/coef"]) == 0.1


def test_the_same_shaper_twice_keeps_two_metric_names():
    res = lossplug.estimate_advantages(
        batch(), recipe(shapers=[{"name": "reward_clip", "low": -5, "high": 5}, {"name": "reward_clip", "high": 0.5}])
    )
    assert {"shaper/reward_clip.0/clipped_fraction", "shaper/reward_clip.1/clipped_fraction"} <= set(res.metric_tensors)
