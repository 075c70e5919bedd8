"""normalize_then_sum against TRL 1.16's ``multi_objective_aggregation="normalize_then_sum"`` (float64, ≤ 1e-8
relative), and its invariants.

TRL's aggregation lives inline in ``GRPOTrainer._generate_and_score_completions``; it is reproduced verbatim below
(``trl/trainer/grpo_trainer.py`` lines 2790-2800 and 2813), with TRL's own ``nanstd``.

TRL option → lossplug recipe stage::

    multi_objective_aggregation="normalize_then_sum", reward_weights=w
        → advantage normalize_then_sum(weights=w, eps=1e-4, scale=batch), batch field reward_components [B, K]
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossplug

RTOL = 1e-8


def trl_advantages(rewards_per_func: torch.Tensor, num_generations: int, reward_weights: torch.Tensor) -> torch.Tensor:
    from trl.trainer.utils import nanstd

    # TRL's nanstd computes Bessel's factor as count / (count - 1) of integer tensors, which takes torch's default
    # dtype: float32 (a 3e-8 relative error of 4/3 in a float64 computation) unless the default is float64. In
    # float32 training the two agree; lossplug uses the exact factor, so the float64 reference runs with it too.
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _trl_advantages(rewards_per_func, num_generations, reward_weights, nanstd)
    finally:
        torch.set_default_dtype(default)


def _trl_advantages(rewards_per_func, num_generations, reward_weights, nanstd):
    device = rewards_per_func.device
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    num_funcs = rewards_per_func.shape[1]
    # grpo_trainer.py:2790-2800, verbatim (self.reward_weights → reward_weights, len(self.reward_funcs) → num_funcs)
    grouped = rewards_per_func.view(-1, num_generations, num_funcs)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
    reward_k = (grouped - mean_k) / (std_k + 1e-4)
    reward_k = reward_k.view(-1, num_funcs)
    rewards = (reward_k * reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    std_rewards = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)  # grpo_trainer.py:2813


def batch(rewards: torch.Tensor, group_id: torch.Tensor) -> lossplug.PolicyBatch:
    n = rewards.shape[0]
    return lossplug.PolicyBatch(
        logp=torch.full((n, 3), -1.0, dtype=torch.float64),
        action_mask=torch.ones(n, 3, dtype=torch.bool),
        reward_components=rewards,
        group_id=group_id,
    )


def advantages(rewards, group_id, **params):
    recipe = lossplug.Recipe.model_validate(
        {"advantage": {"name": "normalize_then_sum", **params}, "gates": ["reinforce"], "reduction": {"name": "token"}}
    )
    return lossplug.compute_advantages(batch(rewards, group_id), recipe)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("num_generations", [2, 4, 8])
@pytest.mark.parametrize("weights", [None, (1.0, 0.5, 2.0), (0.3, 1.7, 0.1)])
def test_matches_trl(seed, num_generations, weights):
    pytest.importorskip("trl")
    g = torch.Generator().manual_seed(seed)
    groups, num_funcs = 5, 3
    n = groups * num_generations
    rewards = torch.randn(n, num_funcs, generator=g, dtype=torch.float64)
    rewards[:, 1] = (rewards[:, 1] > 0).to(torch.float64)  # a 0/1 reward: constant in some groups
    rewards[:num_generations, 2] = 0.7  # a reward constant within a group
    # TRL holds reward_weights in float32
    trl_weights = torch.tensor(weights if weights is not None else [1.0] * num_funcs, dtype=torch.float32)
    expected = trl_advantages(rewards, num_generations, trl_weights)
    group_id = torch.arange(n) // num_generations
    params = {} if weights is None else {"weights": list(weights)}
    torch.testing.assert_close(advantages(rewards, group_id, **params), expected, rtol=RTOL, atol=1e-12)
    # scattered groups: the same advantages, permuted
    perm = torch.randperm(n, generator=g)
    torch.testing.assert_close(
        advantages(rewards[perm], group_id[perm], **params), expected[perm], rtol=RTOL, atol=1e-12
    )


def test_a_reward_constant_within_a_group_contributes_exactly_zero():
    rewards = torch.tensor(
        [[1.0, 0.1], [2.0, 0.1], [3.0, 0.1], [0.0, 5.0], [1.0, 6.0], [2.0, 7.0]], dtype=torch.float64
    )
    group_id = torch.tensor([0, 0, 0, 1, 1, 1])
    summed = advantages(rewards, group_id, scale="none")
    alone = advantages(rewards[:, :1], group_id, scale="none")
    assert torch.equal(summed[:3], alone[:3])  # the constant 0.1 (whose float mean is not exactly 0.1) adds nothing


def test_weights_must_match_the_reward_columns():
    rewards = torch.zeros(4, 2, dtype=torch.float64)
    with pytest.raises(lossplug.LossplugError, match="weights has 3 entries but reward_components has 2 columns"):
        advantages(rewards, torch.tensor([0, 0, 1, 1]), weights=[1.0, 1.0, 1.0])


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    scale=st.floats(0.01, 100.0),
    shift=st.floats(-100.0, 100.0),
)
def test_each_reward_is_invariant_to_its_own_affine_rescaling(seed, scale, shift):
    """Normalising within the group first: rescaling one reward function (e.g. a reward in [0, 100] instead of
    [0, 1]) changes nothing beyond the epsilon — the point of normalize_then_sum over sum_then_normalize."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(12, 2, generator=g, dtype=torch.float64)
    group_id = torch.arange(12) // 4
    rescaled = rewards.clone()
    rescaled[:, 0] = rewards[:, 0] * scale + shift
    a = advantages(rewards, group_id, eps=0.0)
    b = advantages(rescaled, group_id, eps=0.0)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
