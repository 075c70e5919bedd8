"""sapo through the public API: a worked smooth-gate example (gradient = r·sech²(τ(r−1)/2)·A)."""

import pytest
import torch

import lossplug
from lossplug.testing.batches import loss_and_grad

SHIFT = -1.0  # the example's log-probs (old = 0, new up to .7) shifted onto the contract's ≤ 0 side


def run(gate: dict, *, reduction="sequence_sum", mask=None, **fields):
    return loss_and_grad({"gates": [gate], "reduction": {"name": reduction}}, action_mask=mask, **fields)


def test_smooth_gate_worked_example():
    new_logp = torch.tensor([[-0.7, 0.0, 0.7]]) + SHIFT
    old_logp = torch.zeros(1, 3) + SHIFT
    advantage = torch.tensor([[1.0, -1.0, 1.0]])
    # one response under sequence_sum: loss = −Σ_t term_t, i.e. the example's term.sum()
    result, grad = run(
        {"name": "sapo", "tau_pos": 1.0, "tau_neg": 2.0}, logp=new_logp, old_logp=old_logp, advantage=advantage
    )
    ratio = (new_logp - old_logp).exp()
    tau = torch.where(advantage > 0, 1.0, 2.0)
    term = 4 / tau * torch.sigmoid(tau * (ratio - 1)) * advantage
    torch.testing.assert_close(result.loss, -term.sum())
    gate = torch.cosh(tau * (ratio - 1) / 2).reciprocal().square()
    torch.testing.assert_close(-grad, ratio * gate * advantage)
    assert gate[0, 1] == 1
    assert gate[0, 2] < gate[0, 0]
    # the gate recovered from the gradient itself
    recovered = -grad / (ratio * advantage)
    assert recovered[0, 1] == 1
    assert recovered[0, 2] < recovered[0, 0]
    assert result.metrics["sapo/gate_min"] == pytest.approx(gate.min().item())
    assert result.metrics["sapo/active_token_frac"] == 1.0


def test_value_at_ratio_one_is_two_a_over_tau():
    # only the gradient equals the policy gradient at r = 1; the value is 2A/τ
    logp = torch.full((2, 1), -1.0)
    result, grad = run({"name": "sapo"}, logp=logp, old_logp=logp.clone(), advantage=torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(result.loss, torch.tensor(-(2 / 1.0 - 2 / 1.05) / 2))
    torch.testing.assert_close(grad.reshape(2), -torch.tensor([1.0, -1.0]) / 2)


def test_negative_advantages_are_damped_faster():
    # same distance from r = 1, larger temperature for A < 0: a smaller gradient gate
    old = torch.full((2, 1), -2.0)
    new = old + torch.tensor([[0.5], [0.5]])
    _, grad = run(
        {"name": "sapo", "tau_pos": 1.0, "tau_neg": 3.0}, logp=new, old_logp=old, advantage=torch.tensor([1.0, -1.0])
    )
    assert abs(grad[1, 0]) < abs(grad[0, 0])


def test_extreme_ratio_gate_underflows_to_inactive():
    old = torch.tensor([[-0.5, -60.5]])
    new = torch.tensor([[-60.5, -0.5]])  # log-ratios −60 and +60, clamped to ±20
    result, grad = run({"name": "sapo"}, logp=new, old_logp=old, advantage=torch.tensor([1.0]))
    assert torch.isfinite(result.loss) and torch.isfinite(grad).all()
    assert grad[0, 1] == 0  # r = e^20: the gate is exactly 0
    assert result.metrics["sapo/active_token_frac"] == 0.5


def test_defaults_match_trl_and_verl():
    rec = lossplug.Recipe.preset("sapo")
    assert rec.gates[0].params["tau_pos"] == 1.0 and rec.gates[0].params["tau_neg"] == 1.05
    assert rec.reduction.name == "response"
    assert "2511.20347" in lossplug.registry().presets["sapo"].source
    with pytest.raises(lossplug.RecipeError, match="tau_neg"):
        lossplug.Recipe.load({"gates": [{"name": "sapo", "tau_neg": 0}], "reduction": "token"})


@pytest.mark.parametrize("level", ["sapo", "sapo_seq"])
def test_without_a_clamp_is_trls_arithmetic_past_e20(level):
    # TRL clamps nothing: with log_ratio_clamp null a log-ratio of −25 reaches exp unclamped (the default clamps it
    # at −20), in float64 loss and gradient as TRL's _compute_loss computes them for loss_type="sapo"
    old = torch.tensor([[-1.0, -1.0, -2.0], [-1.5, -0.5, -3.0]], dtype=torch.float64)
    new = old + torch.tensor([[-25.0, 0.3, -0.2], [0.1, -0.4, 0.05]], dtype=torch.float64)
    adv = torch.tensor([0.7, -1.3], dtype=torch.float64)
    gate = {"name": level, "log_ratio_clamp": None}
    result, grad = run(gate, reduction="response", logp=new, old_logp=old, advantage=adv)
    logp = new.clone().requires_grad_(True)
    log_ratio = logp - old
    if level == "sapo_seq":
        log_ratio = log_ratio.mean(-1, keepdim=True)
    tau = torch.where(adv.unsqueeze(1) > 0, *torch.tensor([1.0, 1.05], dtype=torch.float64))
    per_token = -torch.sigmoid(tau * (log_ratio.exp() - 1)) * 4 / tau * adv.unsqueeze(1)
    expected = per_token.expand(2, 3).mean(-1).mean()
    expected.backward()
    torch.testing.assert_close(result.loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-12)
    if level == "sapo":  # the default clamp binds at −25: no gradient through it there
        _, clamped_grad = run({"name": level}, reduction="response", logp=new, old_logp=old, advantage=adv)
        assert clamped_grad[0, 0] == 0 and grad[0, 0] != 0


@pytest.mark.parametrize("per_token_advantage", [False, True])
def test_objective_is_zero_off_the_actions_as_it_promises(per_token_advantage):
    # sapo's objective is +0 off the actions (GateOutput.zero_off_actions: the pipeline skips its zero-off), so
    # garbage there reaches neither the loss nor logp's gradient; 64 x 300 takes the CPU's bitwise zero-off
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(64, 300, generator=g) > 0.3
    mask[:, 0] = True
    old = -torch.rand(64, 300, generator=g) * 2
    new = (old + 0.2 * torch.randn(64, 300, generator=g)).clamp(max=0)
    adv = torch.randn(64, 300 if per_token_advantage else 1, generator=g).squeeze(-1)
    inp = lossplug.GateInput.from_batch(
        lossplug.PolicyBatch.unchecked(logp=new, old_logp=old, advantage=adv, action_mask=mask)
    )
    out = lossplug.registry().lookup("gate", "sapo", "test")(inp, lossplug.plugins.gates.sapo.SAPOParams())
    assert out.zero_off_actions and out.objective[~mask].view(torch.int32).eq(0).all()  # +0, bit for bit
    poisoned = {
        "logp": torch.where(mask, new, float("nan")),
        "old_logp": torch.where(mask, old, float("inf")),
        "advantage": torch.where(mask, adv, float("nan")) if per_token_advantage else adv,
    }
    clean, clean_grad = run({"name": "sapo"}, reduction="token", mask=mask, logp=new, old_logp=old, advantage=adv)
    result, grad = run({"name": "sapo"}, reduction="token", mask=mask, **poisoned)
    assert torch.equal(result.loss, clean.loss) and torch.equal(grad, clean_grad) and grad[~mask].eq(0).all()
