"""GAE on both layouts: worked examples and reference loops (TRL ≤ 0.11's PPO), multi-turn skipping, truncation,
whitening, KL."""

import pytest
import torch

import lossplug
from lossplug.plugins.advantages.gae import packed_gae, reverse_linear_scan
from lossplug.testing.reference import sequential_packed_gae

F64 = torch.float64


def recipe(**params):
    return lossplug.Recipe.model_validate(
        {"advantage": {"name": "gae", **params}, "gates": ["ppo_clip"], "reduction": "token"}
    )


def policy_batch(mask, value, reward, **extra):
    mask = torch.as_tensor(mask, dtype=torch.bool)
    if reward.ndim == 2:  # token rewards are 0 off the actions (the contract refuses others; GAE never reads them)
        reward = torch.where(mask, reward, 0)
    logp = torch.full(mask.shape, -1.0, dtype=value.dtype)
    return lossplug.PolicyBatch(logp=logp, action_mask=mask, value=value, reward=reward, **extra)


def sequential_gae(reward_tok, value, mask, gamma, lam, end_value=None):
    """Hand-written reference of lossplug's padded semantics: the steps of a row are its action tokens, in order."""
    B, T = mask.shape
    adv = torch.zeros(B, T, dtype=F64)
    for b in range(B):
        carry = 0.0
        nxt = 0.0 if end_value is None else float(end_value[b])
        for t in reversed([t for t in range(T) if mask[b, t]]):
            delta = float(reward_tok[b, t]) + gamma * nxt - float(value[b, t])
            carry = delta + gamma * lam * carry
            adv[b, t] = carry
            nxt = float(value[b, t])
    return adv, torch.where(mask, adv + value, 0)


def trl_ppo_compute_advantages(values, rewards, mask, gamma, lam):
    """TRL ≤ 0.11's ``PPOTrainer.compute_advantages`` loop, transcribed apart from the config and whitening."""
    lastgaelam = 0
    advantages_reversed = []
    gen_len = rewards.shape[-1]
    values = values * mask
    rewards = rewards * mask
    for t in reversed(range(gen_len)):
        nextvalues = values[:, t + 1] if t < gen_len - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1]).transpose(0, 1)
    returns = advantages + values
    return values, advantages, returns


def trl_masked_whiten(values, mask, shift_mean=True):
    """TRL's ``trl.core.masked_whiten``, transcribed in its arithmetic: the Bessel factor
    ``mask_sum / (mask_sum − 1)`` is computed in the mask's dtype (float32 for an integer or float32 mask)."""

    def masked_mean(x, m):
        return (x * m).sum() / m.sum()

    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    mask_sum = mask.sum()
    variance = variance * (mask_sum / (mask_sum - 1))
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    return whitened if shift_mean else whitened + mean


def test_whitening_bessel_factor_is_float32_like_trl_and_verl():
    """A float64 mask would give a float64 Bessel factor: the whitened values then differ by ~1e-8 relative, no more
    (the only difference between the two readings of TRL's masked_whiten)."""
    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(4, 7, generator=gen) < 0.7
    mask[:, 0] = True
    value, reward = torch.randn(4, 7, generator=gen, dtype=F64), torch.randn(4, 7, generator=gen, dtype=F64)
    got = lossplug.estimate_advantages(policy_batch(mask, value, reward), recipe(gamma=1.0, lam=0.95)).advantage
    raw = lossplug.estimate_advantages(policy_batch(mask, value, reward), recipe(gamma=1.0, lam=0.95, whiten=False))
    for trl_mask in (mask.long(), mask.to(torch.float32)):
        exact = trl_masked_whiten(raw.advantage, trl_mask)
        torch.testing.assert_close(got[mask], exact[mask], rtol=0, atol=1e-12)
    float64 = trl_masked_whiten(raw.advantage, mask.to(F64))
    assert 0 < (got[mask] - float64[mask]).abs().max() <= 1e-7


def random_mask(B, T, gen, gaps=True, left=True):
    """Rows with optional left padding, interior observation gaps and right padding; ≥ 1 action each."""
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        start = int(torch.randint(0, T // 3 + 1, (1,), generator=gen)) if left else 0
        end = int(torch.randint(start + 1, T + 1, (1,), generator=gen))
        mask[b, start:end] = True
        if gaps:
            mask[b, start:end] &= torch.rand(end - start, generator=gen) > 0.3
            mask[b, start] = True
    return mask


# ---------------------------------------------------------------------------------------------------------------------
# Packed GAE (GAE arXiv:1506.02438; Gymnasium's terminated/truncated split)


def packed_worked_example():
    return dict(
        reward=torch.tensor([1.0, 2.0, 10.0]),
        value=torch.tensor([0.5, 1.0, 3.0]),
        next_value=torch.tensor([1.0, 4.0, float("nan")]),
        terminated=torch.tensor([False, False, True]),
        boundary=torch.tensor([False, True, True]),
    )


def test_packed_gae_worked_example_through_public_api():
    ex = packed_worked_example()
    batch = lossplug.PackedTransitions(**ex)
    advantage = lossplug.compute_advantages(batch, recipe(gamma=0.5, lam=0.8, whiten=False))
    delta = (
        ex["reward"]
        + 0.5 * torch.where(ex["terminated"], torch.zeros_like(ex["next_value"]), ex["next_value"])
        - ex["value"]
    )
    torch.testing.assert_close(advantage, torch.tensor([delta[0] + 0.4 * delta[1], delta[1], delta[2]]))
    assert delta[1] == 3
    assert delta[2] == 7
    assert not advantage.requires_grad and torch.isfinite(advantage).all()


def test_packed_gae_function_and_returns():
    ex = packed_worked_example()
    advantage = packed_gae(**ex, gamma=0.5, lam=0.8)
    torch.testing.assert_close(advantage, torch.tensor([2.2, 3.0, 7.0]))
    result = lossplug.estimate_advantages(lossplug.PackedTransitions(**ex), recipe(gamma=0.5, lam=0.8, whiten=False))
    torch.testing.assert_close(result.returns, advantage + ex["value"])  # TRL's PPO: return = A + V_old


def test_packed_gae_keeps_the_reference_error_rules():
    ex = packed_worked_example()
    with pytest.raises(lossplug.BatchValidationError, match="closed"):
        packed_gae(**{**ex, "boundary": torch.tensor([False, True, False])})
    with pytest.raises(lossplug.BatchValidationError, match="terminated ⇒ boundary"):
        packed_gae(**{**ex, "terminated": torch.tensor([True, False, True])})
    with pytest.raises(lossplug.BatchValidationError, match="boolean|bool"):
        packed_gae(**{**ex, "terminated": torch.tensor([0.0, 0.0, 1.0])})


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 333])
def test_packed_matches_the_sequential_loop_on_random_fragments(n):
    gen = torch.Generator().manual_seed(n)
    boundary = torch.rand(n, generator=gen) < 0.2
    boundary[-1] = True
    terminated = boundary & (torch.rand(n, generator=gen) < 0.5)
    next_value = torch.randn(n, generator=gen, dtype=F64).masked_fill(terminated, float("nan"))
    kw = dict(
        reward=torch.randn(n, generator=gen, dtype=F64),
        value=torch.randn(n, generator=gen, dtype=F64),
        next_value=next_value,
        terminated=terminated,
        boundary=boundary,
    )
    ours = lossplug.compute_advantages(lossplug.PackedTransitions(**kw), recipe(gamma=0.97, lam=0.9, whiten=False))
    torch.testing.assert_close(ours, sequential_packed_gae(**kw, gamma=0.97, lam=0.9), rtol=0, atol=1e-12)
    assert ours.dtype == F64


def test_packed_time_limit_truncation_bootstraps_but_does_not_chain():
    # fragment 1 is truncated (terminated False, boundary True) and bootstraps from the real final observation (5.0),
    # not from the value of the physically next transition (which belongs to another trajectory)
    kw = dict(
        reward=torch.tensor([1.0, 1.0, 0.0]),
        value=torch.tensor([0.0, 0.0, 9.0]),
        next_value=torch.tensor([0.0, 5.0, float("nan")]),
        terminated=torch.tensor([False, False, True]),
        boundary=torch.tensor([False, True, True]),
    )
    adv = packed_gae(**kw, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([7.0, 6.0, -9.0]))
    other = packed_gae(**{**kw, "reward": torch.tensor([1.0, 1.0, 100.0])}, gamma=1.0, lam=1.0)
    torch.testing.assert_close(other[:2], adv[:2])


def test_packed_whitening_and_critic_lambda():
    ex = packed_worked_example()
    batch = lossplug.PackedTransitions(**ex)
    raw = lossplug.estimate_advantages(batch, recipe(gamma=0.5, lam=0.8, whiten=False))
    white = lossplug.estimate_advantages(batch, recipe(gamma=0.5, lam=0.8, whiten=True))
    a = raw.advantage
    torch.testing.assert_close(white.advantage, (a - a.mean()) / (a.var() + 1e-8).sqrt())
    torch.testing.assert_close(white.returns, raw.returns)  # returns are never whitened
    critic = lossplug.estimate_advantages(batch, recipe(gamma=0.5, lam=0.8, critic_lam=1.0, whiten=False))
    torch.testing.assert_close(critic.advantage, a)
    torch.testing.assert_close(critic.returns, packed_gae(**ex, gamma=0.5, lam=1.0) + ex["value"])


def test_packed_rejects_kl_coef():
    with pytest.raises(lossplug.LossplugError, match="kl_coef"):
        lossplug.compute_advantages(lossplug.PackedTransitions(**packed_worked_example()), recipe(kl_coef=0.1))


def test_reverse_linear_scan_matches_loop():
    gen = torch.Generator().manual_seed(3)
    for n in (1, 2, 5, 16, 17, 1000):
        d = torch.randn(n, generator=gen, dtype=F64)
        c = torch.rand(n, generator=gen, dtype=F64) * (torch.rand(n, generator=gen) > 0.1)
        ref, carry = torch.empty_like(d), 0.0
        for t in range(n - 1, -1, -1):
            carry = d[t] + (c[t] * carry if t < n - 1 else 0.0)
            ref[t] = carry
        torch.testing.assert_close(reverse_linear_scan(d, c), ref, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# TRL ≤ 0.11's PPO: padded GAE, V(s_T) = 0, returns = A + V_old


@pytest.mark.parametrize("whiten", [False, True])
def test_trl_ppo_reference_loop_on_right_padded_contiguous_batch(whiten):
    gen = torch.Generator().manual_seed(0)
    B, T = 5, 9
    lengths = torch.tensor([9, 1, 4, 6, 2])
    mask = torch.arange(T) < lengths[:, None]
    values = torch.randn(B, T, generator=gen, dtype=F64)
    rewards = torch.randn(B, T, generator=gen, dtype=F64)
    _, ref_adv, ref_ret = trl_ppo_compute_advantages(values, rewards, mask.to(F64), gamma=0.99, lam=0.95)
    if whiten:
        # TRL's mask is a torch.FloatTensor (float32): its masked_whiten's Bessel factor mask_sum / (mask_sum − 1)
        # is then float32, as verl's on its integer response_mask — gae reproduces that bit for bit
        ref_adv = trl_masked_whiten(ref_adv, mask.to(torch.float32))
    # padding holds garbage: the contract says it is never read
    batch = policy_batch(mask, values.masked_fill(~mask, float("nan")), rewards.masked_fill(~mask, float("inf")))
    res = lossplug.estimate_advantages(batch, recipe(gamma=0.99, lam=0.95, whiten=whiten))
    torch.testing.assert_close(res.advantage[mask], ref_adv[mask], rtol=0, atol=1e-10)
    torch.testing.assert_close(res.returns[mask], ref_ret[mask], rtol=0, atol=1e-10)
    assert (res.advantage[~mask] == 0).all() and (res.returns[~mask] == 0).all()
    assert res.advantage.dtype == F64 and not res.advantage.requires_grad


def test_sequence_reward_goes_on_the_last_action_token():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 0]], dtype=torch.bool)
    value = torch.randn(3, 7, dtype=F64)
    score = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    token = torch.zeros(3, 7, dtype=F64)
    token[0, 4], token[1, 6], token[2, 5] = 1.0, -2.0, 0.5
    seq = lossplug.estimate_advantages(policy_batch(mask, value, score), recipe(whiten=False))
    tok = lossplug.estimate_advantages(policy_batch(mask, value, token), recipe(whiten=False))
    torch.testing.assert_close(seq.advantage, tok.advantage, rtol=0, atol=0)
    torch.testing.assert_close(seq.returns, tok.returns, rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(4))
def test_multi_turn_observation_tokens_are_skipped(seed):
    gen = torch.Generator().manual_seed(seed)
    B, T = 6, 14
    mask = random_mask(B, T, gen)
    value = torch.randn(B, T, generator=gen, dtype=F64)
    reward = torch.randn(B, T, generator=gen, dtype=F64)
    ref_adv, ref_ret = sequential_gae(reward, value, mask, 0.9, 0.8)
    res = lossplug.estimate_advantages(policy_batch(mask, value, reward), recipe(gamma=0.9, lam=0.8, whiten=False))
    torch.testing.assert_close(res.advantage, ref_adv, rtol=0, atol=1e-12)
    torch.testing.assert_close(res.returns, ref_ret, rtol=0, atol=1e-12)


def test_multi_turn_hand_example():
    # positions: a0 obs obs a1 a2 pad ; γ=0.5, λ=1: steps are a0 → a1 → a2, not per position
    mask = torch.tensor([[1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    value = torch.tensor([[1.0, 100.0, 100.0, 2.0, 4.0, 100.0]], dtype=F64)
    reward = torch.tensor([[0.0, 50.0, 50.0, 0.0, 8.0, 50.0]], dtype=F64)
    res = lossplug.estimate_advantages(policy_batch(mask, value, reward), recipe(gamma=0.5, lam=1.0, whiten=False))
    d2 = 8 + 0.5 * 0 - 4  # last action: no bootstrap
    d1 = 0 + 0.5 * 4 - 2  # next value is the value at the next ACTION
    d0 = 0 + 0.5 * 2 - 1
    a2, a1 = d2, d1 + 0.5 * d2
    a0 = d0 + 0.5 * a1  # one decay per action step, the observation tokens do not decay the trace
    torch.testing.assert_close(res.advantage, torch.tensor([[a0, 0, 0, a1, a2, 0]], dtype=F64))
    torch.testing.assert_close(res.returns, torch.tensor([[a0 + 1, 0, 0, a1 + 2, a2 + 4, 0]], dtype=F64))


def test_truncated_rows_bootstrap_from_final_value():
    gen = torch.Generator().manual_seed(7)
    B, T = 4, 8
    mask = random_mask(B, T, gen)
    value = torch.randn(B, T, generator=gen, dtype=F64)
    reward = torch.randn(B, generator=gen, dtype=F64)
    terminated = torch.tensor([True, False, True, False])
    final_value = torch.tensor([float("nan"), 2.5, float("nan"), -1.0], dtype=F64)
    res = lossplug.estimate_advantages(
        policy_batch(mask, value, reward, terminated=terminated, final_value=final_value),
        recipe(gamma=0.95, lam=0.9, whiten=False),
    )
    token = torch.zeros(B, T, dtype=F64)
    last = (torch.arange(T) * mask).argmax(-1)
    token[torch.arange(B), last] = reward
    end = torch.where(terminated, 0, final_value)
    ref_adv, ref_ret = sequential_gae(token, value, mask, 0.95, 0.9, end_value=end)
    torch.testing.assert_close(res.advantage, ref_adv, rtol=0, atol=1e-12)
    torch.testing.assert_close(res.returns, ref_ret, rtol=0, atol=1e-12)
    # terminated=True everywhere (or not given) means no bootstrap at all
    none = lossplug.estimate_advantages(policy_batch(mask, value, reward), recipe(gamma=0.95, lam=0.9, whiten=False))
    ended = lossplug.estimate_advantages(
        policy_batch(mask, value, reward, terminated=torch.ones(B, dtype=torch.bool)),
        recipe(gamma=0.95, lam=0.9, whiten=False),
    )
    torch.testing.assert_close(none.advantage, ended.advantage, rtol=0, atol=0)
    torch.testing.assert_close(none.advantage[terminated], res.advantage[terminated], rtol=0, atol=0)


def test_truncation_without_final_value_is_an_error():
    mask = torch.ones(2, 3, dtype=torch.bool)
    batch = policy_batch(mask, torch.zeros(2, 3), torch.ones(2), terminated=torch.tensor([True, False]))
    with pytest.raises(lossplug.LossplugError, match="final_value.*rows? \\[1\\]"):
        lossplug.compute_advantages(batch, recipe())


def test_final_value_without_terminated_is_an_error():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(
        lossplug.BatchValidationError, match="final_value: is only read for truncated responses: give terminated"
    ):
        policy_batch(mask, torch.zeros(2, 3), torch.ones(2), final_value=torch.ones(2))


def test_padded_whitening_is_over_action_tokens_only():
    gen = torch.Generator().manual_seed(1)
    mask = random_mask(4, 10, gen)
    value = torch.randn(4, 10, generator=gen, dtype=F64)
    reward = torch.randn(4, 10, generator=gen, dtype=F64)
    raw = lossplug.compute_advantages(policy_batch(mask, value, reward), recipe(whiten=False))
    white = lossplug.compute_advantages(policy_batch(mask, value, reward), recipe(whiten=True))
    a = raw[mask]
    torch.testing.assert_close(white[mask], (a - a.mean()) / (a.var() + 1e-8).sqrt())
    assert (white[~mask] == 0).all()
    torch.testing.assert_close(white[mask].mean(), torch.zeros((), dtype=F64), atol=1e-12, rtol=0)


def test_critic_lambda_only_changes_the_returns():
    gen = torch.Generator().manual_seed(2)
    mask = random_mask(3, 9, gen)
    value = torch.randn(3, 9, generator=gen, dtype=F64)
    reward = torch.randn(3, generator=gen, dtype=F64)
    batch = policy_batch(mask, value, reward)
    base = lossplug.estimate_advantages(batch, recipe(lam=0.7, whiten=False))
    split = lossplug.estimate_advantages(batch, recipe(lam=0.7, critic_lam=1.0, whiten=False))
    mc = lossplug.estimate_advantages(batch, recipe(lam=1.0, whiten=False))
    torch.testing.assert_close(split.advantage, base.advantage, rtol=0, atol=0)
    torch.testing.assert_close(split.returns, mc.returns, rtol=0, atol=1e-12)
    # λ = 1, γ = 1, no bootstrap: the return of every action token is the sum of the rewards still to come
    torch.testing.assert_close(mc.returns, torch.where(mask, reward[:, None], 0), rtol=0, atol=1e-12)


def test_low_precision_inputs_compute_in_float32():
    mask = torch.ones(2, 4, dtype=torch.bool)
    bf16 = torch.bfloat16
    batch = lossplug.PolicyBatch(
        logp=-torch.ones(2, 4, dtype=bf16),
        action_mask=mask,
        value=torch.zeros(2, 4, dtype=bf16),
        reward=torch.ones(2, dtype=bf16),
    )
    res = lossplug.estimate_advantages(batch, recipe(whiten=False, gamma=1.0, lam=1.0))
    assert res.advantage.dtype == torch.float32
    torch.testing.assert_close(res.advantage, torch.ones(2, 4))


def test_gae_requires_value_and_reward():
    batch = lossplug.PolicyBatch(
        logp=-torch.ones(2, 3), action_mask=torch.ones(2, 3, dtype=torch.bool), reward=torch.ones(2)
    )
    with pytest.raises(lossplug.BatchValidationError, match="value"):
        lossplug.compute_advantages(batch, recipe())


def test_gae_parameters_are_validated_before_any_tensor():
    with pytest.raises(lossplug.RecipeError, match="lam"):
        recipe(lam=1.5)
    with pytest.raises(lossplug.RecipeError, match="lamb"):
        recipe(lamb=0.9)


# ---------------------------------------------------------------------------------------------------------------------
# KL-shaped reward inside gae (TRL ≤ 0.11's compute_rewards feeding compute_advantages)


def test_kl_coef_shapes_the_reward_like_trl_ppo():
    from lossplug.tools.kl import kl_shaped_rewards

    gen = torch.Generator().manual_seed(4)
    B, T = 3, 7
    mask = random_mask(B, T, gen)
    value = torch.randn(B, T, generator=gen, dtype=F64)
    score = torch.randn(B, generator=gen, dtype=F64)
    old = -torch.rand(B, T, generator=gen, dtype=F64)
    ref = -torch.rand(B, T, generator=gen, dtype=F64)
    out = kl_shaped_rewards(score, old, ref, mask, kl_coef=0.05)
    shaped, kl = out.rewards, out.kl
    expect = lossplug.estimate_advantages(policy_batch(mask, value, shaped), recipe(whiten=False))
    batch = policy_batch(
        mask,
        value,
        score,
        old_logp=old.masked_fill(~mask, float("nan")),
        ref_logp=ref.masked_fill(~mask, float("-inf")),
    )
    got = lossplug.estimate_advantages(batch, recipe(whiten=False, kl_coef=0.05))
    torch.testing.assert_close(got.advantage, expect.advantage, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.returns, expect.returns, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.metric_tensors["kl/mean"], kl[mask].mean())


def test_kl_coef_needs_old_and_ref_logp():
    batch = policy_batch(torch.ones(2, 3), torch.zeros(2, 3), torch.ones(2))
    with pytest.raises(lossplug.BatchValidationError) as info:
        lossplug.compute_advantages(batch, recipe(kl_coef=0.1))
    msg = str(info.value)
    assert "old_logp: required by recipe.advantage (gae with kl_coef=0.1)" in msg
    assert "ref_logp: required by recipe.advantage (gae with kl_coef=0.1)" in msg


# ---------------------------------------------------------------------------------------------------------------------
# The ppo preset


def test_ppo_preset():
    r = lossplug.Recipe.preset("ppo")
    assert r.advantage.name == "gae" and r.advantage.params["gamma"] == 1.0 and r.advantage.params["lam"] == 0.95
    assert r.advantage.params["whiten"] is True
    assert [g.name for g in r.gates] == ["ppo_clip"] and r.gates[0].params["eps_high"] == 0.2
    assert r.reduction.name == "token"
    batch = policy_batch(torch.ones(2, 3), torch.zeros(2, 3), torch.tensor([1.0, 0.0]))
    assert lossplug.compute_advantages(batch, "ppo").shape == (2, 3)
