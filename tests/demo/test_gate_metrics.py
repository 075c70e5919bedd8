"""Which logged metrics are the gates' fractions: any ``lossplug/<gate>/…_frac[_side]``, a third-party gate's
included, never lossplug's own namespaces."""

from __future__ import annotations

from lossplug.demo.gate_metrics import gate_fractions, parse

KEYS = [
    "loss",
    "reward",
    "lossplug/ppo_clip/clip_frac_low",
    "lossplug/ppo_clip/clip_frac_high",
    "lossplug/soft_cut/soft_cut_frac",
    "lossplug/tis/trunc_frac",
    "lossplug/icepop/reject_frac_low",
    "lossplug/icepop/reject_frac_high",
    "lossplug/cispo/clip_frac",
    "lossplug/cispo/clip_frac_low",
    "lossplug/cispo/clip_frac_high",
    "lossplug/ppo_clip/active_token_frac",
    "lossplug/sapo/gate_mean",
    "lossplug/effective/token_frac",
    "lossplug/reward/unscorable_frac",
    "lossplug/advantage/zero_frac",
    "lossplug/behavior_logp/unscored_frac",
    "lossplug/ratio/update/p50",
    "lossplug/soft_cut/fraction_kept",
    "lossplug/update/approx_kl",
]


def test_every_gates_fraction_metric_is_found_and_lossplugs_own_namespaces_are_not():
    found = {f.key for f in gate_fractions(KEYS)}
    assert found == {
        "lossplug/ppo_clip/clip_frac_low",
        "lossplug/ppo_clip/clip_frac_high",
        "lossplug/soft_cut/soft_cut_frac",
        "lossplug/tis/trunc_frac",
        "lossplug/icepop/reject_frac_low",
        "lossplug/icepop/reject_frac_high",
        "lossplug/cispo/clip_frac_low",
        "lossplug/cispo/clip_frac_high",
        "lossplug/ppo_clip/active_token_frac",
    }
    # cispo's clip_frac is the sum of its two sides: left out when they are there


def test_names_sides_and_kinds():
    high = parse("lossplug/ppo_clip/clip_frac_high")
    assert (high.gate, high.metric, high.stem, high.side, high.label, high.kept) == (
        "ppo_clip",
        "clip_frac_high",
        "clip_frac",
        "high",
        "clip fraction",
        False,
    )
    soft = parse("lossplug/soft_cut/soft_cut_frac")
    assert (soft.stem, soft.side, soft.label) == ("soft_cut_frac", None, "soft cut fraction")
    assert parse("lossplug/ppo_clip/active_token_frac").kept
    assert parse("lossplug/ppo_clip/clip_fraction") is None and parse("ppo_clip/clip_frac_low") is None


def test_order_follows_the_recipe_then_high_before_low_and_the_recipe_filters():
    keys = [
        "lossplug/b_gate/x_frac_low",
        "lossplug/b_gate/x_frac_high",
        "lossplug/a_gate/y_frac",
        "lossplug/b_gate/x_frac_dual",
    ]
    assert [f.key for f in gate_fractions(keys, gates=["b_gate", "a_gate"])] == [
        "lossplug/b_gate/x_frac_high",
        "lossplug/b_gate/x_frac_low",
        "lossplug/b_gate/x_frac_dual",
        "lossplug/a_gate/y_frac",
    ]
    assert [f.gate for f in gate_fractions(keys)] == ["a_gate", "b_gate", "b_gate", "b_gate"]
    assert [f.key for f in gate_fractions(keys, gates=["a_gate"])] == ["lossplug/a_gate/y_frac"]
