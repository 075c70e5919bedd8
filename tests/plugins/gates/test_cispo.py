"""cispo through the public API: a worked example's detached coefficients, verl's and TRL's forms, parameter checks."""

import math

import pytest
import torch

import lossplug
from lossplug.testing.batches import loss_and_grad

SHIFT = -1.0  # the example's update ratios [.5, 1, 2] as log-probs ≤ 0


def run(gate: dict, *, reduction="sequence_sum", mask=None, **fields):
    return loss_and_grad({"gates": [gate], "reduction": {"name": reduction}}, action_mask=mask, **fields)


def test_worked_example_coefficients():
    update = torch.tensor([[0.5, 1.0, 2.0]])
    logp = update.log() + SHIFT
    result, grad = run(
        {"name": "cispo", "eps_low": 0.2, "eps_high": 0.2},
        logp=logp,
        old_logp=torch.full((1, 3), SHIFT),
        advantage=torch.ones(1),
    )
    # objective = sg(coefficient)·A·logp, one response under sequence_sum: ∂loss/∂logp = −coefficient
    coefficient = -grad
    torch.testing.assert_close(coefficient, torch.tensor([[0.8, 1.0, 1.2]]))
    torch.testing.assert_close(result.loss, -(torch.tensor([0.8, 1.0, 1.2]) * logp[0]).sum())
    m = result.metrics
    assert m["cispo/clip_frac"] == pytest.approx(2 / 3) and m["cispo/clip_frac_low"] == pytest.approx(1 / 3)
    # no token is dropped: the clip saturates the weight, it never zeroes a gradient
    assert m["cispo/active_token_frac"] == 1.0


def test_coefficient_carries_no_gradient():
    # the gradient is coefficient·A whatever logp is: the second derivative vanishes (the coefficient is detached)
    plugin = lossplug.registry().plugins["gate"]["cispo"]
    params = plugin.params()
    logp = torch.tensor([[-1.7, -1.0, -0.3]], requires_grad=True)
    old = torch.full((1, 3), -1.0, requires_grad=True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    batch = lossplug.PolicyBatch.unchecked(logp=logp, action_mask=mask, old_logp=old, advantage=torch.ones(1, 3))
    inp = lossplug.GateInput.from_batch(batch)
    out = plugin(inp, params)
    (g,) = torch.autograd.grad(out.objective.sum(), logp, create_graph=True)
    assert not g.requires_grad
    torch.testing.assert_close(g, torch.tensor([[0.8, 1.0, 1.2]]))
    assert torch.autograd.grad(out.objective.sum(), old, allow_unused=True)[0] is None


def trl_cispo_loss(logp, old_logp, advantage, mask, epsilon_high):
    """TRL 1.x GRPOTrainer._compute_loss for loss_type='cispo' (one process, no accumulation)."""
    coef_1 = torch.exp(logp - old_logp)
    clamped = torch.clamp(coef_1, max=epsilon_high).detach()
    per_token_loss = -clamped * advantage.unsqueeze(-1) * logp
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def test_reproduces_trl_cispo():
    torch.manual_seed(3)
    old = -torch.rand(4, 6, dtype=torch.float64) * 3 - 0.1
    new = (old + torch.randn(4, 6, dtype=torch.float64)).clamp(max=0)
    mask = torch.rand(4, 6) > 0.3
    mask[:, 0] = True
    adv = torch.randn(4, dtype=torch.float64)
    gate = {"name": "cispo", "eps_low": None, "ratio_max": 5.0, "log_ratio_clamp": None}
    result, grad = run(gate, logp=new, old_logp=old, advantage=adv, mask=mask, reduction="token")
    ref_logp = new.clone().requires_grad_()
    expected = trl_cispo_loss(ref_logp, old, adv, mask.double(), 5.0)
    expected.backward()
    torch.testing.assert_close(result.loss, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, ref_logp.grad, rtol=0, atol=1e-12)
    assert lossplug.Recipe.preset("cispo").gates[0].params["ratio_max"] == 5.0


def test_trl_form_has_no_lower_bound_and_stays_finite_without_clamp():
    old = torch.tensor([[-0.5, -100.5, -0.5]])
    new = torch.tensor([[-100.5, -0.5, -0.6]])  # log-ratios −100, +100, −.1
    result, grad = run(
        {"name": "cispo", "eps_low": None, "ratio_max": 5.0, "log_ratio_clamp": None},
        logp=new,
        old_logp=old,
        advantage=torch.ones(1),
    )
    assert torch.isfinite(result.loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(-grad, torch.tensor([[0.0, 5.0, math.exp(-0.1)]]))


def test_parameters():
    def load(**p):
        return lossplug.Recipe.load({"gates": [{"name": "cispo", **p}], "reduction": "token"})

    with pytest.raises(lossplug.RecipeError, match="not both"):
        load(eps_high=0.2, ratio_max=5.0)
    with pytest.raises(lossplug.RecipeError, match="upper bound"):
        load(eps_high=None)
    rec = load(ratio_max=4.0)  # eps_high left at its default: ratio_max replaces it
    assert rec.gates[0].params["eps_high"] is None
    assert lossplug.Recipe.from_json(rec.to_json()).to_dict() == rec.to_dict()
    assert "2506.13585" in lossplug.registry().presets["cispo"].source
