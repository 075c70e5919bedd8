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


def bapo_bounds(parts, target, low=0.6, low_max=0.9, high=1.2, high_max=3.0, step=0.05):
    """The authors' bound search (``recipe/bapo/policy_loss.py``), one pair at a time, over ``parts``: the
    ``(ratio, advantages, mask)`` of one micro-batch, or of each rank's concurrent micro-batch, whose positive and
    negative sums are added in float32 as their ``all_reduce`` adds them."""

    def balance(lo, hi):
        sums = []
        for ratio, adv, mask in parts:
            effective = torch.where(adv >= 0, ratio.clamp(max=hi), ratio.clamp(min=lo)) * adv * mask
            sums.append(torch.stack([effective.clamp(min=0).sum(), (-effective.clamp(max=0)).sum()]))
        pos, neg = sums[0] if len(parts) == 1 else sum(t.float() for t in sums).double()
        return float("inf") if neg <= 0 else float(pos / (neg + 1e-8))

    rho = balance(low, high)
    while rho < target and low < low_max:
        low = min(low + step, low_max)
        rho = balance(low, high)
    while rho < target and high < high_max:
        high = min(high + step, high_max)
        rho = balance(low, high)
    return low, high


def bapo_per_token(ratio, adv, low, high, c=3.0):
    """PPO's per-token loss at the chosen bounds, with verl's dual clip (the authors' ``compute_policy_loss_bapo``)."""
    surrogate = torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
    return -torch.where(adv < 0, torch.maximum(surrogate, c * adv), surrogate)


def step_tensors(x):
    """The step's current log-probs (a leaf), old log-probs and advantages, −1 off the response mask."""
    mask = x["response_mask"]
    logp = torch.where(mask, x["log_prob"], -1.0).requires_grad_()
    old, adv = (torch.where(mask, x[k], -1.0) for k in ("old_log_prob", "advantages"))
    return mask, logp, old, adv


def test_verls_policy_loss_seam_gives_bapo_per_micro_batch_over_the_step():
    pytest.importorskip("verl")
    x = verl_inputs(seed=6, update_noise=0.5)  # its micro-batches stop at the start, inside the upper range, at the end
    target = 0.8
    total, grad, metrics = verl_seam_over_step({"gates": [{"name": "bapo", "target": target}], "reduction": "token"}, x)
    mask, logp, old, adv = step_tensors(x)
    per_token, chosen = [], []
    for i, start in enumerate(range(0, B, MICRO)):
        rows = slice(start, start + MICRO)
        ratio = (logp[rows] - old[rows]).clamp(-20, 20).exp()
        low, high = bapo_bounds([(ratio.detach(), adv[rows], mask[rows])], target)
        chosen.append((low, high))
        m = metrics[i]
        assert (m["actor/lossplug/bapo/clip_low"], m["actor/lossplug/bapo/clip_high"]) == pytest.approx((low, high))
        per_token.append(bapo_per_token(ratio, adv[rows], low, high))
    assert len(set(chosen)) == 3, chosen  # the micro-batches pick different bounds
    expected = torch.where(mask, torch.cat(per_token), 0).sum() / mask.sum()
    expected.backward()
    torch.testing.assert_close(total, expected.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.where(mask, grad, 0), torch.where(mask, logp.grad, 0), rtol=1e-12, atol=1e-14)


@pytest.mark.slow
def test_two_gloo_ranks_in_verls_seam_pool_bapos_statistic(tmp_path):
    """Two processes under ``torch.distributed`` (gloo): the verl adapter pools P and N over the ranks' concurrent
    micro-batches, so both ranks clip with the bounds the authors' ``all_reduce`` gives — which differ from what
    either micro-batch alone would pick — and the step's loss and gradient are the authors' over the step."""
    pytest.importorskip("verl")
    from pathlib import Path

    from ._verl_ranks import run_ranks

    worker = Path(__file__).with_name("_bapo_dp_worker.py")
    run_ranks(worker, [2], model=Path("-"), out=tmp_path, timeout=300)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    x = verl_inputs(seed=6, update_noise=0.5)  # (the worker's SEED, NOISE and target)
    target = 0.8
    mask, logp, old, adv = step_tensors(x)
    ratio = (logp - old).clamp(-20, 20).exp()
    per_token = torch.zeros_like(logp)
    total, grad = torch.zeros((), dtype=torch.float64), torch.zeros_like(logp)
    pooled_differs = 0
    for concurrent in zip(*results):  # the i-th micro-batch of each rank: one all_reduce
        parts = [slice(mb["start"], mb["start"] + MICRO) for mb in concurrent]
        stats = [(ratio[rows].detach(), adv[rows], mask[rows]) for rows in parts]
        low, high = bapo_bounds(stats, target)
        alone = [bapo_bounds([part], target) for part in stats]
        pooled_differs += any(bounds != (low, high) for bounds in alone)
        for mb, rows in zip(concurrent, parts):
            assert mb["bounds"] == pytest.approx((low, high)), (mb["start"], mb["bounds"], (low, high))
            per_token = per_token + torch.zeros_like(per_token).index_put(
                (torch.arange(rows.start, rows.stop),), bapo_per_token(ratio[rows], adv[rows], low, high)
            )
            total = total + mb["loss"] / 2  # verl: each rank's share × dp_size, gradients averaged over the ranks
            grad[rows, : mb["width"]] = mb["grad"] / 2
    assert pooled_differs > 0  # pooling changed some micro-batch's bounds: the test sees the all_reduce
    expected = torch.where(mask, per_token, 0).sum() / mask.sum()
    expected.backward()
    torch.testing.assert_close(total, expected.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.where(mask, grad, 0), torch.where(mask, logp.grad, 0), rtol=1e-12, atol=1e-14)
