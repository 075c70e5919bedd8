"""``kl`` with ``gradient: unbiased`` against OpenRLHF 0.11.2's own ``compute_approx_kl(..., unbiased_gradient=True)``
(``openrlhf/models/utils.py``, read from its wheel), reduced as ``ppo_actor.py`` reduces it (``aggregate_loss``,
token level: ``Σ kl·mask / Σ mask``) and scaled by the coefficient: loss and gradient, float64, ≤ 1e-12.

Why an oracle called on plain float64 tensors was ~1e-7 off: ``compute_approx_kl`` starts with
``log_probs.float() − log_probs_base.float()`` (and the weight with ``log_probs.float() − log_probs_old.float()``) —
``Tensor.float()`` is float32, so OpenRLHF's function answers in float32 whatever it is given
(:func:`test_openrlhf_answers_in_float32_on_plain_float64_tensors`). Run through ``KeepsFloat64`` (a float64 tensor
whose ``.float()`` keeps float64; ``tests/plugins/_openrlhf.py``) the same code agrees to rounding. The one
remaining operation-order difference: OpenRLHF returns ``(value + s) − s`` where lossplug returns ``value + (s − s)``
(``s`` the gradient surrogate), i.e. the estimator's value exactly; the two differ by at most one rounding of
``value + s``.
"""

from __future__ import annotations

import pytest
import torch

import lossplug
from lossplug import BatchValidationError, PolicyBatch, RecipeError
from lossplug.needs import recipe_needs
from lossplug.testing import assert_conforms

from .._openrlhf import f64, openrlhf_model_utils, plain

F64 = torch.float64
ATOL = 1e-12


@pytest.fixture(scope="module")
def utils(origins):
    return openrlhf_model_utils(origins)


def tensors(seed=0, B=5, T=7, drift=1.0):
    """Log-probs with reference log-ratios up to ±25 (the ±10 clamps bite) and update ratios π_θ/π_old past the cap
    of 10 (``drift`` spreads them)."""
    g = torch.Generator().manual_seed(seed)
    logp = -(0.05 + 3.0 * torch.rand(B, T, generator=g, dtype=F64))
    ref = (logp + torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    old = (logp - drift * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    logp[0, :4] = torch.tensor([-25.5, -0.5, -15.2, -0.01], dtype=F64)
    ref[0, :4] = torch.tensor([-0.5, -25.5, -0.2, -12.0], dtype=F64)
    old[0, :4] = torch.tensor([-29.0, -0.2, -10.0, -3.5], dtype=F64)  # ratios e^3.5 ≈ 33, e^-0.3, e^-5.2, e^3.49
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    mask[0, :4] = True
    return logp, ref, old, mask


def ours(logp, ref, old, mask, coef=0.3, **params):
    """The regularizer alone (advantage 0: ppo_clip contributes exactly 0 and no gradient), token mean."""
    recipe = {
        "gates": ["ppo_clip"],
        "reduction": "token",
        "regularizers": [{"name": "kl", "coef": coef, **params}],
    }
    leaf = logp.clone().requires_grad_()
    batch = PolicyBatch(
        logp=leaf, action_mask=mask, advantage=torch.zeros(logp.shape[0], dtype=F64), ref_logp=ref, old_logp=old
    )
    result = lossplug.policy_loss(batch, recipe)
    (grad,) = torch.autograd.grad(result.loss, leaf)
    return result.loss.detach(), grad


def theirs(utils, logp, ref, old, mask, estimator, coef=0.3, *, keep_float64=True):
    """OpenRLHF's ``ppo_actor`` KL loss: ``aggregate_loss(compute_approx_kl(...), mask) · kl_ctl`` (token level)."""
    wrap = f64 if keep_float64 else (lambda x: x)
    leaf = logp.clone().requires_grad_()
    kl = utils.compute_approx_kl(
        wrap(leaf),
        wrap(ref),
        log_probs_old=None if old is None else wrap(old),
        kl_estimator=estimator,
        unbiased_gradient=True,
    )
    loss = utils.masked_mean(kl, wrap(mask), dim=None) * coef
    (grad,) = torch.autograd.grad(loss, leaf)
    return plain(loss.detach()), grad


def assert_equal(a, b):
    (loss_a, grad_a), (loss_b, grad_b) = a, b
    assert abs(float(loss_a) - float(loss_b)) <= ATOL, (float(loss_a), float(loss_b))
    assert float((grad_a - grad_b).abs().max()) <= ATOL


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unbiased_gradient_is_openrlhfs_compute_approx_kl(utils, estimator, seed):
    logp, ref, old, mask = tensors(seed)
    assert_equal(
        ours(logp, ref, old, mask, estimator=estimator, gradient="unbiased"),
        theirs(utils, logp, ref, old, mask, estimator),
    )


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_the_weight_cap_is_openrlhfs_kl_is_weight_clip(utils, monkeypatch, estimator):
    """OpenRLHF's cap is the module constant ``KL_IS_WEIGHT_CLIP`` (10): patched to 2.5, it is ``gradient_weight_cap``."""
    assert utils.KL_IS_WEIGHT_CLIP == 10.0
    logp, ref, old, mask = tensors(3, drift=2.0)
    monkeypatch.setattr(utils, "KL_IS_WEIGHT_CLIP", 2.5)
    expected = theirs(utils, logp, ref, old, mask, estimator)
    assert_equal(
        ours(logp, ref, old, mask, estimator=estimator, gradient="unbiased", gradient_weight_cap=2.5), expected
    )
    default = ours(logp, ref, old, mask, estimator=estimator, gradient="unbiased")
    assert float((default[1] - expected[1]).abs().max()) > 1e-3  # the cap bites on this batch


def test_every_estimator_shares_the_gradient_and_keeps_its_value(utils):
    logp, ref, old, mask = tensors(4)
    runs = {e: ours(logp, ref, old, mask, estimator=e, gradient="unbiased") for e in ("k1", "k2", "k3")}
    assert torch.equal(runs["k1"][1], runs["k2"][1]) and torch.equal(runs["k1"][1], runs["k3"][1])
    w = (logp - old).exp().clamp(max=10.0)
    by_hand = 0.3 * torch.where(mask, w * (logp - ref), 0.0) / mask.sum()  # ∂/∂logp of coef · mean(w·½(logp − ref)²)
    assert float((runs["k1"][1] - by_hand).abs().max()) <= ATOL
    for e in ("k1", "k2", "k3"):
        value = torch.where(mask, lossplug.plugins.regularizers.kl.estimate(logp, ref, e).clamp(-10, 10), 0.0)
        assert abs(float(runs[e][0]) - 0.3 * float(value.sum() / mask.sum())) <= ATOL


def test_k3_plus_is_the_on_policy_case_w_equal_1(utils):
    """At ``old_logp = logp`` the weight is exactly 1: ``gradient: unbiased`` on k3 is ``k3+``, and OpenRLHF's
    ``log_probs_old=None`` (w = 1.0)."""
    logp, ref, _, mask = tensors(5)
    on_policy = ours(logp, ref, logp, mask, estimator="k3", gradient="unbiased")
    assert_equal(on_policy, ours(logp, ref, logp, mask, estimator="k3+"))
    assert_equal(on_policy, theirs(utils, logp, ref, None, mask, "k3"))


def test_openrlhf_answers_in_float32_on_plain_float64_tensors(utils):
    """The 1e-7 of an oracle run on plain float64 tensors: ``.float()`` makes OpenRLHF's KL float32."""
    logp, ref, old, mask = tensors(0)
    leaf = logp.clone().requires_grad_()
    kl = utils.compute_approx_kl(leaf, ref, log_probs_old=old, kl_estimator="k3", unbiased_gradient=True)
    assert kl.dtype == torch.float32
    exact, rounded = (
        theirs(utils, logp, ref, old, mask, "k3"),
        theirs(utils, logp, ref, old, mask, "k3", keep_float64=False),
    )
    gap = abs(float(exact[0]) - float(rounded[0]))
    assert 0 < gap <= 1e-6 and float((exact[1] - rounded[1]).abs().max()) <= 1e-6


def test_unbiased_gradient_reads_old_logp():
    recipe = {
        "gates": ["reinforce"],  # reads no old_logp itself
        "reduction": "token",
        "regularizers": [{"name": "kl", "estimator": "k3", "gradient": "unbiased"}],
    }
    needs = recipe_needs(recipe)
    assert needs["ref_logp"] == needs["old_logp"] == ("regularizers[0] 'kl'",)
    logp, ref, _, mask = tensors(0)
    batch = PolicyBatch(logp=logp, action_mask=mask, advantage=torch.zeros(5, dtype=F64), ref_logp=ref)
    with pytest.raises(BatchValidationError, match="old_logp"):
        lossplug.policy_loss(batch, recipe)


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"estimator": "k3+", "gradient": "unbiased"}, "does not combine with estimator 'k3\\+'"),
        ({"estimator": "k3", "gradient": "unbiased", "ratio_weight": "token"}, "ratio_weight 'token'"),
        ({"estimator": "k3", "gradient": "unbiased", "gradient_weight_cap": 0.0}, "gradient_weight_cap"),
        ({"estimator": "k3", "gradient": "unbiased", "gradient_weight_cap": float("nan")}, "gradient_weight_cap"),
        ({"estimator": "k3", "gradient": "unbiased", "gradient_weight_cap": float("inf")}, "gradient_weight_cap"),
        ({"estimator": "k3", "gradient": "pathwise"}, "gradient"),
    ],
)
def test_bad_options_are_refused_by_name(params, words):
    with pytest.raises(RecipeError, match=words):
        lossplug.Recipe.model_validate(
            {"gates": ["ppo_clip"], "reduction": "token", "regularizers": [{"name": "kl", **params}]}
        )


@pytest.mark.parametrize(
    "params",
    [
        {"estimator": "k3", "gradient": "unbiased"},
        {"estimator": "k1", "gradient": "unbiased", "gradient_weight_cap": 2.5},
        {"estimator": "k3", "clamp": False, "gradient": "unbiased", "anchor": "behavior_logp"},
    ],
)
def test_the_conformance_kit_passes_with_the_unbiased_gradient(params):
    assert_conforms("kl", kind="regularizer", params=params)
