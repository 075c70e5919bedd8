"""group_advantages on TRL's gathered rewards, without building a trainer: unscorable completions and groups that
become too small for the estimator."""

import math
import types

import pytest
import torch

import lossplug
from lossplug.adapters.trl import AdapterState, group_advantages


def fake_trainer(recipe_name: str):
    recipe = lossplug.Recipe.preset(recipe_name)
    state = AdapterState(
        recipe=recipe,
        compiled=lossplug.compile_recipe(recipe),
        validate="full",
        population="generation",
        provenance=lossplug.Provenance(),
        kl_sequence_level=False,
    )
    return types.SimpleNamespace(_lossplug=state, reward_weights=torch.ones(1))


def test_rloo_gives_zero_to_groups_left_with_one_scorable_completion():
    nan = float("nan")
    # two groups of 3; the first loses two completions to a reward function that returned None
    rewards = torch.tensor([[1.0], [nan], [nan], [0.0], [1.0], [1.0]])
    trainer = fake_trainer("rloo")
    with pytest.warns(UserWarning, match="1 completions are in groups with fewer than 2 scorable completions"):
        adv, reward, group_ids, metrics = group_advantages(trainer, rewards, num_generations=3)
    assert group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    torch.testing.assert_close(adv[3:], torch.tensor([-1.0, 0.5, 0.5]))
    assert math.isnan(reward[1]) and metrics["reward/too_small_group_frac"].item() == pytest.approx(1 / 6)


def test_grpo_keeps_singleton_groups_at_zero_without_a_warning(recwarn):
    rewards = torch.tensor([[1.0], [float("nan")], [0.0], [1.0]])
    adv, *_ = group_advantages(fake_trainer("dapo"), rewards, num_generations=2)
    assert adv[:2].tolist() == [0.0, 0.0] and adv[2] < 0 < adv[3]
    assert not [w for w in recwarn if "scorable" in str(w.message)]
