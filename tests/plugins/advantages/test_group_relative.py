"""RLOO (arXiv:2402.14740) / GRPO (arXiv:2402.03300) worked example through the public API, and TRL's
group-advantage formula."""

import pytest
import torch

import lossplug

F64 = torch.float64
THRESHOLD_GRPO = {"name": "grpo", "scale": "group", "std": "population", "eps": 1e-6, "eps_mode": "threshold"}


def recipe(advantage):
    return lossplug.Recipe.model_validate({"advantage": advantage, "gates": ["ppo_clip"], "reduction": "token"})


def reference_rloo(reward):
    return reward - (reward.sum(1, keepdim=True) - reward) / (reward.size(1) - 1)


def reference_grpo(reward, eps=1e-6):
    centered = reward - reward.mean(1, keepdim=True)
    scale = reward.std(1, keepdim=True, unbiased=False)
    return torch.where(scale > eps, centered / scale, torch.zeros_like(centered))


def grouped_batch(reward_2d, perm=None):
    """[prompt, rollout] rewards as a flat PolicyBatch with group_id (optionally with rows shuffled)."""
    P, G = reward_2d.shape
    reward = reward_2d.reshape(-1)
    group = torch.arange(P).repeat_interleave(G)
    if perm is not None:
        reward, group = reward[perm], group[perm]
    return lossplug.PolicyBatch(
        logp=-torch.ones(P * G, 2, dtype=reward.dtype),
        action_mask=torch.ones(P * G, 2, dtype=torch.bool),
        reward=reward,
        group_id=group,
    )


def test_rloo_grpo_worked_example():
    reward = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    rloo = lossplug.compute_advantages(grouped_batch(reward), recipe("rloo")).view(2, 3)
    grpo = lossplug.compute_advantages(grouped_batch(reward), recipe(THRESHOLD_GRPO)).view(2, 3)
    torch.testing.assert_close(rloo[0], 1.5 * (reward[0] - reward[0].mean()))
    torch.testing.assert_close(grpo.mean(1), torch.zeros(2))
    assert torch.count_nonzero(grpo[1]) == 0
    # and they are the reference functions
    torch.testing.assert_close(rloo, reference_rloo(reward))
    torch.testing.assert_close(grpo, reference_grpo(reward))


def test_reference_conventions_on_random_scattered_groups():
    gen = torch.Generator().manual_seed(0)
    reward = torch.randn(5, 4, generator=gen, dtype=F64)
    reward[2] = 0.3  # an all-equal group
    perm = torch.randperm(20, generator=gen)
    flat_rloo = lossplug.compute_advantages(grouped_batch(reward, perm), recipe("rloo"))
    flat_grpo = lossplug.compute_advantages(grouped_batch(reward, perm), recipe(THRESHOLD_GRPO))
    inv = torch.argsort(perm)
    torch.testing.assert_close(flat_rloo[inv].view(5, 4), reference_rloo(reward), rtol=0, atol=1e-12)
    torch.testing.assert_close(flat_grpo[inv].view(5, 4), reference_grpo(reward), rtol=0, atol=1e-12)
    assert (flat_grpo[inv].view(5, 4)[2] == 0).all() and (flat_rloo[inv].view(5, 4)[2] == 0).all()


def trl_group_advantages(rewards, num_generations, scale):
    """TRL's GRPOTrainer formula (notes/trl.md): groups are adjacent blocks; sample std; /(std + 1e-4)."""
    grouped = rewards.view(-1, num_generations)
    mean = grouped.mean(1).repeat_interleave(num_generations)
    if scale == "group":
        std = grouped.std(1).repeat_interleave(num_generations)
    elif scale == "batch":
        std = rewards.std().expand_as(rewards)
    adv = rewards - mean
    return adv if scale == "none" else adv / (std + 1e-4)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_matches_trl_group_advantage(scale):
    gen = torch.Generator().manual_seed(1)
    P, G = 6, 4
    reward = torch.randn(P, G, generator=gen, dtype=F64)
    reward[3] = 1.0  # all-equal group: exactly 0 for TRL too (1.0 is exact in every mean)
    expect = trl_group_advantages(reward.reshape(-1), G, scale)
    perm = torch.randperm(P * G, generator=gen)  # TRL shuffles rows: lossplug works from group_id, not adjacency
    got = lossplug.compute_advantages(
        grouped_batch(reward, perm),
        recipe({"name": "grpo", "scale": scale, "std": "sample", "eps": 1e-4, "eps_mode": "add"}),
    )
    torch.testing.assert_close(got[torch.argsort(perm)], expect, rtol=0, atol=1e-12)


def test_grpo_preset_is_trls_default():
    r = lossplug.Recipe.preset("grpo")
    assert r.advantage.params == {"scale": "group", "std": "sample", "eps": 1e-4, "eps_mode": "add"}
