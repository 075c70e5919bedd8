"""The rollout stages on TRL's gathered rewards, without building a trainer (gathered_advantages): what a filter
drops, what a shaper writes, their metrics' names, unscorable rows, and evaluation leaving a shaper's state alone."""

from __future__ import annotations

import types

import pytest
import torch

import lossplug
from lossplug.adapters.trl import AdapterState
from lossplug.adapters.trl.advantages import gathered_advantages


def fake_trainer(recipe: dict):
    recipe_obj = lossplug.Recipe.load(recipe)
    state = AdapterState(
        recipe=recipe_obj,
        compiled=lossplug.compile_recipe(recipe_obj),
        validate="full",
        population="generation",
        provenance=lossplug.Provenance(),
        kl_sequence_level=False,
    )
    return types.SimpleNamespace(_lossplug=state, reward_weights=torch.ones(1))


CLIP_AND_FILTER = {
    "advantage": "grpo",
    "shapers": [{"name": "reward_clip", "low": 0.0, "high": 1.0}],
    "filters": ["zero_variance"],
    "gates": ["ppo_clip"],
    "reduction": "token",
}


def test_a_group_made_constant_by_the_clip_is_filtered_and_the_others_keep_their_advantages():
    # group 0: 2.0 and 3.0 both clip to 1.0 (constant after the shaper); group 1: mixed
    rewards = torch.tensor([[2.0], [3.0], [0.0], [1.0]])
    out = gathered_advantages(fake_trainer(CLIP_AND_FILTER), rewards, num_generations=2)
    assert out.in_play.tolist() == [False, False, True, True]
    assert out.rewards.tolist() == [1.0, 1.0, 0.0, 1.0]  # the shaped reward goes back to TRL's batch
    assert out.advantages[:2].tolist() == [0.0, 0.0] and out.advantages[2] < 0 < out.advantages[3]
    assert out.metrics["filter/zero_variance/dropped_responses"].item() == pytest.approx(0.5)
    assert out.metrics["shaper/reward_clip/clipped_fraction"].item() == pytest.approx(0.5)
    assert not [k for k in out.metrics if k.startswith(("advantage/shaper", "advantage/filter"))]


def test_unscorable_completions_are_neither_filtered_nor_shaped():
    nan = float("nan")
    rewards = torch.tensor([[nan], [0.5], [0.0], [1.0]])  # group 0: one scorable completion (verl keeps singletons)
    out = gathered_advantages(fake_trainer(CLIP_AND_FILTER), rewards, num_generations=2)
    assert out.in_play.tolist() == [True, True, True, True]  # in TRL's denominators, as TRL keeps them
    assert torch.isnan(out.rewards[0]) and out.advantages[:2].tolist() == [0.0, 0.0]


def test_without_a_filter_nothing_is_handed_back_as_filtered():
    recipe = {**CLIP_AND_FILTER, "filters": []}
    out = gathered_advantages(fake_trainer(recipe), torch.tensor([[1.0], [1.0]]), num_generations=2)
    assert out.in_play is None


class Count:
    """How many batches a shaper saw (a :class:`lossplug.StepController`)."""

    def __init__(self, p: object) -> None:
        self.batches, self._seen = 0, False

    @property
    def coefficient(self) -> float:
        return float(self.batches)

    def observe(self, observation: torch.Tensor) -> None:
        self._seen = True

    def step(self, all_reduce=None) -> float:
        self.batches += int(self._seen)
        self._seen = False
        return self.coefficient

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state) -> None:
        self.batches, self._seen = int(state["batches"]), False


@lossplug.shaper("count_batches", controller=Count)
def count_batches(inp: lossplug.RolloutInput, p) -> lossplug.ShaperOutput:
    """The reward unchanged; counts the batches."""
    return lossplug.ShaperOutput(reward=inp.batch.reward, observation=torch.ones(()))


class CountPlugin:
    @lossplug.hookimpl
    def lossplug_register_shapers(self, register):
        register(count_batches)


def test_evaluation_leaves_a_shapers_state_as_it_was():
    plugin = CountPlugin()
    lossplug.register_plugin(plugin, "count_batches")
    try:
        trainer = fake_trainer({**CLIP_AND_FILTER, "shapers": ["count_batches"], "filters": []})
        rewards = torch.tensor([[0.0], [1.0]])
        gathered_advantages(trainer, rewards, num_generations=2)
        gathered_advantages(trainer, rewards, num_generations=2, train=False)
        assert lossplug.controller_state(trainer._lossplug.recipe) == {"shapers[0]": {"batches": 1}}
        gathered_advantages(trainer, rewards, num_generations=2)
        assert lossplug.controller_state(trainer._lossplug.recipe) == {"shapers[0]": {"batches": 2}}
    finally:
        lossplug.unregister_plugin(plugin)
