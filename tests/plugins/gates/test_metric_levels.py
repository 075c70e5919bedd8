"""Metric levels: ``basic`` metrics against naive masked definitions, on batches whose padding holds garbage.

The gates count cut tokens without a mask pass where the cleaned inputs make that exact (off the actions the ratio
is exp(0) = 1 and a [B, T] advantage is 0). These tests compute every basic metric the slow, obvious way — select
the action tokens, compare, count — on batches large enough for the CPU fast paths (bitwise zero-off, the skipped
clamp) and on small ones, with caps below 1 where the mask is needed after all.
"""

import pytest
import torch

import lossplug
from lossplug import LossplugError, PolicyBatch, policy_loss
from lossplug.testing.batches import policy_fields

SIZES = [(6, 10), (8, 2100)]  # the second is above lossplug.ops.ZERO_OFF_MIN


def batch_and_ratios(B, T, token_advantage, dtype=torch.float32):
    f = policy_fields(B, T, seed=B + T + token_advantage, token_advantage=token_advantage, log_ratio_scale=0.3)
    f = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in f.items()}
    mask = f["action_mask"]
    ratio = (f["logp"] - f["old_logp"]).exp()  # computed before the padding is poisoned
    engine = (f["old_logp"] - f["behavior_logp"]).exp()
    adv = f["advantage"] if token_advantage else f["advantage"][:, None].expand(B, T)
    for name in ("logp", "old_logp", "behavior_logp"):  # garbage off the actions: NaN, ±inf, huge
        f[name] = f[name].masked_fill(~mask, float("nan"))
    f["logp"][~mask & (torch.arange(T) % 3 == 0)] = float("inf")
    if token_advantage:
        f["advantage"] = f["advantage"].masked_fill(~mask, 1e30)
    keep = {k: f[k] for k in ("logp", "old_logp", "behavior_logp", "advantage", "action_mask")}
    return keep, mask, ratio[mask], engine[mask], adv[mask]


def frac(hit):
    return float(hit.float().mean())


def basic(fields, recipe):
    result = policy_loss(PolicyBatch(**fields), recipe, metrics="basic")
    return result.metrics


CASES = {
    "ppo_clip": (
        {"gates": [{"name": "ppo_clip", "eps_low": 0.1, "eps_high": 0.15}], "reduction": "token"},
        lambda r, e, a: {
            "ppo_clip/clip_frac_low": frac((r < 0.9) & (a < 0)),
            "ppo_clip/clip_frac_high": frac((r > 1.15) & (a > 0)),
        },
    ),
    "ppo_clip_dual": (
        {"gates": [{"name": "ppo_clip", "eps_low": 0.1, "eps_high": 0.1, "dual_clip_c": 1.2}], "reduction": "token"},
        lambda r, e, a: {
            "ppo_clip/clip_frac_dual": frac((a < 0) & (torch.minimum(r * a, r.clamp(0.9, 1.1) * a) < 1.2 * a))
        },
    ),
    "cispo": (
        {"gates": [{"name": "cispo", "eps_low": 0.1, "eps_high": 0.1}], "reduction": "token"},
        lambda r, e, a: {
            "cispo/clip_frac": frac((r < 0.9) | (r > 1.1)),
            "cispo/clip_frac_low": frac(r < 0.9),
            "cispo/clip_frac_high": frac(r > 1.1),
        },
    ),
    "cispo_cap_below_1": (
        {"gates": [{"name": "cispo", "eps_low": None, "ratio_max": 0.95}], "reduction": "token"},
        lambda r, e, a: {"cispo/clip_frac": frac(r > 0.95), "cispo/clip_frac_high": frac(r > 0.95)},
    ),
    "tis": (
        {"gates": ["ppo_clip", {"name": "tis", "cap": 1.1}], "reduction": "token"},
        lambda r, e, a: {"tis/trunc_frac": frac(e > 1.1)},
    ),
    "tis_cap_below_1": (
        {"gates": ["ppo_clip", {"name": "tis", "cap": 0.9}], "reduction": "token"},
        lambda r, e, a: {"tis/trunc_frac": frac(e > 0.9)},
    ),
    "icepop": (
        {"gates": ["ppo_clip", {"name": "icepop", "low": 0.9, "high": 1.1}], "reduction": "token"},
        lambda r, e, a: {"icepop/reject_frac_low": frac(e < 0.9), "icepop/reject_frac_high": frac(e > 1.1)},
    ),
    "icepop_above_1": (
        {"gates": ["ppo_clip", {"name": "icepop", "low": 1.02, "high": 1.3}], "reduction": "token"},
        lambda r, e, a: {"icepop/reject_frac_low": frac(e < 1.02), "icepop/reject_frac_high": frac(e > 1.3)},
    ),
    "dis": (
        {"gates": [{"name": "dis", "low": 0.1, "high": 0.1}], "reduction": "token"},
        None,
    ),  # DIS compares π_θ with π_behaviour: checked below
}


@pytest.mark.parametrize("B,T", SIZES)
@pytest.mark.parametrize("token_advantage", [False, True], ids=["seq_adv", "token_adv"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_basic_metrics_equal_their_masked_definitions(case, token_advantage, B, T):
    recipe, expected = CASES[case]
    fields, mask, ratio, engine, adv = batch_and_ratios(B, T, token_advantage)
    got = basic(fields, recipe)
    if expected is None:  # dis: ρ = π_θ / π_behaviour
        f = policy_fields(B, T, seed=B + T + token_advantage, token_advantage=token_advantage, log_ratio_scale=0.3)
        rho = (f["logp"] - f["behavior_logp"]).float().exp()[mask]
        expected = lambda r, e, a: {"dis/drop_frac_low": frac(rho <= 0.9), "dis/drop_frac_high": frac(rho >= 1.1)}
    want = expected(ratio, engine, adv)
    assert any(v > 0 for v in want.values()), "the batch must exercise the cut"
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-7), key
    # verl's ppo_kl: the mean over the actions of old_logp − logp
    assert got["update/approx_kl"] == pytest.approx(float(-ratio.log().mean()), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("token_advantage", [False, True], ids=["seq_adv", "token_adv"])
@pytest.mark.parametrize("gate", ["gspo", "gspo_token"])
def test_gspo_basic_cut_fractions_count_action_tokens(gate, token_advantage):
    B, T = 8, 2100
    f = policy_fields(B, T, seed=3, token_advantage=token_advantage, log_ratio_scale=0.05)
    mask = f["action_mask"]
    lengths = mask.sum(-1)
    s = ((f["logp"] - f["old_logp"]) * mask).sum(-1).div(lengths).exp()[:, None].expand(B, T)
    adv = f["advantage"] if token_advantage else f["advantage"][:, None].expand(B, T)
    eps = 3e-4
    fields = {k: f[k] for k in ("logp", "old_logp", "advantage", "action_mask")}
    fields["old_logp"] = fields["old_logp"].masked_fill(~mask, float("nan"))
    got = basic(fields, {"gates": [{"name": gate, "eps_low": eps, "eps_high": eps}], "reduction": "response"})
    low, high = ((s < 1 - eps) & (adv < 0))[mask], ((s > 1 + eps) & (adv > 0))[mask]
    assert low.any() and high.any()
    assert got[f"{gate}/clip_frac_low"] == pytest.approx(frac(low), abs=1e-7)
    assert got[f"{gate}/clip_frac_high"] == pytest.approx(frac(high), abs=1e-7)


@pytest.mark.parametrize("B,T", SIZES)
@pytest.mark.parametrize(
    "recipe",
    [
        "grpo",
        "dapo",
        "gspo",
        "sapo",
        "cispo",
        {"preset": "dapo", "gates": ["ppo_clip", "tis"]},
        {"preset": "dapo", "gates": [{"name": "ppo_clip", "dual_clip_c": 3.0}, "icepop"]},
    ],
    ids=str,
)
def test_levels_share_loss_gradient_and_values(recipe, B, T):
    fields, *_ = batch_and_ratios(B, T, token_advantage=False)
    runs = {}
    for level in ("off", "basic", "full", True, False):
        leaf = fields["logp"].clone().requires_grad_(True)
        result = policy_loss(PolicyBatch(**{**fields, "logp": leaf}), recipe, metrics=level)
        result.loss.backward()
        runs[level] = (result.loss.detach(), leaf.grad, result.metrics)
    off = runs["off"]
    assert off[2] == {} and runs[False][2] == {}
    for level in ("basic", "full"):
        assert torch.equal(runs[level][0], off[0]) and torch.equal(runs[level][1], off[1])
    assert runs[True][2] == runs["full"][2]
    basic_m, full_m = runs["basic"][2], runs["full"][2]
    assert set(basic_m) < set(full_m)
    assert {k: v for k, v in full_m.items() if k in basic_m} == pytest.approx(basic_m, rel=1e-6, abs=1e-9)
    # basic keeps to counts and means: no distributions, no effective-sample fractions
    assert not [k for k in basic_m if k.startswith(("ratio/", "effective/"))], sorted(basic_m)
    assert "ratio/update/p95" in full_m and "effective/token_frac" in full_m


@pytest.mark.parametrize("bad", ["Full", "none", 1, None, "on"])
def test_a_metric_level_outside_the_three_is_refused_by_name(bad):
    fields, *_ = batch_and_ratios(6, 10, token_advantage=False)
    with pytest.raises(
        LossplugError,
        match=r"metrics must be one of 'off', 'basic', 'full' \(or True = 'full', "
        r"False = 'off'\), got ",
    ):
        policy_loss(PolicyBatch(**fields), "dapo", metrics=bad)


def test_sapo_reports_its_gate_diagnostics_only_at_full():
    fields, *_ = batch_and_ratios(6, 10, token_advantage=False)
    batch = PolicyBatch(**fields)
    assert not [k for k in policy_loss(batch, "sapo", metrics="basic").metrics if k.startswith("sapo/")]
    assert {"sapo/gate_mean", "sapo/gate_min", "sapo/soft_frac"} <= set(
        policy_loss(batch, "sapo", metrics="full").metrics
    )


def test_basic_is_the_default_level():
    fields, *_ = batch_and_ratios(6, 10, token_advantage=False)
    batch = PolicyBatch(**fields)
    assert policy_loss(batch, "dapo").metrics == policy_loss(batch, "dapo", metrics="basic").metrics


def test_extra_metric_hooks_run_at_basic(fresh_registry):
    class Plugin:
        @staticmethod
        @lossplug.hookimpl
        def lossplug_extra_metrics(batch, objective, recipe):
            return {"mine/objective_sum": objective.sum()}

    lossplug.register_plugin(Plugin, name="mine")
    try:
        fields, *_ = batch_and_ratios(6, 10, token_advantage=False)
        batch = PolicyBatch(**fields)
        assert "mine/objective_sum" in policy_loss(batch, "dapo", metrics="basic").metrics
        assert policy_loss(batch, "dapo", metrics="off").metrics == {}
    finally:
        lossplug.unregister_plugin(Plugin)
