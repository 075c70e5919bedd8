"""zero_truncated is AReaL's mask_no_eos_with_zero (formula transcribed from inclusionAI/AReaL 5ac9adf,
areal/engine/ppo/actor.py: the score of a response without EOS is replaced by 0; the KL rewards stay)."""

from __future__ import annotations

import torch

import lossplug

B, T = 4, 6


def batch(token_reward: bool = False) -> lossplug.PolicyBatch:
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(T).expand(B, T) < torch.tensor([3, 6, 6, 2]).unsqueeze(-1)
    score = torch.tensor([1.0, 0.5, -1.0, 2.0], dtype=torch.float64)
    reward = score
    if token_reward:
        reward = torch.where(mask, torch.randn(B, T, generator=g, dtype=torch.float64), 0.0)
    return lossplug.PolicyBatch(
        logp=-torch.rand(B, T, generator=g, dtype=torch.float64),
        old_logp=-torch.rand(B, T, generator=g, dtype=torch.float64),
        ref_logp=-torch.rand(B, T, generator=g, dtype=torch.float64),
        action_mask=mask,
        reward=reward,
        terminated=torch.tensor([True, False, True, False]),
        group_id=torch.tensor([0, 0, 1, 1]),
    )


def recipe(*shapers) -> dict:
    return {"shapers": list(shapers), "advantage": "grpo", "gates": ["ppo_clip"], "reduction": "token"}


def areal_rewards(b: lossplug.PolicyBatch, kl_coef: float) -> torch.Tensor:
    """AReaL's reward tensor: −kl_ctl·(old − ref) per token, the score (0 without EOS) added at the last token."""
    kl = torch.where(b.action_mask, b.old_logp - b.ref_logp, 0.0)
    rewards = -kl_coef * kl
    last = b.action_mask.sum(-1) - 1
    score = torch.where(~b.terminated, torch.zeros(()), b.reward)
    rewards[torch.arange(B), last] += score
    return rewards


def test_a_truncated_response_scores_zero():
    res = lossplug.estimate_advantages(batch(), recipe("zero_truncated"))
    assert res.reward.tolist() == [1.0, 0.0, -1.0, 0.0]
    assert float(res.metric_tensors["shaper/zero_truncated/truncated_fraction"]) == 0.5


def test_before_kl_in_the_reward_it_is_areals_reward():
    b = batch()
    res = lossplug.estimate_advantages(b, recipe("zero_truncated", {"name": "kl_in_reward", "coef": 0.05}))
    torch.testing.assert_close(res.reward, areal_rewards(b, 0.05), rtol=0, atol=1e-15)


def test_a_per_token_reward_is_zeroed_on_the_whole_row():
    b = batch(token_reward=True)
    shaped = lossplug.estimate_advantages(b, recipe("zero_truncated")).reward
    assert torch.equal(shaped[~b.terminated], torch.zeros(2, T, dtype=torch.float64))
    assert torch.equal(shaped[b.terminated], b.reward[b.terminated])
