"""seq_mask_tis: OpenRLHF's and NeMo-RL's seq-mask-tis correction, after PPO's clip (OpenRLHF's ``ppo`` loss).

Oracles, float64, loss and gradient: the rule transcribed here from OpenRLHF 0.11.0 and NeMo-RL (always), and
OpenRLHF 0.11.2's own ``PolicyLoss``, read from its wheel (``tests/_origins.py``) with ``is_correction_level="seq"``,
``is_correction_mode="mask"``, ``is_correction_gating="ratio"`` (0.11.0's ``vllm_is_correction_type="seq-mask-tis"``
spelled the same rule).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug.testing.batches import loss_and_grad, policy_fields

from ._field_origins import openrlhf_loss

SHAPES = [(1, 3), (3, 7), (6, 10), (8, 33)]
BOUNDS = [(0.5, 5.0), (0.9, 1.1), (0.999, 1.002), (0.2, 1.05)]


def fields(B: int, T: int, seed: int, scale: float = 0.4, token_advantage: bool = False) -> dict:
    f = policy_fields(B, T, seed=seed, log_ratio_scale=scale, token_advantage=token_advantage)
    f["action_mask"][:, 0] = True
    return {k: f[k] for k in ("logp", "old_logp", "behavior_logp", "advantage", "action_mask")}


def run(f: dict, low: float, high: float, reduction: str = "token", update: str = "ppo_clip"):
    recipe = {"gates": [update, {"name": "seq_mask_tis", "low": low, "high": high}], "reduction": reduction}
    return loss_and_grad(recipe, **f)


def transcribed(logp, old, behavior, adv, mask, low, high):
    """OpenRLHF's ppo loss with seq-mask-tis, token-level mean: the rule as its code and NeMo-RL's state it."""
    adv = adv if adv.ndim == 2 else adv[:, None].expand_as(logp)
    ratio = (logp - old).clamp(-20, 20).exp()
    loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    engine = old - behavior
    geometric = ((engine * mask).sum(-1) / mask.sum(-1)).exp()
    kept = ((geometric >= low) & (geometric <= high)).to(logp.dtype)
    loss = kept[:, None] * engine.exp() * loss
    return (loss * mask).sum() / mask.sum()


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("low,high", BOUNDS)
@pytest.mark.parametrize("token_advantage", [False, True])
def test_against_the_transcribed_rule(B, T, low, high, token_advantage):
    for seed in range(3):
        f = fields(B, T, seed, token_advantage=token_advantage)
        result, grad = run(f, low, high)
        logp = f["logp"].clone().requires_grad_()
        mask = f["action_mask"].double()
        expected = transcribed(logp, f["old_logp"], f["behavior_logp"], f["advantage"], mask, low, high)
        expected.backward()
        torch.testing.assert_close(result.loss, expected, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-14)


@pytest.fixture(scope="module")
def loss_module(origins):
    return openrlhf_loss(origins)


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("low,high", BOUNDS)
def test_against_openrlhf(loss_module, B, T, low, high):
    options = dict(is_correction_level="seq", is_correction_mode="mask", is_correction_gating="ratio")
    policy_loss = loss_module.PolicyLoss(
        clip_eps_low=0.2, clip_eps_high=0.2, **options, is_correction_threshold=[low, high]
    )
    for seed in range(3):
        f = fields(B, T, seed, token_advantage=True)
        result, grad = run(f, low, high)
        logp = f["logp"].clone().requires_grad_()
        mask = f["action_mask"].double()
        expected, *_ = policy_loss(logp, f["old_logp"], f["advantage"], mask, rollout_log_probs=f["behavior_logp"])
        expected.backward()
        torch.testing.assert_close(result.loss, expected, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-14)


@st.composite
def batches(draw):
    B, T = draw(st.integers(1, 5)), draw(st.integers(2, 9))
    return fields(B, T, seed=draw(st.integers(0, 2**20)), scale=draw(st.sampled_from([0.0, 0.01, 0.3, 1.5])))


def weight(f: dict, low: float, high: float) -> torch.Tensor:
    plugin = lossplug.registry().plugins["gate"]["seq_mask_tis"]
    inp = lossplug.GateInput.from_batch(lossplug.PolicyBatch(**f))
    out = plugin(inp, plugin.params(low=low, high=high))
    assert not out.weight.requires_grad
    return out.weight


@given(batches(), st.sampled_from(BOUNDS))
def test_a_response_is_dropped_whole_or_weighed_by_its_raw_token_ratios(f, bounds):
    w, mask = weight(f, *bounds), f["action_mask"]
    ratio = (f["old_logp"] - f["behavior_logp"]).exp()
    for i in range(w.shape[0]):
        row, kept = w[i][mask[i]], ratio[i][mask[i]]
        assert bool((row == 0).all()) or torch.allclose(row, kept, rtol=1e-12, atol=0)


@given(batches(), st.sampled_from(BOUNDS), st.randoms(use_true_random=False))
def test_the_keep_rule_ignores_the_order_of_a_responses_tokens(f, bounds, rnd):
    # the geometric mean is symmetric: permuting each response's action tokens permutes its weights alike
    w = weight(f, *bounds)
    shuffled = {k: v.clone() for k, v in f.items()}
    perms = []
    for i in range(f["logp"].shape[0]):
        where = f["action_mask"][i].nonzero().squeeze(-1)
        perm = where[torch.tensor(rnd.sample(range(len(where)), len(where)))]
        perms.append((where, perm))
        for k in ("logp", "old_logp", "behavior_logp"):
            shuffled[k][i, where] = f[k][i, perm]
    ws = weight(shuffled, *bounds)
    for i, (where, perm) in enumerate(perms):
        torch.testing.assert_close(ws[i, where], w[i, perm], rtol=1e-12, atol=0)


def test_equal_engines_weigh_one_and_an_extreme_response_is_dropped_finite():
    f = fields(4, 6, seed=7)
    f["behavior_logp"] = f["old_logp"].clone()
    assert bool((weight(f, 0.5, 5.0)[f["action_mask"]] == 1).all())
    f["behavior_logp"][0] = f["old_logp"][0] - 500.0  # a response the engine found e^500 times less likely
    w = weight(f, 0.5, 5.0)
    assert bool(torch.isfinite(w).all()) and bool((w[0] == 0).all())


def test_bounds_are_checked():
    with pytest.raises(lossplug.RecipeError, match="low"):
        lossplug.Recipe.load({"gates": ["ppo_clip", {"name": "seq_mask_tis", "low": 2.0, "high": 1.0}]})
