"""Seed 2's compute_rewards: −β·KL per action token, the score added at the last action token."""

import pytest
import torch

import lossplug
from lossplug.plugins.advantages.kl_shaped_reward import kl_shaped_rewards, last_action_index


def seed2_compute_rewards(scores, logprobs, ref_logprobs, masks, kl_ctl):
    """Seed 2's loop (``_kl_penalty`` = the plain log-ratio ``logprob − ref_logprob``)."""
    rewards, non_score_rewards, kls = [], [], []
    for score, logprob, ref_logprob, mask in zip(scores, logprobs, ref_logprobs, masks):
        kl = logprob - ref_logprob
        kls.append(kl)
        non_score_reward = -kl_ctl * kl
        non_score_rewards.append(non_score_reward)
        reward = non_score_reward.clone()
        last_non_masked_index = mask.nonzero()[-1]
        reward[last_non_masked_index] += score
        rewards.append(reward)
    return torch.stack(rewards), torch.stack(non_score_rewards), torch.stack(kls)


def test_seed2_compute_rewards_right_padded():
    gen = torch.Generator().manual_seed(0)
    B, T = 4, 6
    lengths = torch.tensor([6, 1, 3, 5])
    mask = (torch.arange(T) < lengths[:, None]).long()  # the seed's LongTensor masks
    logp = -torch.rand(B, T, generator=gen)
    ref = -torch.rand(B, T, generator=gen)
    score = torch.randn(B, generator=gen)
    ref_r, ref_ns, ref_kl = seed2_compute_rewards(score, logp * mask, ref * mask, mask, 0.2)
    rewards, non_score, kl = kl_shaped_rewards(score, logp, ref, mask, 0.2)
    torch.testing.assert_close(rewards, ref_r)
    torch.testing.assert_close(non_score, ref_ns)
    torch.testing.assert_close(kl, ref_kl)


@pytest.mark.parametrize("layout", ["left", "interior"])
def test_last_action_token_with_left_padding_and_observation_tokens(layout):
    if layout == "left":
        mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    else:
        mask = torch.tensor([[1, 0, 0, 1, 0], [1, 1, 0, 1, 1], [0, 1, 0, 0, 0]], dtype=torch.bool)
    logp = torch.tensor([[-.1, -.2, -.3, -.4, -.5]]).repeat(3, 1)
    ref = logp - 0.1  # kl = 0.1 on every action
    score = torch.tensor([1., 2., 3.])
    rewards, non_score, kl = kl_shaped_rewards(score, logp.masked_fill(~mask, float("nan")), ref, mask, 0.5)
    last = last_action_index(mask)
    expect_kl = torch.where(mask, 0.1, 0.)
    torch.testing.assert_close(kl, expect_kl)
    torch.testing.assert_close(non_score, -0.5 * expect_kl)
    expect = -0.5 * expect_kl
    expect[torch.arange(3), last] += score
    torch.testing.assert_close(rewards, expect)
    for out in (rewards, non_score, kl):
        assert (out[~mask] == 0).all() and torch.isfinite(out).all()
    # seed 2's loop agrees wherever its inputs are defined
    ref_r, _, _ = seed2_compute_rewards(score, torch.where(mask, logp, 0), torch.where(mask, ref, 0), mask, 0.5)
    torch.testing.assert_close(rewards, ref_r)


def test_last_action_index():
    mask = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
    assert last_action_index(mask).tolist() == [2, 3, -1]


def test_errors_name_the_problem():
    logp = -torch.ones(2, 3)
    with pytest.raises(lossplug.LossplugError, match="every response needs at least one action.*row \\[1\\]"):
        kl_shaped_rewards(torch.ones(2), logp, logp, torch.tensor([[1, 0, 0], [0, 0, 0]]), 0.1)
    with pytest.raises(lossplug.LossplugError, match="score must be \\[B=2\\]"):
        kl_shaped_rewards(torch.ones(3), logp, logp, torch.ones(2, 3), 0.1)
    with pytest.raises(lossplug.LossplugError, match="aligned"):
        kl_shaped_rewards(torch.ones(2), logp, logp[:, :2], torch.ones(2, 3), 0.1)
