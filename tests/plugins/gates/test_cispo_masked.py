"""cispo_masked: ROLL's CISPO with ``cispo_use_unified_mask``.

Oracle in float64, loss and gradient: ROLL's ``_compute_cispo_loss`` (``roll/pipeline/rlvr/actor_pg_worker.py``,
alibaba/ROLL 8eb27cc2) transcribed here as formulas — ``−clamp(r, 1 − ε_low, 1 + ε_high).detach() · A · logp ·
token_mask`` with the mask of the tokens past the clip in the advantage's direction — reduced as a token mean.
Properties: where nothing is cut it is ``cispo``; a cut token gets no gradient; the inner side keeps the clipped
weight (unlike PPO).
"""

from __future__ import annotations

import pytest
import torch

import lossplug
from lossplug.testing.batches import loss_and_grad, policy_fields

SHAPES = [(1, 2), (3, 7), (6, 10), (8, 33)]
CASES = [{}, {"eps_low": 0.2, "eps_high": 0.28}, {"eps_low": 0.05, "eps_high": 0.5, "log_ratio_clamp": None}]


def fields(B: int, T: int, seed: int, scale: float = 0.4, token_advantage: bool = True) -> dict:
    f = policy_fields(B, T, seed=seed, log_ratio_scale=scale, token_advantage=token_advantage)
    f["action_mask"][:, 0] = True
    return {k: f[k] for k in ("logp", "old_logp", "advantage", "action_mask")}


def run(params: dict, f: dict, reduction: str = "token"):
    return loss_and_grad({"gates": [{"name": "cispo_masked", **params}], "reduction": reduction}, **f)


def roll_transcribed(params: dict, logp, old, adv, mask):
    """ROLL's per-token CISPO loss with the unified mask, token mean over the action tokens."""
    eps_low, eps_high = params.get("eps_low", 0.1), params.get("eps_high", 0.1)
    adv = adv if adv.ndim == 2 else adv[:, None].expand_as(logp)
    ratio = (logp - old).exp()  # ROLL: no clamp (the log-ratios here stay far below 20)
    clip_lower, clip_upper = 1.0 - eps_low, 1.0 + eps_high
    clipped_ratio = torch.clamp(ratio, min=clip_lower, max=clip_upper)
    mask_positive = (adv > 0) & (ratio > clip_upper)
    mask_negative = (adv < 0) & (ratio < clip_lower)
    token_mask = ~(mask_positive | mask_negative)
    per_token = -clipped_ratio.detach() * adv * logp * token_mask.to(logp.dtype)
    return (per_token * mask).sum() / mask.sum()


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("params", CASES, ids=str)
@pytest.mark.parametrize("token_advantage", [True, False])
def test_against_rolls_formula(params, B, T, token_advantage):
    for seed in range(4):
        f = fields(B, T, seed, token_advantage=token_advantage)
        result, grad = run(params, f)
        logp = f["logp"].clone().requires_grad_()
        expected = roll_transcribed(params, logp, f["old_logp"], f["advantage"], f["action_mask"])
        expected.backward()
        torch.testing.assert_close(result.loss, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-12)


def test_where_nothing_is_cut_it_is_cispo():
    f = fields(5, 9, seed=2, scale=0.01)  # every ratio within 1 ± 0.1
    masked, grad_masked = run({}, f)
    plain, grad_plain = loss_and_grad(
        {"gates": [{"name": "cispo", "eps_low": 0.1, "eps_high": 0.1}], "reduction": "token"}, **f
    )
    torch.testing.assert_close(masked.loss, plain.loss, rtol=1e-15, atol=0)
    torch.testing.assert_close(grad_masked, grad_plain, rtol=1e-15, atol=0)


def test_cut_tokens_get_no_gradient_and_the_inner_side_keeps_the_clipped_weight():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]], dtype=torch.float64))
    old = logp - torch.log(torch.tensor([[2.0, 0.5, 2.0, 0.5]], dtype=torch.float64))  # r = 2, 0.5, 2, 0.5
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    _, grad = loss_and_grad(
        {"gates": ["cispo_masked"], "reduction": "token_sum"}, logp=logp, old_logp=old, advantage=adv, action_mask=mask
    )
    # A > 0, r = 2: cut; A > 0, r = 0.5: weight 0.9 (PPO: 0.5); A < 0, r = 2: weight 1.1; A < 0, r = 0.5: cut
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.9, 1.1, 0.0]], dtype=torch.float64))


def test_parameters_are_checked():
    for bad in ({"eps_low": 0.0}, {"eps_low": 1.5}, {"eps_high": -0.1}):
        with pytest.raises(lossplug.RecipeError, match="cispo_masked"):
            lossplug.Recipe.model_validate({"gates": [{"name": "cispo_masked", **bad}], "reduction": "token"})
