"""``reward_clip`` and ``reward_scale`` against the code they come from, written out here from the cited source:

* OpenRLHF ``compute_reward`` (openrlhf 0.11.2, ``openrlhf/models/utils.py``)::

      if reward_clip_range:
          r = r.clamp(min=reward_clip_range[0], max=reward_clip_range[1])

  and OpenRLHF's own function, read from its published wheel (the ``origins`` fixture), with the KL term off: its
  ``[B, T]`` reward is the clipped score on each response's last action token;
* AReaL ``PPOActor.compute_advantages`` (areal 1.0.4, ``areal/trainer/ppo/actor.py``)::

      reward_score = (reward_score + self.reward_bias) * self.reward_scaling
      reward_score = torch.clip(reward_score, max=self.reward_clip, min=-self.reward_clip)

  which is ``reward_scale`` then ``reward_clip`` in a row.

Each holds for a ``[B]`` score and for the same score as a ``[B, T]`` reward on the last action token (verl's
``token_level_rewards``, what the verl adapter hands the shapers): one recipe, the same reward in TRL and verl. Off
the action tokens a per-token reward stays 0. Then the properties (hypothesis, the profile of ``tests/conftest.py``):
clipping is idempotent and within its bounds, scaling is undone by its inverse up to rounding.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug import PolicyBatch, Recipe

B, T = 5, 8
#: row 0: a prompt column masked in front; row 2: a masked tool reply inside the response; the last column: no row
ACTION_MASK = torch.tensor(
    [
        [0, 1, 1, 1, 1, 1, 1, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 1, 0, 0],
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
    ],
    dtype=torch.bool,
)
SCORES = torch.tensor([-14.0, 3.5, 0.25, 12.0, -0.75], dtype=torch.float64)


def last_action(mask: torch.Tensor) -> torch.Tensor:
    """Each row's last action token, as OpenRLHF finds it (``size − 1 − fliplr(mask).argmax``)."""
    return mask.size(1) - 1 - mask.long().fliplr().argmax(dim=1)


def on_last_token(scores: torch.Tensor, mask: torch.Tensor = ACTION_MASK) -> torch.Tensor:
    """A ``[B]`` score as a ``[B, T]`` reward on the last action token (verl's token_level_scores)."""
    out = torch.zeros(mask.shape, dtype=scores.dtype)
    out[torch.arange(mask.shape[0]), last_action(mask)] = scores
    return out


def policy_batch(reward: torch.Tensor, mask: torch.Tensor = ACTION_MASK) -> PolicyBatch:
    return PolicyBatch(logp=torch.full(mask.shape, -1.0, dtype=reward.dtype), action_mask=mask, reward=reward)


def shaped(reward: torch.Tensor, *shapers: Any, mask: torch.Tensor = ACTION_MASK) -> torch.Tensor:
    recipe = Recipe.load({"gates": ["reinforce"], "reduction": "token", "shapers": list(shapers)})
    return lossplug.apply_rollout_stages(policy_batch(reward, mask), lossplug.compile_recipe(recipe)).reward


def openrlhf_clip(r: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """OpenRLHF's clip, written out (compute_reward's first two lines)."""
    return r.clamp(min=low, max=high)


def areal_shaping(r: torch.Tensor, reward_bias: float, reward_scaling: float, reward_clip: float) -> torch.Tensor:
    """AReaL's reward shaping, written out (compute_advantages' three lines)."""
    r = (r + reward_bias) * reward_scaling
    return torch.clip(r, max=reward_clip, min=-reward_clip)


# ---------------------------------------------------------------------------------------------------------------------
# The origins


@pytest.mark.parametrize(("low", "high"), [(-10.0, 10.0), (-1.0, 2.0), (0.5, 3.0)])
def test_reward_clip_is_openrlhfs_clamp_for_a_score_and_for_it_on_the_last_action_token(low, high):
    clip = {"name": "reward_clip", "low": low, "high": high}
    expected = openrlhf_clip(SCORES, low, high)
    assert torch.equal(shaped(SCORES, clip), expected)
    per_token = shaped(on_last_token(SCORES), clip)
    assert torch.equal(per_token, on_last_token(expected)), "not the [B] score's clip, or off the last action token"


def test_reward_clip_is_openrlhfs_own_compute_reward(origins):
    """OpenRLHF's function from its wheel (kl_coef 0: the reward is the clipped score on the last action token)."""
    utils = origins.module("openrlhf.models.utils", {"deepspeed": types.ModuleType("deepspeed")})
    for low, high in [(-10.0, 10.0), (-1.0, 2.0), (0.5, 3.0)]:
        theirs = utils.compute_reward(
            SCORES.clone(), 0.0, torch.zeros(B, T, dtype=torch.float64), ACTION_MASK, reward_clip_range=(low, high)
        )
        clip = {"name": "reward_clip", "low": low, "high": high}
        assert torch.equal(on_last_token(shaped(SCORES, clip)), theirs)
        assert torch.equal(shaped(on_last_token(SCORES), clip), theirs)


@pytest.mark.parametrize(
    ("reward_bias", "reward_scaling", "reward_clip"), [(0.0, 1.0, 20.0), (-0.5, 2.0, 5.0), (1.25, 0.1, 0.5)]
)
def test_scale_then_clip_is_areals_reward_shaping(reward_bias, reward_scaling, reward_clip):
    shapers = [
        {"name": "reward_scale", "bias": reward_bias, "scale": reward_scaling},
        {"name": "reward_clip", "low": -reward_clip, "high": reward_clip},
    ]
    expected = areal_shaping(SCORES, reward_bias, reward_scaling, reward_clip)
    assert torch.equal(shaped(SCORES, *shapers), expected)
    assert torch.equal(shaped(on_last_token(SCORES), *shapers), on_last_token(expected))


def test_float32_scores_give_float32_rewards_equal_to_the_origins():
    scores = SCORES.float()
    clip = {"name": "reward_clip", "low": -1.0, "high": 2.0}
    shapers = [{"name": "reward_scale", "bias": -0.3, "scale": 1.7}, {"name": "reward_clip", "low": -5, "high": 5}]
    assert torch.equal(shaped(scores, clip), openrlhf_clip(scores, -1.0, 2.0))
    assert torch.equal(shaped(on_last_token(scores), *shapers), on_last_token(areal_shaping(scores, -0.3, 1.7, 5.0)))


# ---------------------------------------------------------------------------------------------------------------------
# Per-token rewards


def dense_reward(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.where(ACTION_MASK, 3 * torch.randn(B, T, generator=g, dtype=torch.float64), 0.0)


def test_reward_scale_on_a_per_token_reward_scales_every_action_token_and_adds_the_bias_once():
    r = dense_reward()
    out = shaped(r, {"name": "reward_scale", "bias": 0.5, "scale": -2.0})
    last = torch.zeros_like(ACTION_MASK)
    last[torch.arange(B), last_action(ACTION_MASK)] = True
    assert torch.equal(out[ACTION_MASK & ~last], -2.0 * r[ACTION_MASK & ~last])
    assert torch.equal(out[last], -2.0 * (r[last] + 0.5))
    assert torch.equal(out[~ACTION_MASK], torch.zeros_like(out[~ACTION_MASK]))
    torch.testing.assert_close(out.sum(-1), -2.0 * (r.sum(-1) + 0.5), rtol=1e-14, atol=1e-14)


def test_reward_clip_on_a_per_token_reward_clips_each_responses_sum_on_its_last_action_token():
    r = dense_reward()
    out = shaped(r, {"name": "reward_clip", "low": -1.0, "high": 1.0})
    torch.testing.assert_close(out.sum(-1), r.sum(-1).clamp(-1, 1), rtol=1e-14, atol=1e-14)
    last = torch.zeros_like(ACTION_MASK)
    last[torch.arange(B), last_action(ACTION_MASK)] = True
    assert torch.equal(out[~last], r[~last]), "only the last action token changes"
    assert torch.equal(out[~ACTION_MASK], torch.zeros_like(out[~ACTION_MASK]))


def test_reward_clip_per_token_clips_each_action_token_and_leaves_the_rest_0():
    r = dense_reward()
    out = shaped(r, {"name": "reward_clip", "low": 0.5, "high": 1.0, "per_token": True})
    assert torch.equal(out[ACTION_MASK], r[ACTION_MASK].clamp(0.5, 1.0))
    assert torch.equal(out[~ACTION_MASK], torch.zeros_like(out[~ACTION_MASK])), "a bound above 0 leaked off the actions"


def test_clipped_fraction_counts_responses_or_action_tokens_not_padding():
    recipe = Recipe.load({"gates": ["reinforce"], "reduction": "token", "shapers": ["reward_clip"]})
    res = lossplug.apply_rollout_stages(policy_batch(on_last_token(SCORES)), lossplug.compile_recipe(recipe))
    assert float(res.metric_tensors["shaper/reward_clip/clipped_fraction"]) == pytest.approx(2 / B)  # -14 and 12
    per_token = Recipe.load(
        {"gates": ["reinforce"], "reduction": "token", "shapers": [{"name": "reward_clip", "per_token": True}]}
    )
    res = lossplug.apply_rollout_stages(policy_batch(on_last_token(SCORES)), lossplug.compile_recipe(per_token))
    assert float(res.metric_tensors["shaper/reward_clip/clipped_fraction"]) == pytest.approx(2 / int(ACTION_MASK.sum()))


# ---------------------------------------------------------------------------------------------------------------------
# Properties

finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)
scores = st.lists(finite, min_size=B, max_size=B).map(lambda v: torch.tensor(v, dtype=torch.float64))
bounds = st.tuples(finite, finite).map(sorted)


@given(r=scores, bound=bounds, per_token_reward=st.booleans())
def test_clip_is_idempotent_and_within_its_bounds(r, bound, per_token_reward):
    low, high = bound
    clip = {"name": "reward_clip", "low": low, "high": high}
    reward = on_last_token(r) if per_token_reward else r
    once = shaped(reward, clip)
    assert torch.equal(shaped(once, clip), once)
    totals = once.sum(-1) if per_token_reward else once
    assert bool(((totals >= low) & (totals <= high)).all())
    if per_token_reward:
        assert torch.equal(once[~ACTION_MASK], torch.zeros_like(once[~ACTION_MASK]))


@given(
    r=scores,
    scale=st.floats(1e-3, 1e3).flatmap(lambda m: st.sampled_from([m, -m])),
    bias=st.floats(-1e3, 1e3),
    per_token_reward=st.booleans(),
)
def test_scale_then_its_inverse_is_the_identity_up_to_rounding(r, scale, bias, per_token_reward):
    reward = on_last_token(r) if per_token_reward else r
    there = shaped(reward, {"name": "reward_scale", "bias": bias, "scale": scale})
    back = shaped(there, {"name": "reward_scale", "bias": -bias * scale, "scale": 1 / scale})
    # three roundings (the bias, the scale, and the inverse's) of values up to ~1e6 + 1e3
    torch.testing.assert_close(back, reward, rtol=1e-12, atol=1e-9)
