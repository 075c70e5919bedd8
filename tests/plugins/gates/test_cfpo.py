"""cfpo against an independent float64 transcription of the verl port of CFPO (arXiv:2601.22801; verl PR #5252,
asparius/verl@18bd5cd ``compute_policy_loss_cfpo``): loss and gradient token by token in plain Python floats, the
gradient differentiated by hand; its invariants against ppo_clip (equal at r = 1, a lower bound with the exact gap,
the same peak) and the unclipped policy gradient (ε → ∞); its metrics and its parameter rules."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug.testing.batches import loss_and_grad


def port_token_mean(logp, old, adv, mask, eps, clamp=20.0):
    """The port, token by token: ``pg_losses = −(A·r − |A|·(r − 1)²/(2ε))`` with the log-ratio clamped to
    ±20, verl's ``token-mean`` (÷ the action tokens); the gradient d loss/d logp written out by hand:
    −r·(A − |A|·(r − 1)/ε)/N inside the clamp, 0 where the clamp binds. Returns (loss, gradient rows)."""
    rows = len(logp)
    n = sum(bool(m) for row in mask for m in row)
    total, grad = 0.0, [[0.0] * len(logp[0]) for _ in range(rows)]
    for i in range(rows):
        for t in range(len(logp[0])):
            if not mask[i][t]:
                continue
            x = logp[i][t] - old[i][t]
            r = math.exp(min(max(x, -clamp), clamp))
            a = adv[i][t]
            total += -(a * r - abs(a) * (r - 1) ** 2 / (2 * eps))
            grad[i][t] = 0.0 if abs(x) > clamp else -r * (a - abs(a) * (r - 1) / eps) / n
    return total / n, grad


def random_fields(seed, B=5, T=7, scale=0.5, seq_adv=False):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    logp = (old + scale * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    adv = torch.randn(B, generator=g, dtype=torch.float64) if seq_adv else torch.randn(B, T, generator=g).double()
    return logp, old, adv, mask


@pytest.mark.parametrize("seq_adv", [False, True], ids=["token-advantage", "sequence-advantage"])
@pytest.mark.parametrize("eps", [0.2, 0.05, 1.0])
def test_loss_and_gradient_equal_the_verl_port_in_float64(eps, seq_adv):
    logp, old, adv, mask = random_fields(seed=int(eps * 100) + seq_adv, seq_adv=seq_adv)
    # garbage off the mask, as trainers hold there: it must reach neither value nor gradient
    logp_in, old_in = torch.where(mask, logp, 50.0), torch.where(mask, old, -50.0)
    result, grad = loss_and_grad(
        {"gates": [{"name": "cfpo", "eps": eps}], "reduction": "token"},
        logp=logp_in,
        old_logp=old_in,
        advantage=adv,
        action_mask=mask,
    )
    adv_bt = adv[:, None].expand_as(logp) if seq_adv else adv
    expected, expected_grad = port_token_mean(logp.tolist(), old.tolist(), adv_bt.tolist(), mask.tolist(), eps)
    assert result.loss.dtype == torch.float64
    assert abs(result.loss.item() - expected) <= 1e-13
    assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_the_log_ratio_clamp_bounds_the_ratio_and_stops_the_gradient():
    old = torch.tensor([[-30.0, -1.0, -1.0]], dtype=torch.float64)
    logp = torch.tensor([[-1.0, -40.0, -1.2]], dtype=torch.float64)  # log-ratios 29, −39, −0.2
    adv = torch.tensor([[0.5, -1.5, 2.0]], dtype=torch.float64)
    result, grad = loss_and_grad(
        {"gates": ["cfpo"], "reduction": "token"}, logp=logp, old_logp=old, advantage=adv, metrics="off"
    )
    expected, expected_grad = port_token_mean(logp.tolist(), old.tolist(), adv.tolist(), [[True] * 3], 0.2)
    assert torch.isfinite(result.loss)
    assert abs(result.loss.item() - expected) <= 1e-9 * abs(expected)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-12, atol=0)
    assert grad[0, 0] == 0 and grad[0, 1] == 0 and grad[0, 2] != 0


def test_the_gradient_vanishes_at_the_peak_and_pulls_back_past_it():
    # A > 0: peak at r = 1.2; A < 0: peak at r = 0.8. Before the peak the gradient pushes as PG does, past it back.
    old = torch.log(torch.full((1, 6), 0.5, dtype=torch.float64))
    ratios = torch.tensor([[1.1, 1.2, 1.5, 0.9, 0.8, 0.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    _, grad = loss_and_grad(
        {"gates": ["cfpo"], "reduction": "sequence_sum"}, logp=old + ratios.log(), old_logp=old, advantage=adv
    )
    ascent = -grad[0]  # d objective / d logp
    assert ascent[0] > 0 and ascent[2] < 0  # A > 0: up before 1.2, down past it
    assert ascent[3] < 0 and ascent[5] > 0  # A < 0: down before 0.8, up past it
    torch.testing.assert_close(ascent[[1, 4]], torch.zeros(2, dtype=torch.float64), rtol=0, atol=1e-15)


# -- invariants against ppo_clip and the unclipped policy gradient ----------------------------------------------------


@st.composite
def batches(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.0, 1e-3, 0.1, 0.5, 2.0]))
    return random_fields(seed, B=draw(st.integers(1, 4)), T=draw(st.integers(1, 6)), scale=scale)


def run(gate, logp, old, adv, mask, reduction="token"):
    return loss_and_grad(
        {"gates": [gate], "reduction": reduction}, logp=logp, old_logp=old, advantage=adv, action_mask=mask
    )


@given(fields=batches(), eps=st.sampled_from([0.05, 0.2, 0.3, 0.9]))
def test_equals_ppo_clip_at_ratio_one(fields, eps):
    _, old, adv, mask = fields
    cfpo, g_cfpo = run({"name": "cfpo", "eps": eps}, old.clone(), old, adv, mask)
    ppo, g_ppo = run({"name": "ppo_clip", "eps_low": eps, "eps_high": eps}, old.clone(), old, adv, mask)
    torch.testing.assert_close(cfpo.loss, ppo.loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(g_cfpo, g_ppo, rtol=1e-12, atol=1e-15)


@given(fields=batches(), eps=st.sampled_from([0.05, 0.2, 0.3, 0.9]))
def test_is_a_lower_bound_on_ppo_clip_with_the_exact_gap(fields, eps):
    logp, old, adv, mask = fields
    cfpo, _ = run({"name": "cfpo", "eps": eps}, logp, old, adv, mask)
    ppo, _ = run({"name": "ppo_clip", "eps_low": eps, "eps_high": eps}, logp, old, adv, mask)
    # objective gap per token: PPO's (1 ± ε)·A minus CFPO's past the peak on the advantage's side, written out as
    # |A|·((|r − 1| − ε)² + ε²)/(2ε); inside, both have r·A and the gap is the penalty |A|·(r − 1)²/(2ε)
    r = (logp - old).exp()
    past = ((adv > 0) & (r > 1 + eps)) | ((adv < 0) & (r < 1 - eps))
    gap = torch.where(past, ((r - 1).abs() - eps).square() + eps**2, (r - 1).square()) * adv.abs() / (2 * eps)
    expected_gap = gap[mask].sum() / mask.sum()
    assert cfpo.loss >= ppo.loss - 1e-12
    torch.testing.assert_close(cfpo.loss - ppo.loss, expected_gap, rtol=1e-9, atol=1e-12)


@given(fields=batches())
def test_becomes_the_unclipped_policy_gradient_as_eps_grows(fields):
    logp, old, adv, mask = fields
    result, grad = run({"name": "cfpo", "eps": 1e12}, logp, old, adv, mask)
    r = (logp - old).exp()
    n = mask.sum()
    torch.testing.assert_close(result.loss, -(r * adv)[mask].sum() / n, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(grad, torch.where(mask, -r * adv / n, 0.0), rtol=1e-9, atol=1e-12)


# -- metrics and rules ------------------------------------------------------------------------------------------------


def test_past_peak_fractions_count_the_tokens_ppo_would_clip():
    logp, old, adv, mask = random_fields(seed=3, B=6, T=8, scale=0.6)
    result, _ = run({"name": "cfpo", "eps": 0.2}, logp, old, adv, mask)
    r = (logp - old).exp()
    n = mask.sum().item()
    high = ((r > 1.2) & (adv > 0) & mask).sum().item() / n
    low = ((r < 0.8) & (adv < 0) & mask).sum().item() / n
    assert 0 < high < 1 and 0 < low < 1
    assert result.metrics["cfpo/past_peak_frac_high"] == pytest.approx(high)
    assert result.metrics["cfpo/past_peak_frac_low"] == pytest.approx(low)
    # the same tokens ppo_clip's clip fractions count
    ppo, _ = run("ppo_clip", logp, old, adv, mask)
    assert ppo.metrics["ppo_clip/clip_frac_high"] == pytest.approx(high)
    assert ppo.metrics["ppo_clip/clip_frac_low"] == pytest.approx(low)


@pytest.mark.parametrize(
    ("params", "words"),
    [({"eps": 0.0}, "eps"), ({"eps": -0.2}, "eps"), ({"log_ratio_clamp": 0.0}, "log_ratio_clamp")],
)
def test_bad_parameters_are_refused_naming_the_field(params, words):
    plugin = lossplug.registry().plugins["gate"]["cfpo"]
    with pytest.raises(Exception, match=words):
        plugin.params(**params)


def test_a_batch_without_old_logp_is_refused():
    with pytest.raises(lossplug.BatchValidationError, match="old_logp"):
        loss_and_grad({"gates": ["cfpo"], "reduction": "token"}, logp=torch.full((1, 2), -1.0), advantage=torch.ones(1))
