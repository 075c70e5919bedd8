"""The ``nll`` regularizer, float64, loss AND gradient: against SkyRL 0.3.0's own ``cross_entropy_loss`` (from its
wheel, ``tests/_origins.py``; ``responses: all``, ``reduction: token_sum``), and against VAPO's positive-example LM loss
transcribed here (``μ · Σ_{correct responses} −log π / #their tokens``) and the plain per-token forms; hypothesis
properties: no positive response adds nothing, the term is linear in μ, padding is never read.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossplug
from lossplug import PolicyBatch, Recipe

from ..gates._field_origins import skyrl_ppo_utils

F64 = torch.float64
B, T = 6, 8
RTOL = 1e-12


def tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    mask[2, 0] = False  # an observation token
    mask[2, 1] = True
    logp = -(0.05 + 3.0 * torch.rand(B, T, generator=g, dtype=F64))
    reward = (torch.rand(B, generator=g) < 0.5).to(F64)
    reward[0], reward[1] = 1.0, 0.0  # at least one correct and one wrong response
    return logp, mask, reward


def nll_recipe(reduction="token", **params):
    # reinforce (J = A·logp) with A = 0: the policy term is exactly 0, without gradient
    return Recipe.load({"gates": ["reinforce"], "reduction": reduction, "regularizers": [{"name": "nll", **params}]})


def lossplug_loss(recipe, logp, mask, *, advantage=None, poison=False, **fields):
    leaf = logp.clone().requires_grad_()
    value = torch.where(mask, leaf, float("nan")) if poison else leaf
    adv = advantage if advantage is not None else torch.zeros(B, dtype=F64)
    result = lossplug.policy_loss(PolicyBatch(logp=value, action_mask=mask, advantage=adv, **fields), recipe)
    (grad,) = torch.autograd.grad(result.loss, leaf)
    return result, grad


def vapo(logp, mask, selected, coef, denominator):
    """VAPO's L_NLL · μ, the selected responses' tokens over ``denominator`` tokens, and its gradient."""
    leaf = logp.clone().requires_grad_()
    chosen = mask & selected.unsqueeze(-1)
    loss = coef * -(leaf * chosen).sum() / denominator
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


def assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=1e-14)


@pytest.fixture(scope="module")
def ppo_utils(origins):
    return skyrl_ppo_utils(origins)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_skyrl_cross_entropy_loss(ppo_utils, seed):
    logp, mask, _ = tensors(seed)
    result, grad = lossplug_loss(nll_recipe("token_sum", coef=1.0, responses="all"), logp, mask)
    leaf = logp.clone().requires_grad_()
    expected, _ = ppo_utils.cross_entropy_loss(leaf, logp, torch.zeros_like(logp), None, loss_mask=mask.to(F64))
    (expected_grad,) = torch.autograd.grad(expected, leaf)
    assert_close(result.loss, expected.detach())
    assert_close(grad, expected_grad)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("coef", [0.1, 1.0])
def test_vapo_positive_example_loss_over_the_correct_tokens(seed, coef):
    logp, mask, reward = tensors(seed)
    positive = reward > 0
    selected_tokens = int((mask & positive.unsqueeze(-1)).sum())
    expected, expected_grad = vapo(logp, mask, positive, coef, selected_tokens)
    recipe = nll_recipe("token", coef=coef, denominator="selected", population="micro_batch")
    result, grad = lossplug_loss(recipe, logp, mask, reward=reward)
    assert_close(result.loss, expected)
    assert_close(grad, expected_grad)
    # the default denominator: the reduction's, every action token of the micro-batch
    expected, expected_grad = vapo(logp, mask, positive, coef, int(mask.sum()))
    result, grad = lossplug_loss(nll_recipe("token", coef=coef), logp, mask, reward=reward)
    assert_close(result.loss, expected)
    assert_close(grad, expected_grad)


@pytest.mark.parametrize("reduction", ["token", "response", "token_sum", "sequence_sum"])
def test_every_reduction_reduces_the_selected_term_like_the_policy_term(reduction):
    logp, mask, reward = tensors(4)
    selected = reward > 0.5
    lengths = mask.sum(-1).to(F64)
    leaf = logp.clone().requires_grad_()
    per_token = -(leaf * (mask & selected.unsqueeze(-1)))
    expected = {
        "token": per_token.sum() / mask.sum(),
        "response": (per_token.sum(-1) / lengths).sum() / B,
        "token_sum": per_token.sum(),
        "sequence_sum": per_token.sum() / B,
    }[reduction] * 0.3
    (expected_grad,) = torch.autograd.grad(expected, leaf)
    result, grad = lossplug_loss(nll_recipe(reduction, coef=0.3, threshold=0.5), logp, mask, reward=reward)
    assert_close(result.loss, expected.detach())
    assert_close(grad, expected_grad)


def test_positive_advantage_selects_by_the_response_mean_of_a_token_advantage():
    logp, mask, _ = tensors(5)
    g = torch.Generator().manual_seed(50)
    token_adv = torch.randn(B, T, generator=g, dtype=F64)
    mean = torch.where(mask, token_adv, 0).sum(-1) / mask.sum(-1)
    expected, expected_grad = vapo(logp, mask, mean > 0, 1.0, int(mask.sum()))
    # the reinforce term of a non-zero advantage is subtracted: what remains is the regularizer's
    _, policy_grad = lossplug_loss(
        nll_recipe(coef=0.0, responses="positive_advantage"), logp, mask, advantage=token_adv
    )
    base, _ = lossplug_loss(nll_recipe(coef=0.0, responses="positive_advantage"), logp, mask, advantage=token_adv)
    result, grad = lossplug_loss(nll_recipe(coef=1.0, responses="positive_advantage"), logp, mask, advantage=token_adv)
    assert_close(result.loss - base.loss, expected)
    assert_close(grad - policy_grad, expected_grad)


def test_token_rewards_are_summed_over_the_actions():
    logp, mask, reward = tensors(6)
    rows = torch.arange(B)
    token_reward = torch.zeros(B, T, dtype=F64)
    token_reward[rows, mask.to(torch.int8).argmax(-1)] = reward - 0.25  # on each row's first action token
    token_reward = token_reward + torch.where(mask, 0.125, 0.0).to(F64)  # and a share on every action token
    sequence = token_reward.sum(-1)
    a, ga = lossplug_loss(nll_recipe(coef=1.0), logp, mask, reward=token_reward)
    b, gb = lossplug_loss(nll_recipe(coef=1.0), logp, mask, reward=sequence)
    assert_close(a.loss, b.loss)
    assert_close(ga, gb)
    # a reward on a non-action position (an observation) is the contract's error, never silently dropped
    off = (~mask).nonzero()[0].tolist()
    token_reward[off[0], off[1]] = 100.0
    with pytest.raises(lossplug.BatchValidationError, match="reward: token rewards"):
        lossplug_loss(nll_recipe(coef=1.0), logp, mask, reward=token_reward)


def test_missing_reward_fails_validation_by_name():
    logp, mask, _ = tensors(0)
    with pytest.raises(lossplug.BatchValidationError, match="reward"):
        lossplug_loss(nll_recipe(), logp, mask)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(-2.0, 2.0, allow_nan=False), st.sampled_from(["reduction", "selected"]))
def test_properties(seed, coef, denominator):
    logp, mask, reward = tensors(seed)
    recipe = nll_recipe("token", coef=coef, denominator=denominator, population="micro_batch")
    result, grad = lossplug_loss(recipe, logp, mask, reward=reward)
    # padding is never read: NaN off the actions changes nothing
    poisoned, poisoned_grad = lossplug_loss(recipe, logp, mask, reward=reward, poison=True)
    assert torch.equal(poisoned.loss, result.loss) and torch.equal(poisoned_grad, grad)
    # no positive response: nothing added, no gradient
    none, none_grad = lossplug_loss(recipe, logp, mask, reward=torch.zeros(B, dtype=F64))
    assert float(none.loss.detach()) == 0.0 and bool((none_grad == 0).all())
    # linear in the coefficient
    unit, unit_grad = lossplug_loss(
        nll_recipe("token", coef=1.0, denominator=denominator, population="micro_batch"), logp, mask, reward=reward
    )
    torch.testing.assert_close(result.loss, coef * unit.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, coef * unit_grad, rtol=1e-12, atol=1e-14)
    # the gradient is −μ / denominator on the selected actions and 0 elsewhere
    assert bool((grad[~mask] == 0).all()) and bool((grad[reward == 0] == 0).all())
