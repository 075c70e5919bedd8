"""The performance shortcuts give exactly what the plain paths give.

* ``masked_quantiles`` on the CPU (numpy's O(n) selection over the action values) equals torch's
  ``nanquantile`` over the NaN-filled tensor (the accelerator path);
* ``policy_loss`` reuses the cleaned ``logp`` for a field that is a view of the same memory (TRL's on-policy
  ``old_logp = logp.detach()``): same loss, gradient and metrics as with a copy, garbage off the mask included.
"""

from __future__ import annotations

import pytest
import torch

import lossplug
from lossplug.ops import masked_quantiles

QS = (0.0, 0.05, 0.5, 0.95, 1.0)


def reference_quantiles(x, mask, qs):
    flat = torch.where(mask, x.detach().float(), float("nan")).reshape(-1)
    return torch.nanquantile(flat, torch.tensor(qs, dtype=flat.dtype))


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (64, 257)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cpu_quantiles_equal_nanquantile(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen).to(dtype)
    mask = torch.rand(*shape, generator=gen) < 0.6
    mask.view(-1)[0] = True
    x = x.masked_fill(~mask, float("nan"))  # garbage off the mask is never read
    got = masked_quantiles(x, mask, QS)
    assert got.dtype == torch.float32 and got.shape == (len(QS),)
    torch.testing.assert_close(got, reference_quantiles(x, mask, QS), rtol=1e-6, atol=1e-6)


def test_cpu_quantiles_ignore_nan_on_the_mask_and_handle_empty():
    x = torch.tensor([[1.0, float("nan"), 3.0, 100.0]])
    mask = torch.tensor([[True, True, True, False]])
    torch.testing.assert_close(masked_quantiles(x, mask, (0.0, 0.5, 1.0)), torch.tensor([1.0, 2.0, 3.0]))
    assert masked_quantiles(x, torch.zeros_like(mask), (0.5,)).isnan().all()
    assert masked_quantiles(torch.full((2, 2), float("nan")), torch.ones(2, 2, dtype=torch.bool), (0.5,)).isnan().all()


def _batch(logp, mask, old, adv, behavior=None):
    return lossplug.PolicyBatch.unchecked(logp=logp, action_mask=mask, old_logp=old, advantage=adv,
                                          behavior_logp=behavior)


@pytest.mark.parametrize("recipe", ["dapo", "grpo", "gspo", "sapo", "cispo",
                                    {"preset": "dapo", "gates": ["ppo_clip", "tis"]}])
def test_aliased_old_logp_reuses_the_cleaned_logp(recipe):
    gen = torch.Generator().manual_seed(0)
    B, T = 5, 11
    mask = torch.rand(B, T, generator=gen) < 0.7
    mask[:, 0] = True
    raw = (-torch.rand(B, T, generator=gen) * 3).masked_fill(~mask, float("nan"))  # NaN off the mask
    adv = torch.randn(B, generator=gen)

    def run(alias: bool):
        logp = raw.clone().requires_grad_(True)
        old = logp.detach() if alias else logp.detach().clone()
        behavior = old if alias else old.clone()  # a second alias of the same memory
        res = lossplug.policy_loss(_batch(logp, mask, old, adv, behavior), recipe, validate="off")
        res.loss.backward()
        return res, logp.grad

    (fast, g_fast), (plain, g_plain) = run(True), run(False)
    assert torch.equal(fast.loss, plain.loss) and torch.isfinite(fast.loss)
    assert torch.equal(g_fast, g_plain)
    assert (g_fast[~mask] == 0).all() and torch.isfinite(g_fast).all()
    assert fast.metric_tensors.keys() == plain.metric_tensors.keys()
    for key, value in fast.metric_tensors.items():
        torch.testing.assert_close(value, plain.metric_tensors[key], rtol=0, atol=0, equal_nan=True, msg=key)


def test_aliased_old_logp_gets_no_gradient():
    # old_logp passed as logp itself (not detached): it is still a constant of the update
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    res = lossplug.policy_loss(_batch(logp, mask, logp, torch.tensor([1.0])), "grpo", validate="off")
    res.loss.backward()
    # ratio = 1 at the current point: d/dlogp of -(r·A) averaged = -A / |y| per token
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -0.5]]))


UPDATE_GATES = [{"name": "ppo_clip", "dual_clip_c": 3.0}, "ppo_clip", "gspo", "gspo_token", "sapo", "cispo",
                {"name": "cispo", "eps_low": None, "ratio_max": 5.0, "log_ratio_clamp": None}, "dis", "reinforce"]
CORRECTIONS = [[], ["tis"], ["tis_seq"], ["icepop"], [{"name": "icepop_seq", "ratio": "geometric"}]]


@pytest.mark.parametrize("update", UPDATE_GATES, ids=str)
@pytest.mark.parametrize("corrections", CORRECTIONS, ids=str)
def test_metrics_off_gives_the_same_loss_and_gradient(update, corrections):
    """With metrics=False the gates skip their diagnostics (GateInput.metrics): nothing else may change."""
    gen = torch.Generator().manual_seed(1)
    B, T = 6, 13
    mask = torch.rand(B, T, generator=gen) < 0.7
    mask[:, 0] = True
    old = -torch.rand(B, T, generator=gen) * 3
    raw = (old + 0.3 * torch.randn(B, T, generator=gen)).clamp(max=0).masked_fill(~mask, float("nan"))
    behavior = (old + 0.3 * torch.randn(B, T, generator=gen)).clamp(max=0)
    adv = torch.randn(B, T, generator=gen)
    recipe = {"gates": [update, *corrections], "reduction": "token"}

    def run(metrics: bool):
        logp = raw.clone().requires_grad_(True)
        res = lossplug.policy_loss(_batch(logp, mask, old, adv, behavior), recipe, metrics=metrics)
        res.loss.backward()
        return res, logp.grad

    (on, g_on), (off, g_off) = run(True), run(False)
    assert off.metric_tensors == {} and on.metric_tensors
    assert torch.equal(on.loss, off.loss) and torch.isfinite(on.loss)
    assert torch.equal(g_on, g_off) and (g_off[~mask] == 0).all()
