"""``batch_normalized`` (float64): against each framework's formula transcribed here — rLLM's ``prpo`` (numpy's
population std, ε 1e-6) and ``reinforce`` (the raw reward), OpenRLHF's ``flash_reinforce`` (the batch-mean
baseline), ROLL's ``reward_norm`` with batch mean and std (torch's sample std, ε 1e-6) — and, end to end, the loss and
gradient of a REINFORCE recipe against ``−Σ A·logp / N``. Properties: a constant batch gets 0 when centred, the
rows' order changes nothing, groups are ignored.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossplug

F64 = torch.float64
#: measured: ≤ 4.5e-16 abs against the numpy/torch transcriptions
ATOL, RTOL = 1e-12, 1e-12


def recipe(**params):
    return lossplug.Recipe.model_validate(
        {"advantage": {"name": "batch_normalized", **params}, "gates": ["reinforce"], "reduction": "token"}
    )


def batch_for(seed, B=9, T=5, binary=False, token_rewards=False):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = torch.arange(T) < lengths[:, None]
    score = (torch.rand(B, generator=gen) < 0.4).to(F64) if binary else torch.randn(B, generator=gen, dtype=F64) * 2
    reward = score
    if token_rewards:  # the outcome on the last action token, as a [B, T] reward
        reward = torch.zeros(B, T, dtype=F64)
        reward[torch.arange(B), lengths - 1] = score
    logp = -(0.1 + torch.rand(B, T, generator=gen, dtype=F64))
    return lossplug.PolicyBatch(logp=logp, action_mask=mask, reward=reward), score


def rllm_prpo(score):
    np = pytest.importorskip("numpy")  # the transcription is rLLM's numpy code
    r = score.numpy()
    return torch.from_numpy((r - np.mean(r)) / (np.std(r) + 1e-6))


def roll_batch_norm(score):
    return (score - score.mean()) / (score.std() + 1e-6)


CASES = [
    ({}, rllm_prpo),
    ({"center": "none", "scale": False}, lambda s: s.clone()),  # rLLM reinforce, NeMo-RL raw_reward
    ({"scale": False}, lambda s: s - s.mean()),  # OpenRLHF flash_reinforce
    ({"std": "sample"}, roll_batch_norm),
]


@pytest.mark.parametrize("params,oracle", CASES, ids=["prpo", "raw", "flash_reinforce", "roll"])
@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("token_rewards", [False, True])
def test_matches_the_frameworks_formulas(params, oracle, binary, token_rewards):
    for seed in range(4):
        batch, score = batch_for(seed, binary=binary, token_rewards=token_rewards)
        adv = lossplug.compute_advantages(batch, recipe(**params))
        torch.testing.assert_close(adv, oracle(score), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("params,oracle", CASES, ids=["prpo", "raw", "flash_reinforce", "roll"])
def test_loss_and_gradient_of_reinforce_with_it(params, oracle):
    batch, score = batch_for(7)
    adv = lossplug.compute_advantages(batch, recipe(**params))
    logp = batch.logp.clone().requires_grad_()
    result = lossplug.policy_loss(batch.replace(logp=logp, advantage=adv), recipe(**params))
    result.loss.backward()
    reference = batch.logp.clone().requires_grad_()
    expected = -(oracle(score)[:, None] * reference * batch.action_mask).sum() / batch.action_mask.sum()
    expected.backward()
    torch.testing.assert_close(result.loss, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logp.grad, reference.grad, atol=ATOL, rtol=RTOL)


def rllm_reinforce_plus_plus_baseline(score, group):
    """rLLM's per-group centring, then the batch's population std of the centred rewards (numpy), ε 1e-6."""
    np = pytest.importorskip("numpy")  # the transcription is rLLM's numpy code
    r, g = score.numpy(), group.numpy()
    centred = r.copy()
    for k in np.unique(g):
        centred[g == k] = r[g == k] - np.mean(r[g == k])
    return torch.from_numpy(centred / (np.std(centred) + 1e-6))


@pytest.mark.parametrize("binary", [False, True])
def test_group_centring_matches_rllms_reinforce_plus_plus_baseline(binary):
    for seed in range(4):
        batch, score = batch_for(seed, B=12, binary=binary)
        group = torch.arange(12) % 4
        group[:3] = 4  # a group of three
        score[group == 4] = 0.5  # all equal: exactly 0
        batch = batch.replace(reward=score, group_id=group)
        adv = lossplug.compute_advantages(batch, recipe(center="group"))
        torch.testing.assert_close(adv, rllm_reinforce_plus_plus_baseline(score, group), atol=ATOL, rtol=RTOL)
        assert torch.equal(adv[group == 4], torch.zeros(3, dtype=F64))


def test_group_centring_needs_group_id():
    batch, _ = batch_for(0)
    with pytest.raises(lossplug.LossplugError, match="group_id"):
        lossplug.compute_advantages(batch, recipe(center="group"))


@pytest.mark.parametrize("params", [{}, {"scale": False}, {"std": "sample", "eps": 0.0}])
def test_a_constant_batch_gets_zero_when_centred(params):
    batch, _ = batch_for(1)
    batch = batch.replace(reward=torch.full((9,), 0.3, dtype=F64))
    assert torch.equal(lossplug.compute_advantages(batch, recipe(**params)), torch.zeros(9, dtype=F64))


def test_a_single_response_with_the_sample_std_is_zero_not_nan():
    batch, _ = batch_for(2, B=1)
    assert torch.equal(lossplug.compute_advantages(batch, recipe(std="sample")), torch.zeros(1, dtype=F64))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**20), B=st.integers(2, 12))
def test_order_changes_nothing_and_groups_are_ignored(seed, B):
    batch, _ = batch_for(seed, B=B)
    adv = lossplug.compute_advantages(batch, recipe())
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(seed))
    shuffled = batch.replace(logp=batch.logp[perm], action_mask=batch.action_mask[perm], reward=batch.reward[perm])
    torch.testing.assert_close(lossplug.compute_advantages(shuffled, recipe()), adv[perm], atol=1e-12, rtol=1e-12)
    grouped = batch.replace(group_id=torch.arange(B) % 2)
    torch.testing.assert_close(lossplug.compute_advantages(grouped, recipe()), adv, atol=0, rtol=0)


def test_parameters_are_checked():
    for bad in ({"std": "group"}, {"eps": -1.0}, {"center": "prompt"}):
        with pytest.raises(lossplug.RecipeError, match="batch_normalized"):
            recipe(**bad)
