"""dis through the public API: a worked double-sided keep/drop example."""

import math

import pytest
import torch

import lossplug

SHIFT = -1.0  # the example's log-probs (behaviour = 0) shifted onto the contract's ≤ 0 side


def test_double_sided_gate_worked_example():
    ratio = torch.tensor([0.7, 0.81, 1.0, 1.27, 1.4])
    logp = (ratio.log() + SHIFT).reshape(1, 5).requires_grad_()
    behavior = torch.full((1, 5), SHIFT)
    batch = lossplug.PolicyBatch(
        logp=logp, behavior_logp=behavior, advantage=torch.ones(1), action_mask=torch.ones(1, 5, dtype=torch.bool)
    )
    # one response under sequence_sum: loss = −Σ_t coefficient_t·logp_t, the example's loss
    result = lossplug.policy_loss(
        batch, {"gates": [{"name": "dis", "low": 0.2, "high": 0.28}], "reduction": "sequence_sum"}, metrics="full"
    )
    result.loss.backward()
    observed = (logp.detach() - behavior).exp()
    keep = (observed > 0.8) & (observed < 1.28)
    assert keep.tolist() == [[False, True, True, True, False]]
    coefficient = torch.where(keep, observed, 0)
    torch.testing.assert_close(logp.grad, -coefficient)
    torch.testing.assert_close(result.loss, -(coefficient * logp.detach()).sum())
    m = result.metrics
    assert m["dis/active_token_frac"] == pytest.approx(0.6)
    assert m["dis/drop_frac_low"] == pytest.approx(0.2) and m["dis/drop_frac_high"] == pytest.approx(0.2)


def test_drop_is_independent_of_the_advantage_sign():
    # PPO keeps the raw branch of r = 1.4 when A < 0; DIS drops it whatever the sign
    logp = torch.log(torch.tensor([[1.4, 1.4]])).sub(1).requires_grad_()
    batch = lossplug.PolicyBatch(
        logp=logp,
        behavior_logp=torch.full((1, 2), -1.0),
        advantage=torch.tensor([[1.0, -1.0]]),
        action_mask=torch.ones(1, 2, dtype=torch.bool),
    )
    lossplug.policy_loss(batch, {"gates": ["dis"], "reduction": "token"}).loss.backward()
    torch.testing.assert_close(logp.grad, torch.zeros(1, 2))


def test_needs_behavior_logp():
    batch = lossplug.PolicyBatch(
        logp=torch.full((1, 2), -1.0),
        old_logp=torch.full((1, 2), -1.0),
        advantage=torch.ones(1),
        action_mask=torch.ones(1, 2, dtype=torch.bool),
    )
    with pytest.raises(lossplug.BatchValidationError, match="behavior_logp"):
        lossplug.policy_loss(batch, {"gates": ["dis"], "reduction": "token"})


def test_coefficient_is_detached():
    plugin = lossplug.registry().plugins["gate"]["dis"]
    logp = torch.tensor([[-1.0, -0.9, -3.0]], requires_grad=True)
    behavior = torch.full((1, 3), -1.0, requires_grad=True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    inp = lossplug.GateInput.from_batch(
        lossplug.PolicyBatch.unchecked(logp=logp, action_mask=mask, advantage=torch.ones(1, 3), behavior_logp=behavior)
    )
    out = plugin(inp, plugin.params())
    (g,) = torch.autograd.grad(out.objective.sum(), logp, create_graph=True)
    assert not g.requires_grad  # the coefficient is a constant: the gradient does not depend on logp
    assert torch.autograd.grad(out.objective.sum(), behavior, allow_unused=True)[0] is None
    torch.testing.assert_close(g, torch.tensor([[1.0, math.exp(0.1), 0.0]]))
