"""verl's ``algorithm.rollout_correction`` → lossplug correction gates (``verl.equivalent.rollout_correction``): the
mapping, its refusals, and the recipe alone reproducing verl's driver + actor loss (float64, ≤ 1e-8 relative)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("verl")  # first: lossplug.adapters.verl imports numpy, which verl brings
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo import rollout_corr_helper as verl_rc
from verl.workers.config.actor import ActorConfig

import lossplug
from lossplug.adapters.verl.equivalent.rollout_correction import DEFAULTS, correction_gates, parse_is_threshold

PPO = {"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.28}
REDUCTIONS = {
    "token-mean": {"name": "token"},
    "seq-mean-token-mean": {"name": "response"},
    "seq-mean-token-sum": {"name": "sequence_sum"},
    "seq-mean-token-sum-norm": {"name": "fixed", "budget": 16},
    "token-sum": {"name": "token_sum"},
}
OFFPOLICY = {"name": "offpolicy_metrics"}


def test_the_settings_are_verls():
    fields = {f.name: f for f in dataclasses.fields(RolloutCorrectionConfig) if not f.name.startswith("_")}
    assert set(DEFAULTS) == set(fields)


@pytest.mark.parametrize("config", [None, {}, DEFAULTS, {"rollout_is": "token", "rollout_is_threshold": None}])
def test_nothing_switched_on_gives_no_gate(config):
    assert correction_gates(config) == []


@pytest.mark.parametrize(
    "config, gate",
    [
        ({"rollout_is": "token"}, {"name": "tis", "cap": 2.0}),
        ({"rollout_is": "token", "rollout_is_threshold": 3}, {"name": "tis", "cap": 3.0}),
        ({"rollout_is": "sequence", "rollout_is_threshold": "1.5"}, {"name": "tis_seq", "cap": 1.5}),
        ({"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"}, {"name": "icepop", "low": 0.5, "high": 5.0}),
        (
            {"rollout_is": "sequence", "rollout_is_threshold": " 0.9_1.1 "},
            {"name": "icepop_seq", "low": 0.9, "high": 1.1},
        ),
    ],
)
def test_importance_sampling(config, gate):
    assert correction_gates(config) == [gate, OFFPOLICY]
    assert correction_gates(config, metrics=False) == [gate]


@pytest.mark.parametrize("spec", [2.0, 3, "1.5", "0.5_5.0", "1_1", " 0.2_0.3 "])
def test_is_threshold_reads_like_verls(spec):
    assert parse_is_threshold(spec) == verl_rc._parse_rollout_is_threshold(spec)


@pytest.mark.parametrize("spec", [True, "", "abc", "0_1", "2_1", -1.0, "a_b"])
def test_is_threshold_verl_refuses_is_refused(spec):
    with pytest.raises((ValueError, TypeError)):
        verl_rc._parse_rollout_is_threshold(spec)
    with pytest.raises(lossplug.LossplugError, match="rollout_is_threshold"):
        correction_gates({"rollout_is": "token", "rollout_is_threshold": spec})


def test_batch_normalize_needs_the_whole_batch():
    config = {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True}
    with pytest.raises(lossplug.LossplugError, match="rollout_is_batch_normalize.*whole rollout batch"):
        correction_gates(config)
    assert correction_gates(config, whole_batch=True)[0] == {"name": "tis_seq", "cap": 2.0, "batch_normalize": True}
    # without weights verl normalises nothing
    assert correction_gates({"rollout_is_batch_normalize": True}) == []


@pytest.mark.parametrize(
    "mode, options, ok",
    [
        ("token-sum", "token_k1,seq_mean_k3", True),
        ("seq-mean-token-sum", "token_k2", True),
        ("seq-mean-token-sum-norm", "seq_max_k3,token_k3", True),
        ("seq-mean-token-mean", "seq_sum_k1,seq_max_k2", True),
        ("seq-mean-token-mean", "seq_sum_k1,token_k2", False),
        ("token-mean", "seq_mean_k3", False),
        (None, "seq_mean_k3", False),  # verl's default loss_agg_mode: token-mean
    ],
)
def test_rejection_where_a_weight_is_exact(mode, options, ok):
    config = {"rollout_rs": options, "rollout_rs_threshold": 2.0}  # (k1: bounds 0.5 and 2)
    if ok:
        gates = correction_gates(config, loss_agg_mode=mode)
        assert gates == [{"name": "rollout_rs", "options": options, "threshold": 2.0}, OFFPOLICY]
    else:
        with pytest.raises(lossplug.LossplugError, match=r"rollout_correction\.rollout_rs: .*kept_mask"):
            correction_gates(config, loss_agg_mode=mode)


def test_rejection_options_are_normalised_like_verls():
    gates = correction_gates(
        {"rollout_rs": " seq_max_k2, token_k1,seq_max_k2", "rollout_rs_threshold": "0.1,0.5_2"},
        loss_agg_mode="token-sum",
    )
    assert gates[0] == {"name": "rollout_rs", "options": "seq_max_k2,token_k1", "threshold": "0.1,0.5_2"}


@pytest.mark.parametrize(
    "config, setting",
    [
        ({"rollout_rs": "token_k9", "rollout_rs_threshold": 1.0}, "rollout_rs"),
        ({"rollout_rs": "token_k1"}, "rollout_rs_threshold"),
        ({"rollout_rs": "token_k2", "rollout_rs_threshold": "1_2"}, "rollout_rs_threshold"),
        ({"rollout_rs": "token_k2,token_k3", "rollout_rs_threshold": "1,2,3"}, "rollout_rs_threshold"),
        ({"rollout_is": "tokens"}, "rollout_is"),
        ({"loss_type": "ppo"}, "loss_type"),
        ({"rollout_is_treshold": 2.0}, "rollout_is_treshold"),
    ],
)
def test_refusals_name_the_setting(config, setting):
    with pytest.raises(lossplug.LossplugError, match=rf"algorithm\.rollout_correction\.{setting}"):
        correction_gates(config, loss_agg_mode="token-sum")


def test_bypass_mode_has_no_driver_side_correction():
    config = {"bypass_mode": True, "rollout_is": "token", "rollout_rs": "token_k1", "rollout_rs_threshold": 2.0}
    assert correction_gates(config) == []


# -- the recipe alone reproduces verl (driver correction + actor loss) --------------------------------------------


def rollout_batch(seed: int, B: int = 12, T: int = 8):
    g = torch.Generator().manual_seed(seed)
    length = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T) < length.unsqueeze(-1)
    mask &= (torch.rand(B, T, generator=g) > 0.2) | (torch.arange(T) == 0)
    old = -(torch.rand(B, T, generator=g, dtype=torch.float64) * 3 + 0.05)
    behavior = (old - 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    logp = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    return dict(logp=logp, old_logp=old, behavior_logp=behavior, advantage=adv, action_mask=mask)


CONFIGS = [
    ("token-mean", {"rollout_is": "token", "rollout_is_threshold": 2.0}),
    ("seq-mean-token-mean", {"rollout_is": "sequence", "rollout_is_threshold": "0.5_2.0"}),
    (
        "seq-mean-token-mean",
        {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.02},
    ),
    (
        "seq-mean-token-sum",
        {
            "rollout_is": "sequence",
            "rollout_is_threshold": 2.0,
            "rollout_is_batch_normalize": True,
            "rollout_rs": "token_k1,seq_max_k2",
            "rollout_rs_threshold": "0.8_1.25,0.1",
        },
    ),
    ("seq-mean-token-sum-norm", {"rollout_rs": "token_k3", "rollout_rs_threshold": 0.01}),
    ("token-sum", {"rollout_is": "token", "rollout_is_threshold": "0.8_1.25", "rollout_is_batch_normalize": True}),
]


@pytest.mark.parametrize("mode, config", CONFIGS, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CONFIGS)])
def test_the_recipe_alone_reproduces_verl(mode, config):
    """verl: the driver's rollout correction (compute_rollout_correction_and_add_to_batch) then the actor's vanilla
    loss with rollout_is_weights and the modified response_mask; lossplug: ppo_clip + the mapped gates, one call."""
    f = rollout_batch(len(str(config)))
    mask = f["action_mask"]
    full = dataclasses.asdict(RolloutCorrectionConfig(**{**DEFAULTS, **config}))
    proto, kept, metrics = verl_rc.compute_rollout_correction_and_rejection_mask(
        f["old_logp"],
        f["behavior_logp"],
        mask.long(),
        rollout_is=full["rollout_is"],
        rollout_is_threshold=full["rollout_is_threshold"],
        rollout_is_batch_normalize=full["rollout_is_batch_normalize"],
        rollout_rs=full["rollout_rs"],
        rollout_rs_threshold=full["rollout_rs_threshold"],
    )
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=12, clip_ratio_high=0.28)
    actor.global_batch_info.update(
        dp_size=1, batch_num_tokens=int(kept.sum()), global_batch_size=mask.shape[0], loss_scale_factor=16
    )
    log_prob = f["logp"].clone().requires_grad_()
    loss, _ = core_algos.compute_policy_loss_vanilla(
        f["old_logp"],
        log_prob,
        f["advantage"],
        kept,
        mode,
        actor,
        None if proto is None else proto.batch["rollout_is_weights"],
    )
    loss.backward()

    gates = correction_gates(config, loss_agg_mode=mode, whole_batch=True)
    logp = f["logp"].clone().requires_grad_()
    result = lossplug.policy_loss(
        lossplug.PolicyBatch(**{**f, "logp": logp}),
        {"gates": [PPO, *gates], "reduction": REDUCTIONS[mode]},
        metrics="full",
    )
    result.loss.backward()
    torch.testing.assert_close(result.loss.detach(), loss.detach(), rtol=1e-8, atol=1e-15)
    torch.testing.assert_close(logp.grad, torch.where(mask, log_prob.grad, 0), rtol=1e-8, atol=1e-15)
    # every rollout_corr/ metric verl logs has its lossplug twin: <gate>/<name>
    ours = {}
    for key, value in result.metric_tensors.items():
        gate, _, name = key.partition("/")
        if gate in ("tis", "tis_seq", "icepop", "icepop_seq", "offpolicy_metrics"):
            ours[name] = float(value)
        elif gate == "rollout_rs":
            ours[f"rollout_rs_{name}"] = float(value)
    for key, value in metrics.items():
        name = key.removeprefix("rollout_corr/")
        assert ours[name] == pytest.approx(value, rel=1e-12, abs=1e-15), key
