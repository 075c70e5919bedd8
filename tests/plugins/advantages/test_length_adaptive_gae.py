"""VAPO's length-adaptive GAE (arXiv:2504.05118): a worked λ example, the λ function's errors, the plugin on both
layouts."""

import pytest
import torch

import lossplug
from lossplug.plugins.advantages.length_adaptive_gae import length_adaptive_lambda

F64 = torch.float64


def recipe(name="length_adaptive_gae", **params):
    return lossplug.Recipe.model_validate(
        {"advantage": {"name": name, **params}, "gates": ["ppo_clip"], "reduction": "token"}
    )


def test_vapo_lambda_worked_example():
    length = torch.tensor([16, 64, 256, 1024])
    lam = length_adaptive_lambda(length)
    assert torch.all(lam[1:] > lam[:-1])
    assert lam[0] == 0
    torch.testing.assert_close(lam[-1], torch.tensor(1 - 1 / (0.05 * 1024)))


def test_lambda_is_clamped_and_keeps_float_dtype():
    lam = length_adaptive_lambda(torch.tensor([1.0, 20.0, 40.0, 1e9], dtype=F64), alpha=0.05)
    assert lam.dtype == F64
    torch.testing.assert_close(lam, torch.tensor([0.0, 0.0, 0.5, 1 - 1 / (0.05 * 1e9)], dtype=F64))
    assert length_adaptive_lambda(40, 0.05).item() == pytest.approx(0.5)


@pytest.mark.parametrize(
    "length, alpha", [([16, 0], 0.05), ([-3], 0.05), ([float("nan")], 0.05), ([16], 0.0), ([16], -1.0)]
)
def test_lambda_rejects_non_positive_length_or_alpha(length, alpha):
    with pytest.raises(lossplug.LossplugError, match="length_adaptive_lambda: (length|alpha) must be positive"):
        length_adaptive_lambda(length, alpha)


def test_alpha_is_validated_in_the_recipe():
    with pytest.raises(lossplug.RecipeError, match="alpha"):
        recipe(alpha=0)


def test_padded_uses_one_lambda_per_response_from_its_action_tokens():
    gen = torch.Generator().manual_seed(0)
    B, T = 3, 60
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, :25] = True
    mask[1, 5:50] = True
    mask[1, 20:30] = False  # observation tokens do not count towards l (35 action tokens)
    mask[2, :] = True
    value = torch.randn(B, T, generator=gen, dtype=F64)
    reward = torch.randn(B, generator=gen, dtype=F64)
    batch = lossplug.PolicyBatch(logp=-torch.ones(B, T, dtype=F64), action_mask=mask, value=value, reward=reward)
    res = lossplug.estimate_advantages(batch, recipe(alpha=0.05, gamma=1.0, critic_lam=1.0, whiten=False))
    lengths = mask.sum(-1)
    assert lengths.tolist() == [25, 35, 60]
    lam = length_adaptive_lambda(lengths.to(F64), 0.05)
    for b in range(B):
        row = lossplug.PolicyBatch(
            logp=batch.logp[b : b + 1], action_mask=mask[b : b + 1], value=value[b : b + 1], reward=reward[b : b + 1]
        )
        plain = lossplug.estimate_advantages(
            row, recipe("gae", gamma=1.0, lam=float(lam[b]), critic_lam=1.0, whiten=False)
        )
        torch.testing.assert_close(res.advantage[b : b + 1], plain.advantage, rtol=0, atol=1e-12)
        torch.testing.assert_close(res.returns[b : b + 1], plain.returns, rtol=0, atol=1e-12)
    # critic λ = 1, γ = 1: Monte-Carlo returns (the sequence score on every action token)
    torch.testing.assert_close(res.returns, torch.where(mask, reward[:, None], 0), rtol=0, atol=1e-12)
    torch.testing.assert_close(res.metric_tensors["lambda/max"], lam.max())


def test_packed_uses_the_fragment_length():
    gen = torch.Generator().manual_seed(1)
    n = 50
    boundary = torch.zeros(n, dtype=torch.bool)
    boundary[[19, 29, 49]] = True  # fragments of 20, 10 and 20 transitions
    terminated = boundary.clone()
    terminated[29] = False  # a time-limit truncation
    kw = dict(
        reward=torch.randn(n, generator=gen, dtype=F64),
        value=torch.randn(n, generator=gen, dtype=F64),
        next_value=torch.randn(n, generator=gen, dtype=F64),
        terminated=terminated,
        boundary=boundary,
    )
    res = lossplug.estimate_advantages(lossplug.PackedTransitions(**kw), recipe(alpha=0.1, gamma=0.99, whiten=False))
    lam = {20: 1 - 1 / (0.1 * 20), 10: 0.0}
    for lo, hi in ((0, 20), (20, 30), (30, 50)):
        part = {k: v[lo:hi] for k, v in kw.items()}
        plain = lossplug.estimate_advantages(
            lossplug.PackedTransitions(**part),
            recipe("gae", gamma=0.99, lam=lam[hi - lo], critic_lam=1.0, whiten=False),
        )
        torch.testing.assert_close(res.advantage[lo:hi], plain.advantage, rtol=0, atol=1e-12)
        torch.testing.assert_close(res.returns[lo:hi], plain.returns, rtol=0, atol=1e-12)


def test_vapo_preset():
    r = lossplug.Recipe.preset("vapo")
    assert r.advantage.name == "length_adaptive_gae"
    assert r.advantage.params["alpha"] == 0.05 and r.advantage.params["critic_lam"] == 1.0
    assert r.gates[0].name == "ppo_clip"
    assert (r.gates[0].params["eps_low"], r.gates[0].params["eps_high"]) == (0.2, 0.28)
    assert r.reduction.name == "token"
    batch = lossplug.PolicyBatch(
        logp=-torch.ones(2, 3),
        action_mask=torch.ones(2, 3, dtype=torch.bool),
        value=torch.zeros(2, 3),
        reward=torch.tensor([1.0, 0.0]),
    )
    assert lossplug.compute_advantages(batch, "vapo").shape == (2, 3)
