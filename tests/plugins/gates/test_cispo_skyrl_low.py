"""cispo with a lower bound of exactly 1 (``eps_low: 0``): SkyRL's default ``cispo_eps_clip_low: 0.0``.

Oracle: SkyRL 0.3.0's own ``compute_policy_loss_cispo`` (``ppo_utils``, read from its wheel by ``tests/_origins.py``),
float64 loss and gradient, anchored at the old policy's log-probs as SkyRL's trainer runs it. SkyRL sums the
per-token loss over the actions (``reduce_loss``; its reduction is folded into the advantages), so the recipe's
reduction here is ``token_sum``; its ratio goes through float32 in ``safe_exp_delta``: 1e-6 relative.
"""

from __future__ import annotations

import pytest
import torch

import lossplug
from lossplug.testing.batches import loss_and_grad, policy_fields

from ._field_origins import skyrl_config, skyrl_ppo_utils

SHAPES = [(1, 1), (3, 7), (8, 33)]
#: (cispo_eps_clip_low, cispo_eps_clip_high): SkyRL's defaults first
BOUNDS = [(0.0, 5.0), (0.0, 0.2), (0.0, 0.5), (0.2, 0.28), (1.0, 5.0)]


def fields(B: int, T: int, seed: int) -> dict:
    f = policy_fields(B, T, seed=seed, log_ratio_scale=0.8, token_advantage=True)
    f["action_mask"][:, 0] = True  # every response has an action (short shapes would leave rows empty)
    return {k: f[k] for k in ("logp", "old_logp", "advantage", "action_mask")}


def run(gate: dict, f: dict, reduction: str = "token_sum"):
    return loss_and_grad({"gates": [gate], "reduction": {"name": reduction}}, **f)


@pytest.fixture(scope="module")
def ppo_utils(origins):
    return skyrl_ppo_utils(origins)


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("eps_low,eps_high", BOUNDS)
def test_against_skyrl_cispo(ppo_utils, eps_low, eps_high, B, T):
    config = skyrl_config(
        policy_loss_type="cispo", cispo={"cispo_eps_clip_low": eps_low, "cispo_eps_clip_high": eps_high}
    )
    for seed in range(3):
        f = fields(B, T, seed)
        result, grad = run({"name": "cispo", "eps_low": eps_low, "eps_high": eps_high}, f)
        logp = f["logp"].clone().requires_grad_()
        mask = f["action_mask"].double()
        expected, skyrl_metrics = ppo_utils.compute_policy_loss_cispo(
            logp, f["old_logp"], f["advantage"], config, loss_mask=mask, rollout_logprobs=None
        )
        expected.backward()
        torch.testing.assert_close(result.loss, expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, logp.grad, rtol=1e-6, atol=1e-7)
        # SkyRL's clip_ratio: the fraction of action tokens whose weight the clip moved (both sides)
        assert result.metrics["cispo/clip_frac"] == pytest.approx(skyrl_metrics["clip_ratio"], abs=1e-6)


def test_lower_bound_of_one_raises_every_weight_below_one():
    update = torch.tensor([[0.5, 1.0, 2.0, 9.0]], dtype=torch.float64)
    shift = -3.0
    result, grad = loss_and_grad(
        {"gates": [{"name": "cispo", "eps_low": 0.0, "eps_high": 5.0}], "reduction": "sequence_sum"},
        logp=update.log() + shift,
        old_logp=torch.full((1, 4), shift, dtype=torch.float64),
        advantage=torch.ones(1, dtype=torch.float64),
    )
    # objective sg(w)·A·logp with A = 1, one response under sequence_sum: ∂loss/∂logp = −w
    torch.testing.assert_close(-grad, torch.tensor([[1.0, 1.0, 2.0, 6.0]], dtype=torch.float64))
    m = result.metrics
    assert m["cispo/clip_frac_low"] == pytest.approx(1 / 4)  # r = 1 sits on the bound: not clipped
    assert m["cispo/clip_frac_high"] == pytest.approx(1 / 4)
    assert m["cispo/clip_frac"] == pytest.approx(2 / 4)
    assert m["cispo/active_token_frac"] == 1.0  # saturated, never dropped


@pytest.mark.parametrize("eps_high", [5.0, 0.2])
def test_cispo_seq_lower_bound_of_one(eps_high):
    # the sequence weight clip(s, 1, 1 + eps_high), s = exp(mean_t log r_t) over each response's action tokens
    f = fields(6, 10, seed=4)
    result, grad = run({"name": "cispo_seq", "eps_low": 0.0, "eps_high": eps_high}, f)
    mask = f["action_mask"]
    log_ratio = (f["logp"] - f["old_logp"]) * mask
    seq_ratio = (log_ratio.sum(-1) / mask.sum(-1)).clamp(-20, 20).exp()
    weight = seq_ratio.clamp(1.0, 1 + eps_high)[:, None].expand_as(log_ratio)
    torch.testing.assert_close(-grad, weight * f["advantage"] * mask, rtol=1e-12, atol=1e-12)
    below = (seq_ratio < 1).double() * mask.sum(-1)
    assert result.metrics["cispo_seq/clip_frac_low"] == pytest.approx(float(below.sum() / mask.sum()))


@pytest.mark.parametrize("name", ["cispo", "cispo_seq"])
def test_eps_low_zero_is_accepted_and_negative_refused(name):
    recipe = lossplug.Recipe.load({"gates": [{"name": name, "eps_low": 0.0, "eps_high": 5.0}], "reduction": "token"})
    assert recipe.gates[0].params["eps_low"] == 0.0
    with pytest.raises(lossplug.RecipeError, match="eps_low"):
        lossplug.Recipe.load({"gates": [{"name": name, "eps_low": -0.1}], "reduction": "token"})
