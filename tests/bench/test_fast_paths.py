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
    return lossplug.PolicyBatch.unchecked(
        logp=logp, action_mask=mask, old_logp=old, advantage=adv, behavior_logp=behavior
    )


@pytest.mark.parametrize(
    "recipe", ["dapo", "grpo", "gspo", "sapo", "cispo", {"preset": "dapo", "gates": ["ppo_clip", "tis"]}]
)
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


UPDATE_GATES = [
    {"name": "ppo_clip", "dual_clip_c": 3.0},
    "ppo_clip",
    "gspo",
    "gspo_token",
    "sapo",
    "cispo",
    {"name": "cispo", "eps_low": None, "ratio_max": 5.0, "log_ratio_clamp": None},
    "dis",
    "reinforce",
]
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fragmented", [False, True])
def test_zero_off_is_torch_where_bit_for_bit_with_gradients(dtype, fragmented, monkeypatch):
    from lossplug import ops
    from lossplug.ops import zero_off

    monkeypatch.setattr(ops, "ZERO_OFF_MIN", 0)  # the bitwise path at a test size
    gen = torch.Generator().manual_seed(3)
    B, T = 6, 33
    if fragmented:
        mask = torch.rand(B, T, generator=gen) < 0.6
    else:
        mask = torch.arange(T) < torch.randint(1, T + 1, (B, 1), generator=gen)
    x = torch.randn(B, T, generator=gen).to(dtype)
    x[~mask] = (
        torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]).to(dtype).repeat(B * T)[: int((~mask).sum())]
    )
    x[mask & (torch.rand(B, T, generator=gen) < 0.1)] = -0.0  # signed zeros on the mask survive
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = zero_off(a, mask), torch.where(mask, b, 0)
    assert ya.dtype == yb.dtype and torch.equal(ya.view(-1).view(torch.uint8), yb.view(-1).view(torch.uint8))
    g = torch.randn(B, T, generator=gen).to(dtype).masked_fill(~mask, float("nan"))
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(a.grad, b.grad) and (a.grad[~mask] == 0).all()
    # double backward, as torch.where supports it
    c, d = x.masked_fill(~mask, 1.0).requires_grad_(), x.masked_fill(~mask, 1.0).requires_grad_()
    (gc,) = torch.autograd.grad((zero_off(c, mask) ** 3).sum(), c, create_graph=True)
    (gd,) = torch.autograd.grad((torch.where(mask, d, 0) ** 3).sum(), d, create_graph=True)
    gc.sum().backward()
    gd.sum().backward()
    assert torch.equal(c.grad, d.grad)


def test_zero_off_on_views_and_fallbacks(monkeypatch):
    from lossplug import ops
    from lossplug.ops import action_bits, zero_off

    monkeypatch.setattr(ops, "ZERO_OFF_MIN", 0)

    mask = torch.tensor([[True, False, True], [False, True, True]])
    adv = torch.tensor([2.0, -3.0])
    expanded = adv[:, None].expand(2, 3)  # stride 0, as the pipeline passes a [B] advantage
    assert torch.equal(zero_off(expanded, mask), torch.where(mask, expanded, 0))
    assert torch.equal(zero_off(expanded, mask, action_bits(mask, torch.float32)), torch.where(mask, expanded, 0))
    column = adv[:, None]  # broadcasting shape: torch.where itself
    assert torch.equal(zero_off(column, mask), torch.where(mask, column, 0))
    ints = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert torch.equal(zero_off(ints, mask), torch.where(mask, ints, 0))
    x = torch.randn(2, 3, dtype=torch.float64)
    assert torch.equal(zero_off(x, mask, action_bits(mask, torch.float32)), torch.where(mask, x, 0))  # wrong width


@pytest.mark.parametrize("n", [8193, 20_000, 262_144])
@pytest.mark.parametrize("kind", ["lognormal", "ties", "two_values", "spike", "tails", "inf"])
def test_selection_quantiles_equal_torch_quantile_bit_for_bit(n, kind):
    from lossplug.ops import _select_quantiles

    gen = torch.Generator().manual_seed(n)
    v = {
        "lognormal": lambda: (0.1 * torch.randn(n, generator=gen)).exp(),
        "ties": lambda: torch.randint(0, 7, (n,), generator=gen).float() / 3,
        "two_values": lambda: torch.where(torch.rand(n, generator=gen) < 0.97, 1.0, 2.0),
        "spike": lambda: torch.cat((torch.ones(n - 3), torch.tensor([1e30, -1e30, 5.0]))),
        "tails": lambda: torch.randn(n, generator=gen) ** 5,
        "inf": lambda: torch.cat((torch.randn(n - 2, generator=gen), torch.tensor([float("inf"), -float("inf")]))),
    }[kind]()
    qs = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 0.999, 1.0)
    low, high = torch.aminmax(v)
    got = _select_quantiles(v, qs, float(low), float(high))
    want = torch.quantile(v, torch.tensor(qs))
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # bit for bit (lerp of ±inf: NaN)


@pytest.mark.parametrize("case", ["inside", "below", "above", "on_bounds", "nan"])
@pytest.mark.parametrize("size", [(3, 5), (8, 2100)])
def test_clamp_exact_is_clamp_in_value_and_gradient(case, size):
    from lossplug.ops import clamp_exact

    gen = torch.Generator().manual_seed(size[1])
    x = torch.randn(*size, generator=gen, dtype=torch.float64) * 3
    if case == "below":
        x[0, 1] = -25.0
    elif case == "above":
        x[-1, -1] = 31.0
    elif case == "on_bounds":  # inclusive bounds: the gradient passes there, in clamp and in the shortcut
        x[0, 0], x[-1, 0] = -20.0, 20.0
    elif case == "nan":
        x[1, 2] = float("nan")
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = clamp_exact(a, -20.0, 20.0), b.clamp(-20.0, 20.0)
    torch.testing.assert_close(ya, yb, rtol=0, atol=0, equal_nan=True)
    weights = torch.randn(*size, generator=gen, dtype=torch.float64)
    (ya * weights).nansum().backward()
    (yb * weights).nansum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, equal_nan=True)
    if case in ("inside", "on_bounds") and size[1] > 1000:
        assert ya is a  # nothing to clamp: no clamp node, no three-pass backward


@pytest.mark.parametrize("metrics", ["basic", "full"])
@pytest.mark.parametrize(
    "recipe",
    [
        "dapo",
        "gspo",
        "sapo",
        {"preset": "cispo", "gates": ["cispo", "tis"]},
        {"preset": "dapo", "gates": [{"name": "ppo_clip", "dual_clip_c": 3.0}, "icepop"]},
        {"preset": "dapo", "gates": ["dis"]},
    ],
    ids=str,
)
def test_pipeline_with_and_without_the_bitwise_masking_agree(recipe, metrics, monkeypatch):
    from lossplug import ops

    gen = torch.Generator().manual_seed(5)
    B, T = 8, 2100  # above ZERO_OFF_MIN: the bitwise path is the default here
    mask = torch.rand(B, T, generator=gen) < 0.8
    mask[:, 0] = True
    old = (-torch.rand(B, T, generator=gen) * 3).masked_fill(~mask, float("nan"))
    raw = (old + 0.2 * torch.randn(B, T, generator=gen)).clamp(max=0).masked_fill(~mask, float("inf"))
    behavior = (old + 0.2 * torch.randn(B, T, generator=gen)).masked_fill(~mask, -float("inf"))
    raw[0, :5] = old[0, :5] + 30  # log-ratios the safety clamps cut (the shortcut must not skip them)
    raw[1, :5] = old[1, :5] - 30
    adv = torch.randn(B, generator=gen)

    def run(minimum):
        monkeypatch.setattr(ops, "ZERO_OFF_MIN", minimum)
        logp = raw.clone().requires_grad_(True)
        res = lossplug.policy_loss(_batch(logp, mask, old, adv, behavior), recipe, validate="off", metrics=metrics)
        res.loss.backward()
        return res, logp.grad

    (bits, g_bits), (where, g_where) = run(0), run(1 << 62)
    assert torch.equal(bits.loss, where.loss) and torch.isfinite(bits.loss)
    assert torch.equal(g_bits, g_where) and (g_bits[~mask] == 0).all()
    for key, value in bits.metric_tensors.items():
        torch.testing.assert_close(value, where.metric_tensors[key], rtol=0, atol=0, equal_nan=True, msg=key)
