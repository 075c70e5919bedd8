"""``maxrl`` (float64): against SkyRL 0.3.0's own ``compute_maxrl_advantage`` (from its wheel, ``tests/_origins.py``) and
against the formula transcribed here group by group, in both conventions (SkyRL's and prime-rl's); hypothesis
properties: equal rewards give 0, a positive rescaling of the rewards changes nothing (eps 0), the rows' order
changes nothing.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossplug

from ..gates._field_origins import skyrl_ppo_utils
from ._grouped import grouped_rewards

F64 = torch.float64
#: measured: SkyRL vs lossplug ≤ 2.3e-16 abs; the transcription ≤ 4.5e-16 abs
ATOL, RTOL = 1e-12, 1e-12

SIZES = [(4, 4, 4, 4), (2, 5, 3, 8, 1, 6), (3, 1, 7)]


def recipe(**params):
    return lossplug.Recipe.model_validate(
        {"advantage": {"name": "maxrl", **params}, "gates": ["ppo_clip"], "reduction": "token"}
    )


def batch_for(gen, sizes, T=6, binary=True):
    group, lengths, mask, score = grouped_rewards(gen, sizes, T, binary)
    B = group.numel()
    token_rewards = torch.zeros(B, T, dtype=F64)
    token_rewards[torch.arange(B), lengths - 1] = score
    batch = lossplug.PolicyBatch(logp=-torch.ones(B, T, dtype=F64), action_mask=mask, reward=score, group_id=group)
    return batch, token_rewards, mask


def transcribed(reward, group, eps, nonpositive_mean, singleton):
    """The formula, group by group: (r − mean) / (mean + ε); singletons and non-positive means by convention."""
    out = torch.zeros_like(reward)
    for g in group.unique():
        rows = (group == g).nonzero().flatten()
        r = reward[rows]
        mean = r.mean()
        if rows.numel() == 1:
            out[rows] = r if singleton == "score" else 0.0
        elif bool((r == r[0]).all()) or (nonpositive_mean == "zero" and mean <= 0):
            out[rows] = 0.0
        else:
            out[rows] = (r - mean) / (mean + eps)
    return out


@pytest.fixture(scope="module")
def ppo_utils(origins):
    return skyrl_ppo_utils(origins)


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("binary", [True, False])
def test_matches_skyrl_compute_maxrl_advantage(ppo_utils, sizes, binary):
    np = pytest.importorskip("numpy")  # SkyRL's uid arrays (numpy comes with the test extras)
    gen = torch.Generator().manual_seed(len(sizes) + 7 * binary)
    batch, token_rewards, mask = batch_for(gen, sizes, binary=binary)
    index = np.array([f"uid-{int(g)}" for g in batch.group_id], dtype=object)
    expected, returns = ppo_utils.compute_maxrl_advantage(token_rewards.clone(), mask.to(F64), index)
    adv = lossplug.compute_advantages(batch, recipe())
    torch.testing.assert_close(torch.where(mask, adv.unsqueeze(-1), 0), expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(returns, expected)


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize(
    "params",
    [
        {},  # SkyRL's conventions
        {"eps": 0.0, "nonpositive_mean": "zero", "singleton": "zero"},  # prime-rl's
        {"eps": 1e-3, "singleton": "zero"},
    ],
    ids=["skyrl", "prime_rl", "mixed"],
)
def test_matches_the_transcribed_formula(sizes, params):
    gen = torch.Generator().manual_seed(3 * len(sizes))
    batch, _, _ = batch_for(gen, sizes, binary=False)
    batch = batch.replace(reward=batch.reward - 0.5)  # some groups with a negative mean
    full = {"eps": 1e-6, "nonpositive_mean": "divide", "singleton": "score", **params}
    expected = transcribed(batch.reward, batch.group_id, **full)
    torch.testing.assert_close(lossplug.compute_advantages(batch, recipe(**params)), expected, atol=ATOL, rtol=RTOL)


def test_binary_rewards_weigh_a_hard_prompt_by_its_inverse_pass_rate():
    # one correct response out of 4 (p̂ = 1/4) vs 3 out of 4 (p̂ = 3/4): A_correct = (1 − p̂)/p̂ = 3 and 1/3
    reward = torch.tensor([1, 0, 0, 0, 1, 1, 1, 0], dtype=F64)
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    batch = lossplug.PolicyBatch(logp=-torch.ones(8, 2, dtype=F64), action_mask=torch.ones(8, 2, dtype=torch.bool))
    adv = lossplug.compute_advantages(batch.replace(reward=reward, group_id=group), recipe(eps=0.0))
    expected = torch.tensor([3, -1, -1, -1, 1 / 3, 1 / 3, 1 / 3, -1], dtype=F64)
    torch.testing.assert_close(adv, expected, atol=1e-15, rtol=0)


def test_a_zero_mean_group_never_divides_by_zero():
    reward = torch.tensor([1.0, -1.0, 0.5, 0.5], dtype=F64)
    group = torch.tensor([0, 0, 1, 1])
    batch = lossplug.PolicyBatch(
        logp=-torch.ones(4, 2, dtype=F64), action_mask=torch.ones(4, 2, dtype=torch.bool), reward=reward, group_id=group
    )
    adv = lossplug.compute_advantages(batch, recipe(eps=0.0))
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]


rewards = st.lists(st.floats(0.0, 10.0, allow_nan=False, width=32), min_size=2, max_size=12)


@settings(max_examples=60, deadline=None)
@given(rewards, st.integers(1, 4), st.floats(0.1, 100.0))
def test_properties(values, n_groups, factor):
    reward = torch.tensor(values, dtype=F64)
    B = reward.numel()
    group = torch.arange(B) % n_groups
    batch = lossplug.PolicyBatch(
        logp=-torch.ones(B, 2, dtype=F64), action_mask=torch.ones(B, 2, dtype=torch.bool), reward=reward, group_id=group
    )
    r = recipe(eps=0.0, singleton="zero")
    adv = lossplug.compute_advantages(batch, r)
    # scale-free: the mean normalisation cancels a positive factor
    scaled = lossplug.compute_advantages(batch.replace(reward=reward * factor), r)
    torch.testing.assert_close(scaled, adv, atol=1e-9, rtol=1e-9)
    # equal rewards in a group: exactly 0
    equal = lossplug.compute_advantages(batch.replace(reward=torch.full_like(reward, values[0])), r)
    assert bool((equal == 0).all())
    # the rows' order is irrelevant
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(B))
    permuted = lossplug.compute_advantages(batch.replace(reward=reward[perm], group_id=group[perm]), r)
    # (a group's mean is summed in another order: equal up to rounding)
    torch.testing.assert_close(permuted, adv[perm], atol=1e-15 * max(1.0, float(adv.abs().max())), rtol=1e-13)
    # each group's advantages sum to 0 (the centring), whenever its mean is positive
    for g in range(n_groups):
        rows = group == g
        if reward[rows].mean() > 0:
            assert abs(float(adv[rows].sum())) <= 1e-9 * max(1.0, float(adv[rows].abs().max()))
