"""``length_weighted_grpo`` (float64): against AReaL's ``Normalization`` transcribed here on the ``[B, T]`` advantage
(the outcome reward on every action token: AReaL's critic-free GAE with discount 1, λ 1), every ``mean_level`` ×
``std_level`` × ``mean_leave1out`` × ``std_unbiased`` — and against AReaL 1.0.4's own class read from its
wheel (``tests/_origins.py``; executed from its file without importing the package). End to end, the loss and gradient of a REINFORCE recipe against ``−Σ A·logp / N``. Properties: each
response weighs by its length (equal lengths give ``grpo``'s mean), equal rewards give 0, ``mean: group, std: none``
is ``opo``.

Measured: ≤ 8.9e-16 abs against the transcription; against AReaL's class, the float32 rounding of its output (≤ 5.9e-8 relative).
"""

from __future__ import annotations

import ast
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import lossplug

F64 = torch.float64
ATOL, RTOL = 1e-12, 1e-12
LEVELS = ["group", "batch", "none"]
CASES = [
    {"mean": m, "std": s, "leave_one_out": loo, "unbiased": unb}
    for m, s, loo, unb in itertools.product(LEVELS, LEVELS, [False, True], [True, False])
    if not (loo and m == "none")
]


def recipe(**params):
    return lossplug.Recipe.model_validate(
        {"advantage": {"name": "length_weighted_grpo", **params}, "gates": ["reinforce"], "reduction": "token"}
    )


def batch_for(seed, groups=4, group_size=4, T=7, binary=False):
    """Consecutive groups of ``group_size`` rows (AReaL's layout), ragged lengths, group 0 all equal."""
    gen = torch.Generator().manual_seed(seed)
    B = groups * group_size
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = torch.arange(T) < lengths[:, None]
    score = (torch.rand(B, generator=gen) < 0.5).to(F64) if binary else torch.randn(B, generator=gen, dtype=F64)
    score[:group_size] = 0.5
    group = torch.arange(B) // group_size
    logp = -(0.1 + torch.rand(B, T, generator=gen, dtype=F64))
    return lossplug.PolicyBatch(logp=logp, action_mask=mask, reward=score, group_id=group), score, mask


def areal_transcribed(x, mask, group_size, mean, std, leave_one_out, unbiased, eps=1e-5):
    """AReaL's Normalization.__call__ on [B, T] values, read as formulas (one process: no all-reduce)."""
    m = mask.to(F64)

    def stats_mean(xx, mm):
        n, s = mm.sum(), (xx * mm).sum()
        if leave_one_out:
            if n <= 1:
                return torch.zeros_like(xx)
            return torch.where(mm > 0, (s - xx * mm) / (n - mm).clamp(min=1), s / n)
        return torch.zeros_like(xx) + (s / n if n > 0 else 0.0)

    def stats_std(xx, mm, mu):
        n = mm.sum()
        ss = ((xx * mm - mu * mm) ** 2).sum()
        if unbiased:
            return torch.ones_like(xx) if n <= 1 else torch.zeros_like(xx) + (ss / (n - 1)).sqrt()
        return torch.ones_like(xx) if n == 0 else torch.zeros_like(xx) + (ss / n).sqrt()

    slices = [slice(i, i + group_size) for i in range(0, x.shape[0], group_size)]
    mu = torch.zeros_like(x)
    if mean == "batch":
        mu = stats_mean(x, m)
    elif mean == "group":
        for s in slices:
            mu[s] = torch.zeros_like(x[s]) if (group_size == 1 and leave_one_out) else stats_mean(x[s], m[s])
    centred = (x - mu) * m
    if std == "none":
        return centred
    sd = torch.zeros_like(x)
    if std == "batch":
        sd = stats_std(x, m, mu)
    else:
        for s in slices:
            sd[s] = torch.ones_like(x[s]) if (group_size == 1 and unbiased) else stats_std(x[s], m[s], mu[s])
    return centred / (sd + eps)


@pytest.mark.parametrize("params", CASES, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("binary", [False, True])
def test_matches_areals_normalization(params, binary):
    for seed in range(3):
        batch, score, mask = batch_for(seed, binary=binary)
        adv = lossplug.compute_advantages(batch, recipe(**params))
        x = score[:, None].expand_as(mask).clone()
        expected = areal_transcribed(x, mask, 4, **params)
        torch.testing.assert_close(torch.where(mask, adv[:, None], 0), expected, atol=ATOL, rtol=RTOL)


@pytest.fixture(scope="module")
def areal_normalization(origins):
    path = origins.package("areal") / "utils" / "data.py"
    tree = ast.parse(path.read_text(), str(path))
    tree.body = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Normalization"]
    namespace = {"torch": torch, "np": np, "dist": torch.distributed, "NormConfig": object}
    exec(compile(tree, str(path), "exec"), namespace)
    return namespace["Normalization"]


@pytest.mark.parametrize("params", CASES, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
def test_matches_areal(areal_normalization, params):
    level = {"none": None}
    config = SimpleNamespace(
        mean_level=level.get(params["mean"], params["mean"]),
        std_level=level.get(params["std"], params["std"]),
        mean_leave1out=params["leave_one_out"],
        std_unbiased=params["unbiased"],
        group_size=4,
        eps=1e-5,
    )
    for seed in range(3):
        batch, score, mask = batch_for(seed)
        adv = lossplug.compute_advantages(batch, recipe(**params))
        expected = areal_normalization(config)(score[:, None].expand_as(mask).clone(), mask.to(F64))
        # AReaL computes in float64 and returns float32 (``.float()``)
        expected = (expected.double() * mask).to(F64)
        torch.testing.assert_close(torch.where(mask, adv[:, None], 0), expected, atol=1e-6, rtol=1e-6)


def test_loss_and_gradient_of_reinforce_with_it():
    batch, score, mask = batch_for(9)
    adv = lossplug.compute_advantages(batch, recipe())
    logp = batch.logp.clone().requires_grad_()
    result = lossplug.policy_loss(batch.replace(logp=logp, advantage=adv), recipe())
    result.loss.backward()
    reference = batch.logp.clone().requires_grad_()
    a = areal_transcribed(score[:, None].expand_as(mask).clone(), mask, 4, "group", "group", False, True)
    expected = -(a * reference).sum() / mask.sum()
    expected.backward()
    torch.testing.assert_close(result.loss, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logp.grad, reference.grad, atol=ATOL, rtol=RTOL)


def test_responses_weigh_by_their_length():
    """Rewards 1 and 0 over 3 and 1 tokens: the token mean is 3/4, not grpo's 1/2."""
    batch = lossplug.PolicyBatch(
        logp=-torch.ones(2, 3, dtype=F64),
        action_mask=torch.tensor([[True, True, True], [True, False, False]]),
        reward=torch.tensor([1.0, 0.0], dtype=F64),
        group_id=torch.tensor([0, 0]),
    )
    adv = lossplug.compute_advantages(batch, recipe(std="none"))
    torch.testing.assert_close(adv, torch.tensor([0.25, -0.75], dtype=F64))
    opo = lossplug.Recipe.model_validate({"advantage": "opo", "gates": ["reinforce"], "reduction": "token"})
    torch.testing.assert_close(adv, lossplug.compute_advantages(batch, opo))


def test_equal_rewards_give_zero_and_a_batch_level_needs_no_group():
    batch, _, _ = batch_for(2)
    equal = batch.replace(reward=torch.full_like(batch.reward, 0.3))
    assert torch.equal(lossplug.compute_advantages(equal, recipe()), torch.zeros_like(batch.reward))
    no_groups = batch.replace(group_id=None)
    lossplug.compute_advantages(no_groups, recipe(mean="batch", std="batch"))
    with pytest.raises(lossplug.LossplugError, match="group_id"):
        lossplug.compute_advantages(no_groups, recipe())


def test_parameters_are_checked():
    for bad in ({"mean": "prompt"}, {"eps": -1.0}, {"std": "token"}):
        with pytest.raises(lossplug.RecipeError, match="length_weighted_grpo"):
            recipe(**bad)
