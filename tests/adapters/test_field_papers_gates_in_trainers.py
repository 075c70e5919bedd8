"""This year's papers' gates inside the trainers — ``aspo`` (arXiv:2510.06062) and ``bapo`` (arXiv:2510.18927): a real
TRL ``train()`` run of two CPU steps on the tiny model each, and verl's policy-loss seam (``get_policy_loss_fn
("lossplug")``) split over 2 ranks × micro-batches against the authors' formulas over the whole step (float64, loss and
gradient). Under verl, ASPO's entropy split is refused (verl hands a policy loss no entropies) and its uniform bounds
run; BAPO picks its bounds per micro-batch, as the authors' loss does.

Only public import paths: ``lossplug.adapters.trl`` and ``lossplug.adapters.verl``.
"""

from __future__ import annotations

import pytest
import torch

from ._field_trainers import (
    MICRO,
    B,
    train_two_tiny_steps,
    verl_actor_config,
    verl_inputs,
    verl_policy_loss,
    verl_seam_over_step,
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "gate, metric",
    [
        ("aspo", "lossplug/aspo/clip_frac_high"),  # the entropy split: TRL's forward pass gives the entropies
        ({"name": "bapo", "target": 0.5}, "lossplug/bapo/clip_high"),
    ],
    ids=["aspo", "bapo"],
)
def test_trains_inside_trls_grpo_trainer(tmp_path, gate, metric):
    trainer, _ = train_two_tiny_steps({"preset": "grpo", "gates": [gate], "reduction": "token"}, tmp_path)
    logged = [entry for entry in trainer.state.log_history if metric in entry]
    assert logged, sorted({k for entry in trainer.state.log_history for k in entry if k.startswith("lossplug/")})
    if metric.endswith("clip_high"):
        assert all(1.2 <= entry[metric] <= 3.0 for entry in logged)


# -- verl --------------------------------------------------------------------------------------------------------------

UNIFORM = {"name": "aspo", "high_entropy_eps_low": None, "high_entropy_eps_high": None}


def aspo_per_token(logp, old, adv, eps=0.2, c=3.0):
    """ASPO's per-token loss (Archer2.0's ``compute_policy_loss_archer``, one pair of bounds), written per branch."""
    ratio = (logp - old).clamp(-20, 20).exp()
    negative = ratio.clamp(min=1 - eps)
    positive = ratio.clamp(max=1 + eps)
    held = positive.detach()
    negative_loss = torch.where(negative > c, -adv * c * logp, -adv * negative)
    positive_loss = torch.where(1 / positive > c, -adv * c * logp, -adv * positive / held / held)
    return torch.where(adv < 0, negative_loss, positive_loss)


def test_verls_policy_loss_seam_gives_aspo_over_the_step():
    pytest.importorskip("verl")
    x = verl_inputs(seed=3, update_noise=0.8)
    mask = x["response_mask"]
    total, grad, metrics = verl_seam_over_step({"gates": [UNIFORM], "reduction": "token"}, x)
    assert all("actor/lossplug/aspo/dual_frac_pos" in m for m in metrics), sorted(metrics[0])
    logp = torch.where(mask, x["log_prob"], -1.0).requires_grad_()
    old, adv = (torch.where(mask, x[k], -1.0) for k in ("old_log_prob", "advantages"))
    ratio = (logp - old).exp().detach()
    dual = mask & (((adv < 0) & (ratio > 3)) | ((adv > 0) & (ratio < 1 / 3)))
    flipped = mask & (adv > 0) & (ratio > 1 / 3) & (ratio < 1.2)
    assert int(dual.sum()) > 0 and int(flipped.sum()) > 0  # the soft dual clip and the flip both act
    expected = torch.where(mask, aspo_per_token(logp, old, adv), 0).sum() / mask.sum()
    expected.backward()
    torch.testing.assert_close(total, expected.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.where(mask, grad, 0), torch.where(mask, logp.grad, 0), rtol=1e-12, atol=1e-14)


def test_verl_refuses_asposs_entropy_split_and_says_why():
    pytest.importorskip("verl")
    from lossplug.contracts import LossplugError

    x = verl_inputs(seed=3)
    config = verl_actor_config({"gates": ["aspo"], "reduction": "token"}, MICRO)
    with pytest.raises(LossplugError, match="entropy") as refused:
        verl_policy_loss(config, {k: v[:MICRO] for k, v in x.items()})
    assert "run it in TRL" in str(refused.value), refused.value


def bapo_bounds(ratio, adv, mask, target, low=0.6, low_max=0.9, high=1.2, high_max=3.0, step=0.05):
    """The authors' bound search (``recipe/bapo/policy_loss.py``) on one micro-batch: a loop, one pair at a time."""

    def balance(lo, hi):
        effective = torch.where(adv >= 0, ratio.clamp(max=hi), ratio.clamp(min=lo)) * adv * mask
        pos, neg = effective.clamp(min=0).sum(), (-effective.clamp(max=0)).sum()
        return float("inf") if neg <= 0 else float(pos / (neg + 1e-8))

    rho = balance(low, high)
    while rho < target and low < low_max:
        low = min(low + step, low_max)
        rho = balance(low, high)
    while rho < target and high < high_max:
        high = min(high + step, high_max)
        rho = balance(low, high)
    return low, high


def test_verls_policy_loss_seam_gives_bapo_per_micro_batch_over_the_step():
    pytest.importorskip("verl")
    x = verl_inputs(seed=6, update_noise=0.5)  # its micro-batches stop at the start, inside the upper range, at the end
    mask = x["response_mask"]
    target = 0.8
    total, grad, metrics = verl_seam_over_step({"gates": [{"name": "bapo", "target": target}], "reduction": "token"}, x)
    logp = torch.where(mask, x["log_prob"], -1.0).requires_grad_()
    old, adv = (torch.where(mask, x[k], -1.0) for k in ("old_log_prob", "advantages"))
    per_token, chosen = [], []
    for i, start in enumerate(range(0, B, MICRO)):
        rows = slice(start, start + MICRO)
        ratio = (logp[rows] - old[rows]).clamp(-20, 20).exp()
        low, high = bapo_bounds(ratio.detach(), adv[rows], mask[rows], target)
        chosen.append((low, high))
        m = metrics[i]
        assert (m["actor/lossplug/bapo/clip_low"], m["actor/lossplug/bapo/clip_high"]) == pytest.approx((low, high))
        surrogate = torch.minimum(ratio * adv[rows], ratio.clamp(low, high) * adv[rows])
        per_token.append(-torch.where(adv[rows] < 0, torch.maximum(surrogate, 3.0 * adv[rows]), surrogate))
    assert len(set(chosen)) == 3, chosen  # the micro-batches pick different bounds
    expected = torch.where(mask, torch.cat(per_token), 0).sum() / mask.sum()
    expected.backward()
    torch.testing.assert_close(total, expected.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.where(mask, grad, 0), torch.where(mask, logp.grad, 0), rtol=1e-12, atol=1e-14)
