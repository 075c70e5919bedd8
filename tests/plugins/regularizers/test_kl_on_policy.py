"""kl_on_policy: NeMo-RL's KL term with the score-function weight.

Oracle in float64, loss and gradient: NeMo-RL's ``calculate_kl`` and its weighting in ``ClippedPGLossFn``
(NVIDIA-NeMo/RL 7ea279ab) transcribed here — ``w = exp(curr − curr.detach())`` or ``exp(curr − generation)``,
the weight detached where the input clamp binds, ``w·k`` clamped to ±10 — every estimator, both weights, log-ratios
up to ±25 so that both clamps bite, reduced as NeMo-RL's token mean and as its per-response mean. Measured once
against NeMo-RL's own ``calculate_kl`` executed from its source: ≤ 1.7e-16 (loss and gradient). Properties: the value is the
plain estimate's (``kl``'s, with the same clamps); the gradient adds ``k·∇logp``.
"""

from __future__ import annotations

import pytest
import torch

import lossplug
from lossplug.testing.batches import loss_and_grad, policy_fields

F64 = torch.float64
SHAPES = [(1, 2), (3, 7), (6, 10)]
CASES = [{"estimator": e, "weight": w} for e in ("k1", "k2", "k3") for w in ("self", "behavior")]
COEF = 0.05


def fields(B: int, T: int, seed: int, spread: float = 28.0) -> dict:
    """Log-probs and reference log-probs drawn apart, so that ``ref − logp`` reaches ±25: both clamps bite."""
    f = policy_fields(B, T, seed=seed, log_ratio_scale=0.4)
    f["action_mask"][:, 0] = True
    gen = torch.Generator().manual_seed(seed + 100)
    f["logp"] = -(0.05 + spread * torch.rand(B, T, generator=gen, dtype=F64))
    f["ref_logp"] = -(0.05 + spread * torch.rand(B, T, generator=gen, dtype=F64))
    f["behavior_logp"] = (f["logp"] + 0.3 * torch.randn(B, T, generator=gen, dtype=F64)).clamp(max=-1e-3)
    f["advantage"] = torch.zeros(B, dtype=F64)  # the policy term vanishes: only the KL term remains
    return {k: f[k] for k in ("logp", "ref_logp", "behavior_logp", "advantage", "action_mask")}


def run(params: dict, f: dict, reduction: str):
    reg = {"name": "kl_on_policy", "coef": COEF, **params}
    return loss_and_grad({"gates": ["reinforce"], "reduction": reduction, "regularizers": [reg]}, **f)


def nemo_calculate_kl(logprobs, logprobs_reference, kl_type, weights, input_clamp=20.0, output_clamp=10.0):
    """NeMo-RL's calculate_kl(..., importance_sampling_weights=weights), read as formulas."""
    logr = logprobs_reference - logprobs
    logr_clamped = logr.clamp(min=-input_clamp, max=input_clamp)
    weights = torch.where(logr == logr_clamped, weights, weights.detach())
    logr = logr_clamped
    kl = {"k1": -logr, "k2": torch.square(logr) / 2, "k3": torch.exp(logr) - 1 - logr}[kl_type]
    return (weights * kl).clamp(min=-output_clamp, max=output_clamp)


def nemo_kl_term(params, logp, ref, behavior, mask, reduction):
    anchor = logp.detach() if params["weight"] == "self" else behavior
    weights = torch.nan_to_num(torch.exp(logp - anchor), nan=0.0, posinf=0.0, neginf=0.0)
    kl = COEF * nemo_calculate_kl(logp, ref, params["estimator"], weights)
    m = mask.to(F64)
    if reduction == "token":
        return (kl * m).sum() / m.sum()
    return ((kl * m).sum(-1) / m.sum(-1)).mean()


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("params", CASES, ids=str)
@pytest.mark.parametrize("reduction", ["token", "response"])
def test_against_nemo_rls_formula(params, B, T, reduction):
    for seed in range(4):
        f = fields(B, T, seed)
        result, grad = run(params, f, reduction)
        logp = f["logp"].clone().requires_grad_()
        expected = nemo_kl_term(params, logp, f["ref_logp"], f["behavior_logp"], f["action_mask"], reduction)
        expected.backward()
        torch.testing.assert_close(result.loss, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_value_is_the_plain_estimate_and_the_gradient_adds_the_score_term(estimator):
    f = fields(4, 6, seed=3, spread=1.5)  # no clamp binds
    ours, grad = run({"estimator": estimator}, f, "token_sum")
    plain, plain_grad = loss_and_grad(
        {
            "gates": ["reinforce"],
            "reduction": "token_sum",
            "regularizers": [{"name": "kl", "coef": COEF, "estimator": estimator}],
        },
        **f,
    )
    torch.testing.assert_close(ours.loss, plain.loss, rtol=1e-12, atol=1e-12)
    delta = f["ref_logp"] - f["logp"]
    k = {"k1": -delta, "k2": delta.square() / 2, "k3": torch.exp(delta) - 1 - delta}[estimator]
    torch.testing.assert_close(grad, plain_grad + COEF * k * f["action_mask"], rtol=1e-12, atol=1e-12)


def test_parameters_are_checked():
    for bad in ({"estimator": "abs"}, {"weight": "ref"}, {"input_clamp": 0.0}):
        with pytest.raises(lossplug.RecipeError, match="kl_on_policy"):
            lossplug.Recipe.model_validate(
                {"gates": ["reinforce"], "reduction": "token", "regularizers": [{"name": "kl_on_policy", **bad}]}
            )
