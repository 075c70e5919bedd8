"""The checks run through policy_loss (lossplug.testing.kit.loss_checks): a gradient that is not finite at extreme
log-ratios comes with its cause and its fix."""

import torch

import lossplug
from lossplug.testing import check_plugin


@lossplug.gate("bent_unclamped", requires=("old_logp",))
def bent_unclamped(inp, p):
    """A·r, the ratio bending smoothly towards 1.3 above 1.3 — exp of an unclamped log-ratio."""
    ratio = inp.update_log_ratio().exp()
    bent = torch.where(ratio > 1.3, 1.3 + 0.1 * torch.tanh((ratio - 1.3) / 0.1), ratio)
    return lossplug.GateOutput(objective=inp.advantage * bent, active=inp.mask)


@lossplug.gate("bent_clamped", requires=("old_logp",))
def bent_clamped(inp, p):
    """A·r, the ratio bending smoothly towards 1.3 above 1.3 — exp of a log-ratio clamped to ±20."""
    ratio = inp.update_log_ratio().clamp(-20, 20).exp()
    bent = torch.where(ratio > 1.3, 1.3 + 0.1 * torch.tanh((ratio - 1.3) / 0.1), ratio)
    return lossplug.GateOutput(objective=inp.advantage * bent, active=inp.mask)


def test_a_non_finite_gradient_at_extreme_ratios_says_to_clamp_the_log_ratio_before_exp():
    report = check_plugin(bent_unclamped)
    assert [r.check for r in report.failures] == ["extreme_ratios"], str(report)
    message = report.failures[0].message
    assert "gradient is not finite" in message and "while the loss is finite" in message
    assert "Clamp the log-ratio before exp" in message and ".clamp(-20, 20).exp()" in message
    assert "torch.nan_to_num" in message  # what a reader would reach for, and why it does not mend the gradient
    assert check_plugin(bent_clamped).ok  # the fix the hint gives
