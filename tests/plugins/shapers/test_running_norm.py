"""running_norm is ROLL's running reward normalisation: RunningMoments.update then (r − mean)/(std + 1e-6), over
several batches (ROLL's class transcribed below from alibaba/ROLL 4142237, roll/utils/functionals.py); its statistics
are the same when the batch is split over two ranks, and survive a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

import lossplug
from lossplug.peers import Peers


class RollRunningMoments:
    """ROLL's RunningMoments, transcribed (float64 here: the test compares the arithmetic, not float32 rounding)."""

    def __init__(self):
        self.mean, self.std, self.var, self.count = 0.0, 1.0, 1.0, 1e-24

    def update(self, xs: torch.Tensor) -> None:
        xs_count = xs.numel()
        xs_var, xs_mean = torch.var_mean(xs, unbiased=False)
        delta = xs_mean - self.mean
        tot_count = self.count + xs_count
        new_sum = xs_var * xs_count
        old_sum = self.var * self.count + delta**2 * self.count * xs_count / tot_count
        tot_sum = old_sum + new_sum
        self.mean += delta * xs_count / tot_count
        self.var = tot_sum / tot_count
        self.std = (self.var * tot_count / (tot_count - 1)).sqrt()
        self.count = tot_count


def batches(n: int = 3, B: int = 8):
    g = torch.Generator().manual_seed(2)
    for _ in range(n):
        yield lossplug.PolicyBatch(
            logp=torch.full((B, 4), -1.0, dtype=torch.float64),
            action_mask=torch.ones(B, 4, dtype=torch.bool),
            reward=3 * torch.randn(B, generator=g, dtype=torch.float64) + 1,
            group_id=torch.arange(B) // 4,
        )


RECIPE = {"shapers": ["running_norm"], "advantage": "grpo", "gates": ["ppo_clip"], "reduction": "token"}


def test_three_batches_equal_rolls_running_normalisation():
    recipe = lossplug.Recipe.model_validate(RECIPE)
    roll = RollRunningMoments()
    for b in batches():
        shaped = lossplug.estimate_advantages(b, recipe).reward
        roll.update(b.reward)
        torch.testing.assert_close(shaped, (b.reward - roll.mean) / (roll.std + 1e-6), rtol=1e-12, atol=1e-12)
    state = lossplug.controller_state(recipe)["shapers[0]"]
    assert state["mean"] == pytest.approx(float(roll.mean), rel=1e-12)
    assert state["std"] == pytest.approx(float(roll.std), rel=1e-12)


def test_split_over_two_ranks_the_statistics_are_the_whole_batchs():
    whole, split = (lossplug.Recipe.model_validate(RECIPE) for _ in range(2))
    (b,) = batches(1)
    lossplug.estimate_advantages(b, whole)
    halves = (slice(0, 4), slice(4, 8))
    other = {"sum": None}

    # rank 0's peers add rank 1's half; the all-reduce of each rank sees both halves' [n, Σr, Σr²]
    def rank_sum(own: torch.Tensor) -> torch.Tensor:
        return own + other["sum"]

    r1 = b.reward[halves[1]].double()
    other["sum"] = torch.stack([torch.tensor(4.0, dtype=torch.float64), r1.sum(), (r1 * r1).sum()])
    half = lossplug.PolicyBatch(**{k: v[halves[0]] for k, v in b.fields().items()})
    lossplug.estimate_advantages(half, split, peers=Peers(size=2, all_gather=lambda t: t, all_sum=rank_sum))
    got, expected = lossplug.controller_state(split)["shapers[0]"], lossplug.controller_state(whole)["shapers[0]"]
    for key in ("mean", "var", "std", "count"):
        assert got[key] == pytest.approx(expected[key], rel=1e-12), key


def test_a_resumed_run_normalises_as_an_uninterrupted_one():
    first = list(batches())
    straight = lossplug.Recipe.model_validate(RECIPE)
    expected = [lossplug.estimate_advantages(b, straight).reward for b in first]
    before = lossplug.Recipe.model_validate(RECIPE)
    lossplug.estimate_advantages(first[0], before)
    saved = json.loads(json.dumps(lossplug.controller_state(before)))
    resumed = lossplug.Recipe.model_validate(RECIPE)
    lossplug.load_controller_state(resumed, saved)
    for b, want in zip(first[1:], expected[1:], strict=True):
        assert torch.equal(lossplug.estimate_advantages(b, resumed).reward, want)


def test_a_per_token_reward_is_refused_with_the_order_to_use():
    b = next(batches(1))
    token = b.replace(reward=torch.where(b.action_mask, 0.5, 0.0).double())
    with pytest.raises(lossplug.LossplugError, match=r"recipe.shapers\[0\] \(running_norm\) takes response rewards"):
        lossplug.estimate_advantages(token, RECIPE)
