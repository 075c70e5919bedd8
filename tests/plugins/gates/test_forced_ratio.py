"""force_on_policy: NeMo-RL's ``force_on_policy_ratio`` (ratio 1 in value, gradient kept).

Oracle, float64, loss and gradient: NeMo-RL's ``ClippedPGLossFn`` actor loss with ``force_on_policy_ratio: true``,
transcribed here (NeMo-RL's trainer does not import without its distributed stack), for its clip parameters, dual
clip and both loss levels.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug.testing.batches import loss_and_grad, policy_fields

SHAPES = [(1, 3), (3, 7), (6, 10), (8, 33)]
NEMO_PARAMS = [(0.2, 0.2, None), (0.2, 0.28, 3.0), (0.1, 0.5, 1.5)]


def fields(B: int, T: int, seed: int, token_advantage: bool = False) -> dict:
    f = policy_fields(B, T, seed=seed, token_advantage=token_advantage)
    f["action_mask"][:, 0] = True
    return {k: f[k] for k in ("logp", "advantage", "action_mask")}


def nemo_rl_actor_loss(curr, adv, token_mask, clip_min, clip_max, clip_c, token_level):
    """ClippedPGLossFn with force_on_policy_ratio=True, use_importance_sampling_correction=False, one micro-batch."""
    adv = adv if adv.ndim == 2 else adv[:, None].expand_as(curr)
    ratios = (curr - curr.detach()).exp()
    ratios_clamped = ratios  # the forced ratio is never clipped
    clip_loss = torch.max(-adv * ratios, -adv * ratios_clamped)
    if clip_c is not None:
        clip_loss = torch.where(adv < 0, torch.min(clip_loss, -adv * clip_c), clip_loss)
    weights = torch.ones_like(curr)  # prev_logprobs = curr.detach(): no importance weights in use
    if token_level:
        return (weights * clip_loss * token_mask).sum() / token_mask.sum()
    per_sample = (weights * clip_loss * token_mask).sum(-1) / token_mask.sum(-1)
    return per_sample.mean()


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("clip_min,clip_max,clip_c", NEMO_PARAMS)
@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("token_advantage", [False, True])
def test_against_nemo_rl_transcribed(B, T, clip_min, clip_max, clip_c, token_level, token_advantage):
    for seed in range(3):
        f = fields(B, T, seed, token_advantage)
        reduction = "token" if token_level else "response"
        result, grad = loss_and_grad({"gates": ["force_on_policy"], "reduction": reduction}, **f)
        curr = f["logp"].clone().requires_grad_()
        mask = f["action_mask"].double()
        expected = nemo_rl_actor_loss(curr, f["advantage"], mask, clip_min, clip_max, clip_c, token_level)
        expected.backward()
        torch.testing.assert_close(result.loss, expected, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, curr.grad, rtol=1e-12, atol=1e-14)


@st.composite
def batches(draw):
    B, T = draw(st.integers(1, 5)), draw(st.integers(2, 9))
    return fields(B, T, seed=draw(st.integers(0, 2**20)), token_advantage=draw(st.booleans()))


@given(batches(), st.sampled_from(["token", "response", "sequence_sum", "token_sum"]))
def test_value_is_the_reduced_advantage_and_gradient_is_reinforces(f, reduction):
    forced, g_forced = loss_and_grad({"gates": ["force_on_policy"], "reduction": reduction}, **f)
    plain, g_plain = loss_and_grad({"gates": ["reinforce"], "reduction": reduction}, **f)
    assert torch.equal(g_forced, g_plain)
    adv = f["advantage"] if f["advantage"].ndim == 2 else f["advantage"][:, None].expand_as(f["logp"])
    value = lossplug.reduce(-adv, f["action_mask"], reduction=reduction)  # the loss of the objective J = A
    torch.testing.assert_close(forced.loss, value, rtol=1e-12, atol=1e-14)
    assert "update/approx_kl" not in forced.metrics  # no old_logp needed, none read


def test_needs_nothing_but_logp_and_the_advantage():
    plugin = lossplug.registry().plugins["gate"]["force_on_policy"]
    assert plugin.required_fields(plugin.params()) == ()
