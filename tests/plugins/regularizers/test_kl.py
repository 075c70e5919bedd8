"""The ``kl`` regularizer against the trainers' own code, in float64, loss and gradient (≤ 1e-8 relative):

* every estimator against verl 0.9.1's ``core_algos.kl_penalty`` aggregated by its ``agg_loss`` (verl's
  ``use_kl_loss`` path: ``kl_loss = agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type)) · kl_loss_coef``),
  the clamps exercised (log-ratios up to ±25);
* ``k3+``: k3's value, k2's gradient;
* ``ratio_weight`` (TRL's ``use_bias_correction_kl``) and ``clamp: false`` (TRL's ``beta`` term) against TRL 1.16's
  own ``GRPOTrainer._compute_loss``, run unbound on a stand-in trainer (``conftest.FakeGRPOTrainer``).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossplug
from lossplug import BatchValidationError, PolicyBatch, Recipe
from lossplug.needs import recipe_needs
from lossplug.plugins.regularizers.kl import estimate

ESTIMATORS = ["k1", "k2", "k3", "kl", "abs", "mse", "low_var_kl", "k1+", "k3+", "kl+", "abs+", "low_var_kl+", "k2+"]
#: lossplug reduction → verl loss_agg_mode (seq-mean-token-mean adds 1e-8 to its denominators: not compared here)
VERL_AGG = {"token": "token-mean", "token_sum": "token-sum", "sequence_sum": "seq-mean-token-sum"}
RTOL = 1e-8


def tensors(seed=0, B=5, T=7, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    logp = -(0.05 + 3.0 * torch.rand(B, T, generator=g, dtype=torch.float64))
    ref = (logp + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    old = (logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    return logp, ref, old, mask


def extreme():
    """Log-ratios ref − logp of ±25, ±15, ±3: verl's ±20 clamp of the log-ratio and ±10 clamp of k3 both bite."""
    logp, ref, old, mask = tensors(1)
    logp[0, :3] = torch.tensor([-25.5, -0.5, -15.2], dtype=torch.float64)
    ref[0, :3] = torch.tensor([-0.5, -25.5, -0.2], dtype=torch.float64)
    mask[0, :3] = True
    return logp, ref, old, mask


def assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=1e-12)


def lossplug_loss(recipe, logp, mask, *, normalizer=None, **fields):
    """policy_loss with advantage 0 (the update gate contributes exactly 0 and no gradient): the regularizer alone."""
    leaf = logp.clone().requires_grad_()
    batch = PolicyBatch(logp=leaf, action_mask=mask, advantage=torch.zeros(logp.shape[0], dtype=logp.dtype), **fields)
    result = lossplug.policy_loss(batch, recipe, normalizer)
    (grad,) = torch.autograd.grad(result.loss, leaf)
    return result, grad


def kl_recipe(reduction="token", **params):
    # reinforce (J = A·logp) with A = 0: the policy term is exactly 0, without gradient
    return Recipe.load({"gates": ["reinforce"], "reduction": reduction, "regularizers": [{"name": "kl", **params}]})


@pytest.mark.parametrize("reduction", sorted(VERL_AGG))
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("batch", [tensors, extreme], ids=["ordinary", "clamped"])
def test_every_estimator_is_verls_kl_penalty(estimator, reduction, batch):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    logp, ref, _, mask = batch()
    coef = 0.37
    result, grad = lossplug_loss(kl_recipe(reduction, coef=coef, estimator=estimator), logp, mask, ref_logp=ref)

    leaf = logp.clone().requires_grad_()
    expected = coef * core_algos.agg_loss(
        core_algos.kl_penalty(leaf, ref, estimator), mask.to(logp.dtype), VERL_AGG[reduction]
    )
    (expected_grad,) = torch.autograd.grad(expected, leaf)
    assert_close(result.loss, expected)
    assert_close(grad, expected_grad)


def test_the_clamped_cases_really_clamp():
    logp, ref, _, _ = extreme()
    k3 = estimate(logp[0, :3], ref[0, :3], "k3")
    plain = estimate(logp[0, :3], ref[0, :3], "k3", clamp=False)
    assert k3[0] == 10.0 and k3[2] == 10.0  # δ = 25 → 20 → exp(20)… clamped to 10; δ = 15 → clamped to 10
    assert plain[2] > 1e6 and torch.isfinite(plain).all()


def test_k3_plus_has_k3s_value_and_k2s_gradient():
    logp, ref, _, mask = tensors(2, spread=0.6)
    plus, plus_grad = lossplug_loss(kl_recipe(estimator="k3+"), logp, mask, ref_logp=ref)
    k3, _ = lossplug_loss(kl_recipe(estimator="k3"), logp, mask, ref_logp=ref)
    _, k2_grad = lossplug_loss(kl_recipe(estimator="k2"), logp, mask, ref_logp=ref)
    assert_close(plus.loss, k3.loss)
    assert_close(plus_grad, k2_grad)
    # and k2's gradient is (logp − ref), the unbiased KL gradient: token mean → /N
    assert_close(plus_grad, torch.where(mask, 0.001 * (logp - ref), 0) / mask.sum())


def test_trl_computes_the_bias_corrected_kl_with_an_undetached_ratio():
    """TRL 1.16 multiplies the k3 estimate by coef_1 = exp(log-ratio) — not detached — when use_bias_correction_kl
    (trl/trainer/grpo_trainer.py 3095-3105) and adds ``beta · per_token_kl`` after the importance weights (3148)."""
    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    source = inspect.getsource(grpo.GRPOTrainer._compute_loss)
    assert "coef_1 = torch.exp(log_importance_weights)" in source
    assert "per_token_kl = per_token_kl * coef_1" in source
    assert "torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1" in source
    kl_at, is_at = (
        source.index("per_token_loss + self.beta * per_token_kl"),
        source.index('inputs["importance_sampling_ratio"]'),
    )
    assert is_at < kl_at


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("bias_correction", [False, True])
@pytest.mark.parametrize("loss_type,reduction", [("grpo", "response"), ("dapo", "token"), ("dr_grpo", "fixed")])
def test_kl_is_trls_beta_term(fake_grpo, loss_type, reduction, bias_correction, level):
    """advantage 0: TRL's loss is its beta term alone, reduced by the loss type's aggregation."""
    logp, ref, old, mask = tensors(3)
    beta = 0.04
    trainer = fake_grpo(
        loss_type=loss_type, beta=beta, use_bias_correction_kl=bias_correction, importance_sampling_level=level
    )
    leaf = logp.clone().requires_grad_()
    B, T = logp.shape
    expected = trainer.compute_loss(
        leaf, torch.zeros_like(logp), mask, torch.zeros(B, dtype=torch.float64), old_logp=old, ref_logp=ref
    )
    (expected_grad,) = torch.autograd.grad(expected, leaf)

    ratio_weight = level if bias_correction else "none"
    red = {"name": "fixed", "budget": T} if reduction == "fixed" else reduction
    recipe = kl_recipe(red, coef=beta, estimator="k3", clamp=False, ratio_weight=ratio_weight)
    # TRL's grpo / dr_grpo count every row of the micro-batch (the TRL adapter's Normalizer does the same)
    norm = lossplug.Normalizer(action_tokens=int(mask.sum()), sequences=B, budget=T)
    result, grad = lossplug_loss(recipe, logp, mask, normalizer=norm, ref_logp=ref, old_logp=old)
    assert_close(result.loss, expected)
    assert_close(grad, expected_grad)


def test_with_a_policy_term_the_loss_is_trls_whole_loss(fake_grpo):
    """dapo with nonzero advantages, beta and the bias-corrected KL: TRL's whole loss and gradient."""
    logp, ref, old, mask = tensors(4, spread=0.5)
    B = logp.shape[0]
    adv = torch.randn(B, dtype=torch.float64)
    trainer = fake_grpo(loss_type="dapo", beta=0.1, use_bias_correction_kl=True)
    leaf = logp.clone().requires_grad_()
    expected = trainer.compute_loss(leaf, torch.zeros_like(logp), mask, adv, old_logp=old, ref_logp=ref)
    (expected_grad,) = torch.autograd.grad(expected, leaf)

    recipe = Recipe.load(
        {
            "gates": [{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2}],
            "reduction": "token",
            "regularizers": [{"name": "kl", "coef": 0.1, "estimator": "k3", "clamp": False, "ratio_weight": "token"}],
        }
    )
    leaf2 = logp.clone().requires_grad_()
    batch = PolicyBatch(logp=leaf2, action_mask=mask, advantage=adv, old_logp=old, ref_logp=ref)
    result = lossplug.policy_loss(batch, recipe)
    (grad,) = torch.autograd.grad(result.loss, leaf2)
    assert_close(result.loss, expected)
    assert_close(grad, expected_grad)


def test_the_ratio_weight_carries_gradient_and_the_term_none_to_the_constants():
    logp, ref, old, mask = tensors(5)
    leaf, ref_leaf, old_leaf = (t.clone().requires_grad_() for t in (logp, ref, old))
    batch = PolicyBatch(
        logp=leaf, action_mask=mask, advantage=torch.zeros(5, dtype=torch.float64), ref_logp=ref_leaf, old_logp=old_leaf
    )
    for weight in ("token", "sequence"):
        loss = lossplug.policy_loss(batch, kl_recipe(estimator="k3", ratio_weight=weight)).loss
        g, g_ref, g_old = torch.autograd.grad(loss, (leaf, ref_leaf, old_leaf), allow_unused=True)
        assert g_ref is None or (g_ref == 0).all()
        assert g_old is None or (g_old == 0).all()
        # the gradient differs from the term's own: ∂(w·k3) = w·∂k3 + k3·∂w
        no_ratio = lossplug.policy_loss(batch, kl_recipe(estimator="k3")).loss
        (g_plain,) = torch.autograd.grad(no_ratio, leaf)
        assert not torch.allclose(g, g_plain)


def test_requires_ref_logp_and_old_logp_with_a_ratio_weight():
    logp, ref, old, mask = tensors(6)
    adv = torch.zeros(5, dtype=torch.float64)
    with pytest.raises(BatchValidationError, match=r"ref_logp: required by recipe.regularizers\[0\] \(kl\)"):
        lossplug.policy_loss(PolicyBatch(logp=logp, action_mask=mask, advantage=adv), kl_recipe())
    with pytest.raises(
        BatchValidationError, match=r"old_logp: required by recipe.regularizers\[0\] \(kl with ratio_weight='token'\)"
    ):
        lossplug.policy_loss(
            PolicyBatch(logp=logp, action_mask=mask, advantage=adv, ref_logp=ref), kl_recipe(ratio_weight="token")
        )
    needs = recipe_needs(kl_recipe(ratio_weight="sequence"))
    assert needs["ref_logp"] == ("regularizers[0] 'kl'",) and needs["old_logp"] == ("regularizers[0] 'kl'",)


def test_parameters_are_checked():
    with pytest.raises(lossplug.RecipeError, match=r"recipe.regularizers\[0\] \(kl\): parameter 'estimator'"):
        kl_recipe(estimator="k4")
    with pytest.raises(lossplug.RecipeError, match="ratio_weight"):
        kl_recipe(ratio_weight="tokens")
    with pytest.raises(lossplug.RecipeError, match="coef"):
        kl_recipe(coef=float("nan"))


def test_extreme_log_ratios_stay_finite_in_float32():
    logp, ref, old, mask = extreme()
    for estimator in ESTIMATORS:
        for weight in ("none", "token", "sequence"):
            result, grad = lossplug_loss(
                kl_recipe(estimator=estimator, ratio_weight=weight, clamp=False),
                logp.float(),
                mask,
                ref_logp=ref.float(),
                old_logp=(logp - 30).float(),
            )
            assert torch.isfinite(result.loss) and torch.isfinite(grad).all(), (estimator, weight)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.floats(-30, -1e-3), min_size=4, max_size=4),
    st.lists(st.floats(-30, -1e-3), min_size=4, max_size=4),
)
def test_straight_through_keeps_the_value_and_takes_k2s_gradient(logps, refs):
    logp = torch.tensor(logps, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor(refs, dtype=torch.float64)
    (k2_grad,) = torch.autograd.grad(estimate(logp, ref, "k2").sum(), logp)
    for base in ("k1", "kl", "abs", "k3", "low_var_kl"):
        plus = estimate(logp, ref, base + "+")
        (grad,) = torch.autograd.grad(plus.sum(), logp)
        torch.testing.assert_close(plus, estimate(logp, ref, base), rtol=0, atol=0)
        torch.testing.assert_close(grad, k2_grad, rtol=0, atol=0)
    k3 = estimate(logp, ref, "k3")
    assert (k3 >= 0).all() and (k3 <= 10).all()
    assert (estimate(logp, ref, "k3", clamp=False) >= -1e-12).all()
