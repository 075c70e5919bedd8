"""PPO clipped value loss: TRL ≤ 0.11's formula and three gradient cases, verl equivalence, population exactness."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lossplug import LossplugError, Normalizer
from lossplug.tools.value_loss import value_clip_fraction, value_loss


def _batch(B=4, T=7, dtype=torch.float64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(B, T, generator=g, dtype=dtype) * scale
    old = torch.randn(B, T, generator=g, dtype=dtype) * scale
    returns = torch.randn(B, T, generator=g, dtype=dtype) * scale
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[:, 0] = True
    return values, old, returns, mask


def _trl_ppo_value_loss(vpreds, values, returns, mask, cliprange_value):
    """TRL ≤ 0.11's ``PPOTrainer.loss`` value-loss lines, transcribed (``trl.core``'s masked_mean / clip_by_value)."""

    def masked_mean(x, m):
        return (x * m).sum() / m.sum()

    def clip_by_value(x, lo, hi):
        return torch.max(torch.min(x, hi), lo)

    vpredclipped = clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    vf_loss = 0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), mask)
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), mask)
    return vf_loss, vf_clipfrac


# ---------------------------------------------------------------------------------------------------------------------
# TRL ≤ 0.11's PPOTrainer.loss


def test_matches_trl_ppo_formula():
    values, old, returns, mask = _batch(seed=1)
    out = value_loss(values, old, returns, mask, clip_eps=0.2)
    ref_loss, ref_clip = _trl_ppo_value_loss(values, old, returns, mask.double(), 0.2)
    torch.testing.assert_close(out.loss, ref_loss)
    torch.testing.assert_close(out.clip_frac, ref_clip.to(out.clip_frac.dtype))
    assert 0 < float(out.clip_frac) < 1  # both branches are exercised


@pytest.mark.parametrize(
    "v, expected_grad, clipped",
    [
        (0.2, 0.2 - 1.0, False),  # case 1: inside [V_old − ε, V_old + ε] = [−0.5, 0.5]: ½·2(V − R)
        (2.0, 2.0 - 1.0, False),  # case 2: outside, (V − R)² = 1 > (V_clip − R)² = 0.25: same gradient
        (1.2, 0.0, True),  # case 3: outside, (V_clip − R)² = 0.25 > (V − R)² = 0.04: zero gradient
    ],
)
def test_three_gradient_cases(v, expected_grad, clipped):
    V = torch.tensor([[v]], dtype=torch.float64, requires_grad=True)
    old, R = torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)
    out = value_loss(V, old, R, torch.ones(1, 1, dtype=torch.bool), clip_eps=0.5)
    out.loss.backward()
    assert V.grad.item() == pytest.approx(expected_grad)
    assert bool(out.clipped.item()) is clipped
    assert out.clip_frac.item() == float(clipped)
    v_clip = min(max(v, -0.5), 0.5)
    assert out.loss.item() == pytest.approx(0.5 * max((v - 1) ** 2, (v_clip - 1) ** 2))


def test_gradient_is_masked_mean_of_v_minus_r_where_not_clipped():
    values, old, returns, mask = _batch(seed=2)
    V = values.clone().requires_grad_()
    out = value_loss(V, old, returns, mask, clip_eps=0.3)
    out.loss.backward()
    expected = torch.where(mask & ~out.clipped, values - returns, 0.0) / mask.sum()
    torch.testing.assert_close(V.grad, expected)


def test_gradcheck_float64():
    values, old, returns, mask = _batch(B=3, T=5, seed=3)
    for reduction in ("token", "response"):
        V = values.clone().requires_grad_()
        assert torch.autograd.gradcheck(
            lambda v, reduction=reduction: value_loss(v, old, returns, mask, clip_eps=0.3, reduction=reduction).loss,
            (V,),
        )


def test_no_clip_is_half_mse():
    values, old, returns, mask = _batch(seed=4)
    out = value_loss(values, old, returns, mask, clip_eps=None)
    torch.testing.assert_close(out.loss, 0.5 * ((values - returns) ** 2)[mask].mean())
    assert out.clip_frac.item() == 0


def test_non_action_positions_never_reach_loss_or_gradient():
    values, old, returns, mask = _batch(seed=5)
    poisoned = [t.masked_fill(~mask, float("nan")) for t in (values, old, returns)]
    poisoned[1] = poisoned[1].masked_fill(~mask & (torch.arange(7) % 2 == 0), float("inf"))
    V = poisoned[0].clone().requires_grad_()
    out = value_loss(V, poisoned[1], poisoned[2], mask, clip_eps=0.2)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(V.grad).all()
    assert (V.grad[~mask] == 0).all()
    torch.testing.assert_close(out.loss, value_loss(values, old, returns, mask, clip_eps=0.2).loss)


@given(st.integers(0, 10_000), st.floats(0.0, 2.0))
def test_property_clipped_loss_dominates_unclipped(seed, eps):
    values, old, returns, mask = _batch(B=3, T=6, seed=seed, scale=2.0)
    out = value_loss(values, old, returns, mask, clip_eps=eps)
    plain = value_loss(values, old, returns, mask, clip_eps=None)
    assert out.loss >= plain.loss - 1e-12
    assert 0.0 <= out.clip_frac.item() <= 1.0
    assert not (out.clipped & ~mask).any()
    assert out.clip_frac.item() == pytest.approx(value_clip_fraction(values, old, returns, mask, clip_eps=eps).item())


# ---------------------------------------------------------------------------------------------------------------------
# population: exact across micro-batches


@pytest.mark.parametrize("reduction", ["token", "response"])
def test_micro_batch_shares_add_up_to_full_batch(reduction):
    values, old, returns, mask = _batch(B=6, T=9, seed=6)
    full_V = values.clone().requires_grad_()
    full = value_loss(full_V, old, returns, mask, clip_eps=0.25, reduction=reduction)
    full.loss.backward()

    parts = [slice(0, 1), slice(1, 4), slice(4, 6)]
    norm = Normalizer.for_masks([mask[p] for p in parts])
    V = values.clone().requires_grad_()
    total = sum(
        value_loss(V[p], old[p], returns[p], mask[p], clip_eps=0.25, reduction=reduction, normalizer=norm).loss
        for p in parts
    )
    total.backward()
    torch.testing.assert_close(total, full.loss)
    torch.testing.assert_close(V.grad, full_V.grad)

    if reduction == "token":
        by_count = sum(
            value_loss(values[p], old[p], returns[p], mask[p], clip_eps=0.25, action_tokens=int(mask.sum())).loss
            for p in parts
        )
        torch.testing.assert_close(by_count, full.loss)


# ---------------------------------------------------------------------------------------------------------------------
# verl 0.9.1


@pytest.fixture(scope="module")
def verl_algos():
    return pytest.importorskip("verl.trainer.ppo.core_algos")


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("eps", [0.1, 0.5])
def test_matches_verl_token_mean(verl_algos, seed, eps):
    values, old, returns, mask = _batch(B=5, T=11, seed=100 + seed, scale=1.5)
    ours_V = values.clone().requires_grad_()
    ours = value_loss(ours_V, old, returns, mask, clip_eps=eps)
    ours.loss.backward()
    verl_V = values.clone().requires_grad_()
    vf_loss, vf_clipfrac = verl_algos.compute_value_loss(
        vpreds=verl_V, returns=returns, values=old, response_mask=mask, cliprange_value=eps, loss_agg_mode="token-mean"
    )
    vf_loss.backward()
    torch.testing.assert_close(ours.loss, vf_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours_V.grad, verl_V.grad, atol=1e-6, rtol=1e-6)
    assert ours.clip_frac.item() == pytest.approx(vf_clipfrac.item(), abs=1e-6)


def test_matches_verl_global_batch_and_seq_mean(verl_algos):
    values, old, returns, mask = _batch(B=6, T=8, seed=7, scale=1.5)
    micro = slice(0, 2)
    N, S, D = int(mask.sum()), mask.shape[0], 4
    # global token count, dp_size: verl multiplies by dp_size (cancels DDP averaging); lossplug returns the share
    vf_loss, _ = verl_algos.compute_value_loss(
        values[micro],
        returns[micro],
        old[micro],
        mask[micro],
        0.2,
        loss_agg_mode="token-mean",
        dp_size=D,
        batch_num_tokens=N,
    )
    ours = value_loss(values[micro], old[micro], returns[micro], mask[micro], clip_eps=0.2, action_tokens=N)
    torch.testing.assert_close(vf_loss, D * ours.loss, atol=1e-6, rtol=1e-6)
    # seq-mean-token-mean ↔ reduction "response" with the global number of sequences
    vf_loss, _ = verl_algos.compute_value_loss(
        values[micro],
        returns[micro],
        old[micro],
        mask[micro],
        0.2,
        loss_agg_mode="seq-mean-token-mean",
        global_batch_size=S,
    )
    ours = value_loss(
        values[micro],
        old[micro],
        returns[micro],
        mask[micro],
        clip_eps=0.2,
        reduction="response",
        normalizer=Normalizer(action_tokens=N, sequences=S),
    )
    torch.testing.assert_close(vf_loss, ours.loss, atol=1e-6, rtol=1e-6)


def _verl_modes():
    from lossplug.adapters.verl import LOSS_AGG_MODES

    return LOSS_AGG_MODES


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"]
)
@pytest.mark.parametrize("budget_in", ["normalizer", "spec"])
def test_matches_verl_under_every_loss_agg_mode_across_ranks_and_micro_batches(verl_algos, mode, budget_in):
    """dp_size 2 × 2 micro-batches, each cut to its own longest response, with verl's global counts: every
    micro-batch's loss (× dp_size, verl's scaling) and the gradient equal verl's compute_value_loss; the shares add up
    to the whole."""
    B, T, D, micro, budget = 8, 10, 2, 2, 12.0
    values, old, returns, mask = _batch(B=B, T=T, seed=20, scale=1.5)
    lengths = torch.randint(1, T + 1, (B,), generator=torch.Generator().manual_seed(21))
    mask = mask & (torch.arange(T) < lengths[:, None])
    mask[torch.arange(B), 0] = True
    garbage = torch.full((B, T), 1e3, dtype=torch.float64)  # verl multiplies by the mask: finite off it
    values, old, returns = (torch.where(mask, t, garbage) for t in (values, old, returns))
    N, S = int(mask.sum()), B
    lsf = budget if mode == "seq-mean-token-sum-norm" else None
    reduction = _verl_modes()[mode]
    if reduction == "fixed" and budget_in == "spec":
        reduction, norm = {"name": "fixed", "budget": budget}, Normalizer(action_tokens=N, sequences=S)
    else:
        norm = Normalizer(action_tokens=N, sequences=S, budget=budget)
    ours_V, verl_V = values.clone().requires_grad_(), values.clone().requires_grad_()
    total = 0
    for start in range(0, B, micro):
        rows = slice(start, start + micro)
        width = int(mask[rows].long().cumsum(-1).argmax(-1).max()) + 1
        cut = (rows, slice(0, width))
        ref, ref_clip = verl_algos.compute_value_loss(
            verl_V[cut],
            returns[cut],
            old[cut],
            mask[cut],
            0.2,
            loss_agg_mode=mode,
            dp_size=D,
            batch_num_tokens=N,
            global_batch_size=S,
            loss_scale_factor=lsf,
        )
        ours = value_loss(
            ours_V[cut], old[cut], returns[cut], mask[cut], clip_eps=0.2, reduction=reduction, normalizer=norm
        )
        assert (D * ours.loss - ref).abs().item() <= 1e-12
        assert ours.clip_frac.item() == pytest.approx(ref_clip.item(), abs=1e-7)  # verl counts in float32
        (D * ours.loss).backward()
        ref.backward()
        total = total + ours.loss.detach()
    assert (ours_V.grad - verl_V.grad).abs().max().item() <= 1e-12
    whole = value_loss(values, old, returns, mask, clip_eps=0.2, reduction=reduction, normalizer=norm).loss
    assert (total - whole).abs().item() <= 1e-12


def test_any_registered_reduction_named_like_a_recipe_names_one():
    values, old, returns, mask = _batch(B=3, T=5, seed=22)
    per_token = value_loss(values, old, returns, mask, clip_eps=0.2).per_token
    assert value_loss(values, old, returns, mask, clip_eps=0.2, reduction="token_sum").loss == per_token.sum()
    fixed = value_loss(values, old, returns, mask, clip_eps=0.2, reduction={"name": "fixed", "budget": 4.0}).loss
    torch.testing.assert_close(fixed, per_token.sum() / (4.0 * 3))
    msg = _raises(
        "reduction: must be 'token' or 'response' or another registered reduction",
        values,
        old,
        returns,
        mask,
        reduction="tokn_sum",
    )
    assert "did you mean 'token_sum'" in msg and "sequence_sum" in msg
    assert "unknown parameter 'budgt'" in _raises(
        "reduction", values, old, returns, mask, reduction={"name": "fixed", "budgt": 4.0}
    )


def test_band_edge_is_inside_the_band_unlike_verls_tie_splitting(verl_algos):
    """At V = V_old ± ε exactly both branches are equal; lossplug takes the raw branch (case 1: V − R), verl's
    min/max ties split the gradient between branches and bounds (0.75·(V − R) here) — a deliberate difference."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    R = torch.full((1, 2), 2.0, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    V = torch.tensor([[0.5, -0.5]], dtype=torch.float64, requires_grad=True)
    value_loss(V, old, R, mask, clip_eps=0.5, reduction="token").loss.backward()
    torch.testing.assert_close(V.grad, (V.detach() - R) / 2)
    Vv = V.detach().clone().requires_grad_()
    verl_algos.compute_value_loss(Vv, R, old, mask, 0.5)[0].backward()
    assert not torch.allclose(Vv.grad, V.grad)


# ---------------------------------------------------------------------------------------------------------------------
# errors


def _raises(match, *args, **kwargs):
    with pytest.raises(LossplugError, match=match) as info:
        value_loss(*args, **kwargs)
    return str(info.value)


def test_errors_name_field_rule_and_place():
    values, old, returns, mask = _batch(B=2, T=3)
    msg = _raises("returns", values, old, returns[:, :2], mask)
    assert "shape must match values [2, 3], got [2, 2]" in msg
    assert "must be a bool tensor" in _raises("action_mask", values, old, returns, mask.long())
    assert "got -0.1" in _raises("clip_eps: must be >= 0", values, old, returns, mask, clip_eps=-0.1)
    _raises("clip_eps: must be finite", values, old, returns, mask, clip_eps=float("nan"))
    empty = mask.clone()
    empty[1] = False
    assert "row [1]" in _raises(
        "action_mask: every response needs at least one action token", values, old, returns, empty
    )
    bad = returns.clone()
    bad[1, 0] = float("nan")
    assert "(row 1, pos 0)" in _raises("returns: must be finite on action positions", values, old, bad, mask)
    _raises("values: must be 2-d", values[0], old, returns, mask)
    _raises("old_values: must be a torch.Tensor, got list", values, old.tolist(), returns, mask)
    _raises("reduction: must be 'token' or 'response'", values, old, returns, mask, reduction="mean")
    _raises(
        "give either normalizer or action_tokens",
        values,
        old,
        returns,
        mask,
        normalizer=Normalizer(action_tokens=100, sequences=10),
        action_tokens=100,
    )
    _raises("only fits reduction 'token'", values, old, returns, mask, reduction="response", action_tokens=100)
    _raises("action_tokens: .*smaller than this micro-batch", values, old, returns, mask, action_tokens=1)
    _raises(
        "normalizer: .*sequences", values, old, returns, mask, normalizer=Normalizer(action_tokens=100, sequences=1)
    )
    assert "mask" not in _raises("values: must be a float tensor", values.long(), old, returns, mask).split("\n")[1]


def test_errors_are_lossplug_errors_not_value_errors():
    values, old, returns, mask = _batch(B=2, T=3)
    with pytest.raises(LossplugError) as info:
        value_loss(values, old[:1], returns, mask.float(), clip_eps=-1)
    assert not isinstance(info.value, ValueError)
    assert str(info.value).count("\n  - ") == 3  # every violation reported at once
