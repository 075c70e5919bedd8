"""kimi15 against a transcription of ROLL's ``_compute_kimi15_loss`` and of the paper's gradient (float64, loss and
gradient, several shapes and τ), and its invariants."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lossplug.testing import assert_conforms
from lossplug.testing.batches import loss_and_grad

SHAPES = [(1, 5), (3, 8), (8, 21)]
TAUS = [0.0, 0.1, 1.0, 7.5]


def batch(B, T, seed, drift=0.4, token_advantage=False):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    logp = (old + drift * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    shape = (B, T) if token_advantage else (B,)
    return dict(
        logp=logp, old_logp=old, action_mask=mask, advantage=torch.randn(shape, generator=g, dtype=torch.float64)
    )


def roll_kimi15_loss(f, tau):
    """ROLL's ActorPGWorker._compute_kimi15_loss (alibaba/ROLL 8eb27cc) with token-mean aggregation."""
    log_probs = f["logp"].clone().requires_grad_()
    advantages = f["advantage"] if f["advantage"].ndim == 2 else f["advantage"].unsqueeze(-1)
    loss_mat = -advantages * log_probs + tau * 0.5 * (log_probs - f["old_logp"]).pow(2)
    mask = f["action_mask"].double()
    loss = (loss_mat * mask).sum() / mask.sum()
    loss.backward()
    return loss.detach(), log_probs.grad


def run(f, tau):
    return loss_and_grad({"gates": [{"name": "kimi15", "tau": tau}], "reduction": "token"}, **f)


@pytest.mark.parametrize("token_advantage", [False, True])
def test_matches_roll_and_the_papers_gradient(token_advantage):
    worst = dict(loss_abs=0.0, loss_rel=0.0, grad_abs=0.0)
    for (B, T), seed in zip(SHAPES, range(len(SHAPES))):
        f = batch(B, T, seed, token_advantage=token_advantage)
        mask = f["action_mask"]
        for tau in TAUS:
            result, grad = run(f, tau)
            expected_loss, expected_grad = roll_kimi15_loss(f, tau)
            torch.testing.assert_close(result.loss.detach(), expected_loss, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
            # the paper's equation 3 per token: ∇ = (A − τ·(logp − old_logp))·∇logp, averaged over the tokens
            adv = f["advantage"] if token_advantage else f["advantage"].unsqueeze(-1)
            paper = torch.where(mask, -(adv - tau * (f["logp"] - f["old_logp"])) / mask.sum(), 0.0)
            torch.testing.assert_close(grad, paper, rtol=1e-12, atol=1e-14)
            err = float((result.loss.detach() - expected_loss).abs())
            worst["loss_abs"] = max(worst["loss_abs"], err)
            worst["loss_rel"] = max(worst["loss_rel"], err / float(expected_loss.abs()))
            worst["grad_abs"] = max(worst["grad_abs"], float((grad - expected_grad).abs().max()))
    print(f"kimi15(token_advantage={token_advantage}) vs ROLL", worst)


@given(seed=st.integers(0, 10_000), B=st.integers(1, 5), T=st.integers(1, 9), drift=st.floats(0, 3))
def test_without_the_penalty_it_is_reinforce(seed, B, T, drift):
    f = batch(B, T, seed, drift)
    result, grad = run(f, 0.0)
    expected, expected_grad = loss_and_grad({"gates": [{"name": "reinforce"}], "reduction": "token"}, **f)
    torch.testing.assert_close(result.loss, expected.loss, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-13, atol=1e-15)


@given(seed=st.integers(0, 10_000), B=st.integers(1, 5), T=st.integers(1, 9), tau=st.floats(0, 10))
def test_on_policy_the_penalty_vanishes(seed, B, T, tau):
    f = batch(B, T, seed)
    f["old_logp"] = f["logp"].clone()
    result, grad = run(f, tau)
    expected, expected_grad = loss_and_grad({"gates": [{"name": "reinforce"}], "reduction": "token"}, **f)
    torch.testing.assert_close(result.loss, expected.loss, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-13, atol=1e-15)


def test_non_default_tau_conforms():
    assert_conforms("kimi15", kind="gate", params={"tau": 2.0}, skip={"zero_advantage": "the penalty ignores A"})
