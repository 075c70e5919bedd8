"""topr against a transcription of ROLL's ``_compute_topr_loss`` and of the paper's equation 8 (float64, loss and
gradient, several shapes and weights), and its invariants."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug.testing import assert_conforms
from lossplug.testing.batches import loss_and_grad

SHAPES = [(1, 4), (4, 7), (9, 16)]
WEIGHTS = [(1.0, 1.0), (0.5, 2.0), (1.0, 0.0), (0.0, 0.7)]


def batch(B, T, seed, drift=0.5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    logp = (old + drift * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    reward = torch.randn(B, generator=g, dtype=torch.float64)
    advantage = reward - reward.mean()  # a baseline: signs differ from the reward's for some rows
    return dict(logp=logp, old_logp=old, action_mask=mask, reward=reward, advantage=advantage)


def roll_topr_loss(f, positive_weight, negative_weight, scores):
    """ROLL's ActorPGWorker._compute_topr_loss (alibaba/ROLL 8eb27cc, roll/pipeline/rlvr/actor_pg_worker.py) with
    token-mean aggregation: positive where scores > 0."""
    log_probs = f["logp"].clone().requires_grad_()
    ratio = (log_probs - f["old_logp"]).exp()
    advantages = f["advantage"].unsqueeze(-1).expand_as(log_probs) if f["advantage"].ndim == 1 else f["advantage"]
    positive_token_mask = (scores > 0).double().unsqueeze(-1)
    negative_token_mask = (scores <= 0).double().unsqueeze(-1)
    positive_loss = -advantages * log_probs * positive_token_mask
    clipped_ratio = torch.clamp(ratio, min=0.0, max=1.0).detach()
    negative_loss = -clipped_ratio * advantages * log_probs * negative_token_mask
    loss_mat = positive_weight * positive_loss + negative_weight * negative_loss
    mask = f["action_mask"].double()
    loss = (loss_mat * mask).sum() / mask.sum()
    loss.backward()
    return loss.detach(), log_probs.grad


def paper_topr_gradient(f, positive_weight, negative_weight):
    """Equation 8 per token, split on the advantage's sign: ∂J/∂logp = w₊·A (A > 0), w₋·min(r, 1)·A (else); the
    token-mean loss's gradient is −that / n."""
    adv = f["advantage"].unsqueeze(-1).expand_as(f["logp"])
    ratio = (f["logp"] - f["old_logp"]).exp()
    coefficient = torch.where(adv > 0, positive_weight, negative_weight * ratio.clamp(max=1.0))
    mask = f["action_mask"]
    return torch.where(mask, -coefficient * adv / mask.sum(), 0.0), (coefficient * adv * f["logp"])[mask].sum()


def run(f, **params):
    return loss_and_grad({"gates": [{"name": "topr", **params}], "reduction": "token"}, **f)


def _track(worst, loss, grad, expected_loss, expected_grad):
    err = float((loss.detach() - expected_loss).abs())
    worst["loss_abs"] = max(worst["loss_abs"], err)
    worst["loss_rel"] = max(worst["loss_rel"], err / max(float(expected_loss.abs()), 1e-300))
    worst["grad_abs"] = max(worst["grad_abs"], float((grad - expected_grad).abs().max()))


@pytest.mark.parametrize("token_reward", [False, True])
def test_split_on_reward_matches_roll(token_reward):
    worst = dict(loss_abs=0.0, loss_rel=0.0, grad_abs=0.0)
    for (B, T), seed in zip(SHAPES, range(len(SHAPES))):
        f = batch(B, T, seed)
        scores = f["reward"]
        if token_reward:  # a [B, T] reward: the response's score is its sum over the action tokens
            share = torch.rand(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
            share = torch.where(f["action_mask"], share, 0)
            # (0 off the actions: the contract refuses a token reward anywhere else)
            f["reward"] = torch.where(f["action_mask"], share / share.sum(-1, keepdim=True) * scores.unsqueeze(-1), 0)
        for w_pos, w_neg in WEIGHTS:
            params = dict(split_on="reward", positive_weight=w_pos, negative_weight=w_neg)
            result, grad = run(f, **params)
            expected_loss, expected_grad = roll_topr_loss(f, w_pos, w_neg, scores)
            torch.testing.assert_close(result.loss.detach(), expected_loss, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
            _track(worst, result.loss, grad, expected_loss, expected_grad)
    print(f"topr(split_on=reward, token_reward={token_reward}) vs ROLL", worst)


def test_split_on_advantage_matches_the_paper():
    worst = dict(loss_abs=0.0, loss_rel=0.0, grad_abs=0.0)
    for (B, T), seed in zip(SHAPES, range(10, 10 + len(SHAPES))):
        f = batch(B, T, seed)
        for w_pos, w_neg in WEIGHTS:
            result, grad = run(f, positive_weight=w_pos, negative_weight=w_neg)
            expected_grad, objective_sum = paper_topr_gradient(f, w_pos, w_neg)
            expected_loss = -objective_sum / f["action_mask"].sum()
            torch.testing.assert_close(result.loss.detach(), expected_loss, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
            # ROLL's form with the advantage as the score: the same numbers
            roll_loss, roll_grad = roll_topr_loss(f, w_pos, w_neg, f["advantage"])
            torch.testing.assert_close(result.loss.detach(), roll_loss, rtol=1e-12, atol=1e-14)
            _track(worst, result.loss, grad, expected_loss, expected_grad)
    print("topr(split_on=advantage) vs the paper's equation 8", worst)


@given(seed=st.integers(0, 10_000), B=st.integers(1, 5), T=st.integers(1, 9), drift=st.floats(0, 3))
def test_positive_tokens_ignore_the_ratio_and_negative_ones_are_never_amplified(seed, B, T, drift):
    f = batch(B, T, seed, drift)
    _, grad = run(f)
    mask = f["action_mask"]
    n = int(mask.sum())
    adv = f["advantage"].unsqueeze(-1).expand_as(mask)
    coefficient = -grad * n  # ∂J/∂logp per token
    positive = mask & (adv > 0)
    torch.testing.assert_close(coefficient[positive], adv[positive], rtol=1e-12, atol=1e-14)
    negative = mask & (adv <= 0)
    assert bool((coefficient[negative].abs() <= adv[negative].abs() * (1 + 1e-12)).all())
    # and on policy, every token gets the plain policy gradient
    f["old_logp"] = f["logp"].clone()
    _, on_policy = run(f)
    torch.testing.assert_close(-on_policy * n, torch.where(mask, adv, 0.0), rtol=1e-12, atol=1e-14)


def test_a_reward_split_needs_the_reward():
    f = batch(2, 3, 0)
    del f["reward"]
    with pytest.raises(lossplug.LossplugError, match="reward"):
        run(f, split_on="reward")


def test_non_default_parameters_conform():
    assert_conforms("topr", kind="gate", params={"split_on": "reward"})
    # weights other than 1 scale the on-policy gradient w₊·A / w₋·A by design
    weighted = {"positive_weight": 0.5, "negative_weight": 2.0}
    assert_conforms("topr", kind="gate", params=weighted, skip={"ratio_one": "the weights scale A by design"})
