"""lossplug's advantages against verl 0.9.1's own estimators (float64, ≤ 1e-6), on random inputs with scattered,
unequal groups (uids as strings in a numpy object array, as in verl's ``non_tensor_batch["uid"]``).

Documented differences, each pinned by a test below:

* GRPO: verl gives a singleton group mean 0 and std 1 (``A = R / (1 + eps)``); lossplug gives it 0 (no ranking
  signal). The oracle batches have no singleton groups; ``test_verl_grpo_singleton_group_differs`` pins the rest.
* RLOO: verl leaves a singleton's score unchanged; lossplug's ``rloo`` refuses groups of one (min_group_size=2).
* GAE: verl 0.9.1 skips observation tokens like lossplug (value and trace carried across ``response_mask == 0``), so
  the two agree on every action token, whitened or not. They differ off the action tokens (verl leaves carried,
  non-zero advantages/returns there; lossplug zeros), when a masked value is NaN (verl multiplies by the mask and
  the NaN spreads over the row; lossplug never reads it), and at truncation (verl never bootstraps: lossplug's
  ``terminated``/``final_value`` have no verl counterpart).
"""

import pytest
import torch

import lossplug

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
np = pytest.importorskip("numpy")  # verl's uid arrays; verl brings numpy

F64 = torch.float64


def recipe(advantage):
    return lossplug.Recipe.model_validate({"advantage": advantage, "gates": ["ppo_clip"], "reduction": "token"})


def scattered_groups(gen, sizes):
    """Group ids of unequal groups, shuffled across the batch; verl's uid strings for the same partition."""
    group = torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])
    group = group[torch.randperm(group.numel(), generator=gen)]
    uids = np.array([f"uid-{int(g) * 7919 % 1000:03d}-{int(g)}" for g in group], dtype=object)
    return group, uids


def outcome_batch(gen, sizes, T=7):
    group, uids = scattered_groups(gen, sizes)
    B = group.numel()
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = torch.arange(T) < lengths[:, None]
    score = torch.randn(B, generator=gen, dtype=F64)
    score[group == 1] = 0.25  # an all-equal group
    token_rewards = torch.zeros(B, T, dtype=F64)
    token_rewards[torch.arange(B), lengths - 1] = score  # verl: the score sits on the last valid token
    batch = lossplug.PolicyBatch(logp=-torch.ones(B, T, dtype=F64), action_mask=mask, reward=score, group_id=group)
    return batch, token_rewards, mask, uids


SIZES = [(4, 4, 4, 4), (2, 5, 3, 8, 2, 6), (3, 2, 7)]


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_verl(sizes, norm_by_std):
    gen = torch.Generator().manual_seed(len(sizes) + 10 * norm_by_std)
    batch, token_rewards, mask, uids = outcome_batch(gen, sizes)
    expect, expect_ret = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=token_rewards.clone(),
        response_mask=mask.to(F64),
        index=uids,
        epsilon=1e-6,
        norm_adv_by_std_in_grpo=norm_by_std,
    )
    params = {
        "name": "grpo",
        "scale": "group" if norm_by_std else "none",
        "std": "sample",
        "eps": 1e-6,
        "eps_mode": "add",
    }
    got = lossplug.compute_advantages(batch, recipe(params))
    assert got.shape == (batch.batch_size,)
    torch.testing.assert_close(got[:, None] * mask, expect, rtol=0, atol=1e-6)
    torch.testing.assert_close(got[:, None] * mask, expect_ret, rtol=0, atol=1e-6)


def test_verl_grpo_singleton_group_differs():
    score = torch.tensor([1.0, 0.0, 2.0], dtype=F64)
    mask = torch.ones(3, 2)
    token_rewards = torch.zeros(3, 2, dtype=F64)
    token_rewards[:, -1] = score
    expect, _ = core_algos.compute_grpo_outcome_advantage(token_rewards, mask, np.array(["a", "a", "b"], dtype=object))
    batch = lossplug.PolicyBatch(
        logp=-torch.ones(3, 2, dtype=F64), action_mask=mask.bool(), reward=score, group_id=torch.tensor([0, 0, 1])
    )
    got = lossplug.compute_advantages(batch, recipe({"name": "grpo", "std": "sample", "eps": 1e-6}))
    torch.testing.assert_close(got[:2], expect[:2, 0], rtol=0, atol=1e-6)  # the pair agrees
    assert got[2] == 0 and expect[2, 0] == pytest.approx(2 / (1 + 1e-6))  # the singleton does not


@pytest.mark.parametrize("sizes", SIZES)
def test_rloo_matches_verl(sizes):
    gen = torch.Generator().manual_seed(100 + len(sizes))
    batch, token_rewards, mask, uids = outcome_batch(gen, sizes)
    expect, _ = core_algos.compute_rloo_outcome_advantage(
        token_level_rewards=token_rewards.clone(), response_mask=mask.to(F64), index=uids
    )
    got = lossplug.compute_advantages(batch, recipe("rloo"))
    torch.testing.assert_close(got[:, None] * mask, expect, rtol=0, atol=1e-6)


def gae_inputs(seed, B=6, T=12, gaps=False):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=gen)
    mask = torch.arange(T) < lengths[:, None]
    if gaps:  # multi-turn: observation tokens (response_mask 0) between actions
        mask &= torch.rand(B, T, generator=gen) > 0.3
        mask[:, 0] = True
    value = torch.randn(B, T, generator=gen, dtype=F64)
    reward = torch.randn(B, T, generator=gen, dtype=F64).where(mask, 0)  # 0 off the actions: the contract's rule
    return mask, value, reward


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("whiten", [False, True])
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5)])
def test_gae_matches_verl_on_action_tokens(gaps, whiten, gamma, lam):
    mask, value, reward = gae_inputs(int(gamma * 100 + lam * 10) + gaps, gaps=gaps)
    expect_adv, expect_ret = core_algos.compute_gae_advantage_return(
        token_level_rewards=reward, values=value, response_mask=mask.to(F64), gamma=gamma, lam=lam
    )
    if not whiten:  # verl always whitens; un-whiten with its own statistics to compare the raw advantages
        raw = expect_ret - value
        expect_adv = torch.where(mask, raw, 0)
    batch = lossplug.PolicyBatch(logp=-torch.ones_like(value), action_mask=mask, value=value, reward=reward)
    got = lossplug.estimate_advantages(batch, recipe({"name": "gae", "gamma": gamma, "lam": lam, "whiten": whiten}))
    torch.testing.assert_close(got.advantage[mask], expect_adv[mask], rtol=0, atol=1e-6)
    torch.testing.assert_close(got.returns[mask], expect_ret[mask], rtol=0, atol=1e-6)


def test_gae_differences_to_verl_off_the_action_tokens():
    mask, value, reward = gae_inputs(5, gaps=True)
    batch = lossplug.PolicyBatch(logp=-torch.ones_like(value), action_mask=mask, value=value, reward=reward)
    got = lossplug.estimate_advantages(batch, recipe({"name": "gae", "whiten": False}))
    _, verl_ret = core_algos.compute_gae_advantage_return(reward, value, mask.to(F64), 1.0, 0.95)
    # verl leaves carried values on observation/padding positions; lossplug zeros them
    assert (verl_ret[~mask] != 0).any()
    assert (got.returns[~mask] == 0).all() and (got.advantage[~mask] == 0).all()
    # a NaN value on a non-action position poisons verl's row, never lossplug's
    poisoned = value.masked_fill(~mask, float("nan"))
    verl_adv, _ = core_algos.compute_gae_advantage_return(reward, poisoned, mask.to(F64), 1.0, 0.95)
    assert torch.isnan(verl_adv[mask]).any()
    ours = lossplug.estimate_advantages(batch.replace(value=poisoned), recipe({"name": "gae", "whiten": False}))
    torch.testing.assert_close(ours.advantage, got.advantage, rtol=0, atol=0)
