"""up_grpo against an independent float64 transcription of UP-GRPO's ``compute_policy_loss`` (the post's appendix,
rocfly88/rocfly88.github.io@36e2942 ``_posts/2026-02-26-UP-GRPO.md``): loss and gradient token by token in plain
Python floats, the gradient taken by hand branch by branch; its invariants (ppo_clip with the dual clip where every
A ≤ 0, reinforce where every A > 0, PPO's gradient at r = 1, no bound on the positive path); metrics and rules."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug.testing.batches import loss_and_grad


def post_token_mean(logp, old, adv, mask, eps_low=0.2, eps_high=0.2, c=3.0):
    """The post's loss with verl's ``token-mean``: ``−A·logp`` where A > 0, else the dual-clip PPO loss
    ``min(−A·c, max(−A·r, −A·clip(r)))`` (and ``max(−A·r, −A·clip(r))`` at A = 0, which is 0). Its gradient
    d loss/d logp, by hand: −A where A > 0; for A < 0 the branch that wins — −A·r on the raw ratio, 0 on a clipped
    or dual bound constant. Returns (loss, gradient rows)."""
    n = sum(bool(m) for row in mask for m in row)
    total, grad = 0.0, [[0.0] * len(logp[0]) for _ in logp]
    for i, row in enumerate(mask):
        for t, on in enumerate(row):
            if not on:
                continue
            a = adv[i][t]
            if a > 0:
                total += -a * logp[i][t]
                grad[i][t] = -a / n
                continue
            r = math.exp(logp[i][t] - old[i][t])
            raw, clipped = -a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high)
            loss = max(raw, clipped)
            d = -a * r if raw >= clipped else 0.0
            if a < 0 and -a * c < loss:
                loss, d = -a * c, 0.0
            total += loss
            grad[i][t] = d / n
    return total / n, grad


def random_fields(seed, B=6, T=7, scale=0.8, seq_adv=False, sign=None):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4 - 0.05
    logp = (old + scale * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    adv = torch.randn(B, generator=g, dtype=torch.float64) if seq_adv else torch.randn(B, T, generator=g).double()
    if sign is not None:
        adv = sign * adv.abs()
    return logp, old, adv, mask


def run(gate, logp, old, adv, mask=None, reduction="token"):
    return loss_and_grad(
        {"gates": [gate], "reduction": reduction}, logp=logp, old_logp=old, advantage=adv, action_mask=mask
    )


@pytest.mark.parametrize("seq_adv", [False, True], ids=["token-advantage", "sequence-advantage"])
@pytest.mark.parametrize(
    "params", [{}, {"eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": 10.0}, {"eps_low": 0.1, "dual_clip_c": 1.5}]
)
def test_loss_and_gradient_equal_the_posts_code_in_float64(params, seq_adv):
    logp, old, adv, mask = random_fields(seed=len(params) * 7 + seq_adv, seq_adv=seq_adv)
    # garbage off the mask, as trainers hold there: it must reach neither value nor gradient
    result, grad = run(
        {"name": "up_grpo", **params},
        torch.where(mask, logp, 50.0),
        torch.where(mask, old, -50.0),
        adv,
        mask,
    )
    adv_bt = adv[:, None].expand_as(logp) if seq_adv else adv
    expected, expected_grad = post_token_mean(
        logp.tolist(),
        old.tolist(),
        adv_bt.tolist(),
        mask.tolist(),
        params.get("eps_low", 0.2),
        params.get("eps_high", 0.2),
        params.get("dual_clip_c", 3.0),
    )
    assert result.loss.dtype == torch.float64
    assert abs(result.loss.item() - expected) <= 1e-13
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    # every branch is exercised: positive, raw negative, lower clip, dual clip
    r = (logp - old).exp()
    neg = (adv_bt < 0) & mask
    assert ((adv_bt > 0) & mask).any() and (neg & (r < 1 - params.get("eps_low", 0.2))).any()
    assert (neg & (r > params.get("dual_clip_c", 3.0))).any() or params.get("dual_clip_c") == 10.0


def test_the_positive_path_is_unbounded():
    # A > 0 at ratios 50 and 0.02: ppo_clip cuts the first (gradient 0), up_grpo keeps the full A for both
    old = torch.tensor([[-5.0, -1.0]], dtype=torch.float64)
    logp = old + torch.tensor([[math.log(50.0), math.log(0.02)]], dtype=torch.float64)
    adv = torch.tensor([[1.5, 0.5]], dtype=torch.float64)
    result, grad = run("up_grpo", logp, old, adv, reduction="sequence_sum")
    _, ppo_grad = run("ppo_clip", logp, old, adv, reduction="sequence_sum")
    torch.testing.assert_close(-grad, adv)
    assert ppo_grad[0, 0] == 0
    torch.testing.assert_close(result.loss, -(adv * logp).sum())
    assert result.metrics["up_grpo/positive_frac"] == 1.0


# -- invariants -------------------------------------------------------------------------------------------------------


@st.composite
def batches(draw, sign=None):
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.0, 1e-3, 0.1, 0.5, 2.0]))
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    return random_fields(seed, B=B, T=T, scale=scale, seq_adv=draw(st.booleans()), sign=sign)


@given(fields=batches(sign=-1.0), c=st.sampled_from([1.5, 3.0, 10.0]))
def test_negative_advantages_are_ppo_clip_with_the_dual_clip(fields, c):
    logp, old, adv, mask = fields
    up, g_up = run({"name": "up_grpo", "eps_high": 0.28, "dual_clip_c": c}, logp, old, adv, mask)
    ppo, g_ppo = run({"name": "ppo_clip", "eps_high": 0.28, "dual_clip_c": c}, logp, old, adv, mask)
    torch.testing.assert_close(up.loss, ppo.loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(g_up, g_ppo, rtol=1e-12, atol=1e-15)
    assert up.metrics["up_grpo/clip_frac_low"] == pytest.approx(ppo.metrics["ppo_clip/clip_frac_low"])
    assert up.metrics["up_grpo/clip_frac_dual"] == pytest.approx(ppo.metrics["ppo_clip/clip_frac_dual"])


@given(fields=batches(sign=1.0))
def test_positive_advantages_are_reinforce(fields):
    logp, old, adv, mask = fields
    adv = adv + 1e-3  # strictly positive
    up, g_up = run("up_grpo", logp, old, adv, mask)
    pg, g_pg = run("reinforce", logp, old, adv, mask)
    torch.testing.assert_close(up.loss, pg.loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(g_up, g_pg, rtol=1e-12, atol=1e-15)


@given(fields=batches())
def test_at_ratio_one_the_gradient_is_ppos(fields):
    _, old, adv, mask = fields
    _, g_up = run("up_grpo", old.clone(), old, adv, mask)
    _, g_ppo = run({"name": "ppo_clip", "dual_clip_c": 3.0}, old.clone(), old, adv, mask)
    torch.testing.assert_close(g_up, g_ppo, rtol=1e-12, atol=1e-15)


# -- metrics and rules ------------------------------------------------------------------------------------------------


def test_metrics_count_the_paths_over_all_action_tokens():
    logp, old, adv, mask = random_fields(seed=1, B=6, T=8, scale=1.5)
    result, _ = run("up_grpo", logp, old, adv, mask)
    r, n = (logp - old).exp(), mask.sum().item()
    surrogate = torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)
    counts = {
        "positive_frac": (adv > 0) & mask,
        "clip_frac_low": (adv < 0) & (r < 0.8) & mask,
        "clip_frac_dual": (adv < 0) & (surrogate < 3.0 * adv) & mask,
    }
    for key, hit in counts.items():
        assert 0 < hit.sum().item() < n, key
        assert result.metrics[f"up_grpo/{key}"] == pytest.approx(hit.sum().item() / n), key


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"dual_clip_c": 1.0}, "dual_clip_c"),
        ({"eps_low": 1.0}, "eps_low"),
        ({"eps_high": 0.0}, "eps_high"),
        ({"log_ratio_clamp": -1.0}, "log_ratio_clamp"),
    ],
)
def test_bad_parameters_are_refused_naming_the_field(params, words):
    plugin = lossplug.registry().plugins["gate"]["up_grpo"]
    with pytest.raises(Exception, match=words):
        plugin.params(**params)


def test_a_batch_without_old_logp_is_refused():
    with pytest.raises(lossplug.BatchValidationError, match="old_logp"):
        loss_and_grad(
            {"gates": ["up_grpo"], "reduction": "token"}, logp=torch.full((1, 2), -1.0), advantage=torch.ones(1)
        )
