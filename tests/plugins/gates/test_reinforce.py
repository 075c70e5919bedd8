"""reinforce through the public API: plain A·logp."""

import torch

import lossplug


def test_gradient_is_minus_advantage_times_reduction_weight():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]], requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([2.0, -1.0])
    batch = lossplug.PolicyBatch(logp=logp, advantage=adv, action_mask=mask)
    result = lossplug.policy_loss(batch, {"gates": ["reinforce"], "reduction": "response"}, metrics="full")
    result.loss.backward()
    torch.testing.assert_close(result.loss, torch.tensor(-(2.0 * -6.0 / 3 + -1.0 * -1.0 / 2) / 2))
    torch.testing.assert_close(logp.grad, torch.tensor([[-2 / 6] * 3, [1 / 4, 1 / 4, 0.0]]))
    assert result.metrics["reinforce/active_token_frac"] == 1.0


def test_needs_no_old_logp():
    batch = lossplug.PolicyBatch(
        logp=torch.full((1, 2), -1.0), advantage=torch.ones(1), action_mask=torch.ones(1, 2, dtype=torch.bool)
    )
    result = lossplug.policy_loss(batch, {"gates": ["reinforce"], "reduction": "token"}, metrics="full")
    torch.testing.assert_close(result.loss, torch.tensor(1.0))
    assert "ratio/update/mean" not in result.metrics
