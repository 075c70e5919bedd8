"""``policy_gates(actor)``: every verl 0.9.1 ``policy_loss.loss_mode`` → lossplug gates, proven by running both.

For each mode (all twelve of verl's registry) and a few parameter settings, the recipe is built from the actor
config alone — ``policy_gates`` gives the gates and, for the modes that ignore ``loss_agg_mode``, the reduction; else
the reduction is the one matching ``loss_agg_mode`` — and lossplug's verl policy loss
(``compute_policy_loss_lossplug`` with that recipe) is compared with verl's own function called with an
``ActorConfig`` built from the same settings: float64, loss and gradient with respect to ``log_prob``, at most 1e-8
relative, micro-batch by micro-batch, under every ``loss_agg_mode`` and dp_size 1 and 2, each rank's rows split into
two micro-batches of unequal size (verl's ``global_batch_info`` over the whole step) — what verl's engine
backpropagates, so batch-local modes (``geo_mean``) are held to verl's per-micro-batch value too.
"""

from __future__ import annotations

import copy
import warnings
import zlib
from typing import Any

import pytest
import torch

import lossplug
from lossplug.contracts import LossplugError

pytest.importorskip("verl")
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig, PolicyLossConfig

from lossplug.adapters.verl import LossplugPolicyLossConfig, compute_policy_loss_lossplug
from lossplug.adapters.verl.equivalent.policy_losses import MODES, PolicyStages, policy_gates

DT = torch.float64
ROWS, T = 8, 12
LSF = 16
TOL = 1e-8
#: loss_agg_mode → the reduction that reproduces it (for modes that honour it)
REDUCTIONS: dict[str, dict[str, Any]] = {
    "token-mean": {"name": "token"},
    "seq-mean-token-mean": {"name": "response"},
    "seq-mean-token-sum": {"name": "sequence_sum"},
    "seq-mean-token-sum-norm": {"name": "fixed", "budget": LSF},
    "token-sum": {"name": "token_sum"},
}


def make_step(seed: int, *, sequence_advantage: bool, scale: float):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (ROWS,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    mask &= ~((torch.rand(ROWS, T, generator=g) < 0.15) & (torch.arange(T) > 0))
    old = -torch.rand(ROWS, T, generator=g, dtype=DT) * 2.5 - 0.02
    logp = (old + scale * torch.randn(ROWS, T, generator=g, dtype=DT)).clamp(max=-1e-4)
    adv = 1.5 * torch.randn(ROWS, 1 if sequence_advantage else T, generator=g, dtype=DT).expand(ROWS, T).clone()
    junk = 30 * torch.rand(ROWS, T, generator=g, dtype=DT)
    return {
        "old_log_prob": torch.where(mask, old, -junk),
        "log_prob": torch.where(mask, logp, junk),
        "advantages": torch.where(mask, adv, junk),
        "response_mask": mask,
        "lengths": lengths,
    }


#: dp_size → each micro-batch's rows (each rank a contiguous block, split unevenly in two, as dynamic batch size does)
SPLITS: dict[int, list[tuple[int, int]]] = {1: [(0, 3), (3, 8)], 2: [(0, 1), (1, 4), (4, 6), (6, 8)]}


def micro_batches(step, dp: int):
    for start, stop in SPLITS[dp]:
        rows = slice(start, stop)
        width = int(step["lengths"][rows].max())
        yield {k: v[rows, :width] for k, v in step.items() if k != "lengths"}


def verl_config(actor: dict[str, Any], recipe: dict[str, Any] | None = None) -> ActorConfig:
    """verl's ActorConfig for ``actor``; with ``recipe``, the same actor under ``loss_mode=lossplug``."""
    fields = copy.deepcopy(actor)
    policy = fields.pop("policy_loss", {})
    corr = policy.pop("rollout_correction", None)
    if corr is not None:
        policy["rollout_correction"] = RolloutCorrectionConfig(**corr)
    loss = (
        PolicyLossConfig(**policy)
        if recipe is None
        else LossplugPolicyLossConfig(loss_mode="lossplug", recipe=recipe, validation="full")
    )
    return ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=ROWS, policy_loss=loss, **fields)


def run_both(actor: dict[str, Any], dp: int, step, *, seeded: bool = False) -> tuple[float, float]:
    """Max relative difference (loss, gradient) between verl's loss_mode and lossplug's verl policy loss with
    policy_gates' recipe, over the micro-batches of every rank."""
    stages = policy_gates(actor)
    assert isinstance(stages, PolicyStages)
    agg = actor["loss_agg_mode"]
    recipe = {"gates": stages.gates, "reduction": stages.reduction or REDUCTIONS[agg]}
    config = verl_config(actor)
    ours = verl_config(actor, recipe)
    tokens = int(step["response_mask"].sum())
    for c in (config, ours):
        c.global_batch_info.update(dp_size=dp, batch_num_tokens=tokens, global_batch_size=ROWS, loss_scale_factor=LSF)
    fn = core_algos.get_policy_loss_fn(actor["policy_loss"]["loss_mode"])
    worst_loss = worst_grad = 0.0
    moved = False  # (a micro-batch of one fully clipped row has no gradient; the step must have one)
    for i, mb in enumerate(micro_batches(step, dp)):
        results = []
        for loss_fn, cfg in ((fn, config), (compute_policy_loss_lossplug, ours)):
            logp = mb["log_prob"].clone().requires_grad_()
            if seeded:
                torch.manual_seed(100 + i)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the adapter's note that loss_agg_mode reduces verl's own terms)
                loss, _ = loss_fn(
                    old_log_prob=mb["old_log_prob"],
                    log_prob=logp,
                    advantages=mb["advantages"],
                    response_mask=mb["response_mask"],
                    loss_agg_mode=agg,
                    config=cfg,
                    rollout_is_weights=None,
                )
            loss.backward()
            assert logp.grad is not None
            results.append((loss.detach(), logp.grad))
        (ref, ref_grad), (loss, grad) = results
        worst_loss = max(worst_loss, ((loss - ref).abs() / ref.abs().clamp(min=1e-300)).item())
        scale = ref_grad.abs().max().clamp(min=1e-300)
        worst_grad = max(worst_grad, ((grad - ref_grad).abs().max() / scale).item())
        moved = moved or bool(ref_grad.abs().sum() > 0)
    assert moved, "verl's loss has no gradient on this step"
    return worst_loss, worst_grad


# (id, actor settings without loss_agg_mode, sequence-level advantages, log-ratio scale)
CASES: list[tuple[str, dict[str, Any], bool, float]] = [
    ("vanilla-default", {"policy_loss": {"loss_mode": "vanilla"}}, False, 0.3),
    (
        "vanilla-clip_higher-dual_clip",
        {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 1.8, "policy_loss": {"loss_mode": "vanilla"}},
        False,
        0.8,
    ),
    (
        "gspo-paper",
        {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4, "policy_loss": {"loss_mode": "gspo"}},
        True,
        1e-3,
    ),
    ("gspo-wide", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "policy_loss": {"loss_mode": "gspo"}}, False, 0.5),
    ("sapo-default", {"policy_loss": {"loss_mode": "sapo"}}, False, 0.5),
    ("sapo-tau", {"tau_pos": 1.0, "tau_neg": 2.0, "policy_loss": {"loss_mode": "sapo"}}, False, 0.5),
    ("cispo", {"clip_ratio_low": 0.1, "clip_ratio_high": 0.3, "policy_loss": {"loss_mode": "cispo"}}, False, 0.4),
    ("gpg", {"policy_loss": {"loss_mode": "gpg"}}, False, 0.4),
    ("dppo_tv-default", {"policy_loss": {"loss_mode": "dppo_tv"}}, False, 0.9),
    (
        "dppo_tv-tight",
        {"clip_ratio_low": 0.05, "clip_ratio_high": 0.1, "clip_ratio_c": 1.5, "policy_loss": {"loss_mode": "dppo_tv"}},
        False,
        0.9,
    ),
    ("dppo_kl-default", {"policy_loss": {"loss_mode": "dppo_kl"}}, False, 0.9),
    (
        "dppo_kl-tight",
        {
            "clip_ratio_low": 0.02,
            "clip_ratio_high": 0.05,
            "clip_ratio_c": 20.0,
            "policy_loss": {"loss_mode": "dppo_kl"},
        },
        False,
        0.9,
    ),
    ("clip_cov-default", {"policy_loss": {"loss_mode": "clip_cov"}}, False, 0.5),
    (
        "clip_cov-many",
        {"policy_loss": {"loss_mode": "clip_cov", "clip_cov_ratio": 0.2, "clip_cov_lb": 0.05, "clip_cov_ub": 5.0}},
        False,
        0.5,
    ),
    ("kl_cov-default", {"policy_loss": {"loss_mode": "kl_cov"}}, False, 0.5),
    ("kl_cov-many", {"policy_loss": {"loss_mode": "kl_cov", "kl_cov_ratio": 0.2, "ppo_kl_coef": 1.0}}, True, 0.5),
    (
        "kl_cov-coef_none",
        {"policy_loss": {"loss_mode": "kl_cov", "kl_cov_ratio": 0.3, "ppo_kl_coef": None}},
        False,
        0.5,
    ),
    ("geo_mean-default", {"policy_loss": {"loss_mode": "geo_mean"}}, True, 0.5),
    (
        "geo_mean-token_adv",
        {"clip_ratio_low": 0.1, "clip_ratio_high": 0.4, "policy_loss": {"loss_mode": "geo_mean"}},
        False,
        0.5,
    ),
    ("dro", {"policy_loss": {"loss_mode": "dro", "dro_beta": 0.1}}, False, 0.4),
    (
        "bypass-ppo_clip-default",
        {"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": {}}},
        False,
        0.35,
    ),
    (
        "bypass-ppo_clip-rs",
        {
            "clip_ratio_high": 0.28,
            "policy_loss": {
                "loss_mode": "bypass_mode",
                "rollout_correction": {"rollout_rs": "token_k3,seq_max_k2", "rollout_rs_threshold": "0.1,0.35"},
            },
        },
        False,
        0.35,
    ),
    (
        "bypass-reinforce-seq_tis",
        {"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": {"loss_type": "reinforce"}}},
        False,
        0.35,
    ),
    (
        "bypass-reinforce-token_icepop-normalized-token_k1",
        {
            "policy_loss": {
                "loss_mode": "bypass_mode",
                "rollout_correction": {
                    "loss_type": "reinforce",
                    "rollout_is": "token",
                    "rollout_is_threshold": "0.8_1.5",
                    "rollout_is_batch_normalize": True,
                    "rollout_rs": "token_k1",
                    "rollout_rs_threshold": "0.6_1.8",
                },
            }
        },
        False,
        0.35,
    ),
    (
        "bypass-reinforce-seq_tis-normalized-seq_mean_k3",
        {
            "policy_loss": {
                "loss_mode": "bypass_mode",
                "rollout_correction": {
                    "loss_type": "reinforce",
                    "rollout_is_threshold": 5.0,
                    "rollout_is_batch_normalize": True,
                    "rollout_rs": "seq_mean_k3,token_k2",
                    "rollout_rs_threshold": "0.08,0.3",
                },
            }
        },
        False,
        0.35,
    ),
]
DP = [1, 2]


def test_the_cases_cover_every_verl_loss_mode():
    verl_modes = set(core_algos.POLICY_LOSS_REGISTRY) - {"lossplug"}
    assert len(verl_modes) == 12 and set(MODES) == verl_modes
    assert {c[1]["policy_loss"]["loss_mode"] for c in CASES} == verl_modes


@pytest.mark.parametrize("dp", DP)
@pytest.mark.parametrize("agg", list(REDUCTIONS))
@pytest.mark.parametrize("case, actor, seq_adv, scale", CASES, ids=[c[0] for c in CASES])
def test_policy_gates_reproduce_verl(case, actor, seq_adv, scale, agg, dp):
    step = make_step(zlib.crc32(case.encode()) % 1000, sequence_advantage=seq_adv, scale=scale)
    loss, grad = run_both(
        {**actor, "loss_agg_mode": agg}, dp, step, seeded=actor["policy_loss"]["loss_mode"] == "clip_cov"
    )
    assert loss <= TOL and grad <= TOL, f"{case} under {agg}, dp {dp}: loss {loss:.3g}, grad {grad:.3g}"


def test_modes_that_ignore_loss_agg_mode_bring_their_reduction():
    for mode, reduction in (
        ("sapo", {"name": "response"}),
        ("geo_mean", {"name": "response", "population": "micro_batch"}),  # verl's mean over each micro-batch's rows
    ):
        stages = policy_gates({"loss_agg_mode": "token-mean", "policy_loss": {"loss_mode": mode}})
        assert stages.reduction == reduction and stages.notes
    assert policy_gates({"policy_loss": {"loss_mode": "vanilla"}}).reduction is None


def test_geo_mean_counts_rows_without_actions_as_verls_mean_does():
    """verl's geo_mean divides by every row of the micro-batch (torch.mean), rows emptied by rejection sampling
    included; the adapter leaves such rows out of the lossplug batch and weighs the rest by their share."""
    actor = {"loss_agg_mode": "token-mean", "policy_loss": {"loss_mode": "geo_mean"}}
    step = make_step(7, sequence_advantage=True, scale=0.5)
    step["response_mask"] = step["response_mask"].clone()
    step["response_mask"][[1, 5]] = False
    loss, grad = run_both(actor, 2, step)
    assert loss <= TOL and grad <= TOL, (loss, grad)


def test_geo_mean_population_step_is_the_data_parallel_exact_alternative():
    """gmpo + response over the step (the documented alternative) does not depend on the split: the micro-batches'
    shares add up to the whole step's mean; the micro_batch form (verl's) does."""
    step = make_step(3, sequence_advantage=True, scale=0.5)
    gates = policy_gates({"policy_loss": {"loss_mode": "geo_mean"}}).gates
    whole = {}
    for population in ("step", "micro_batch"):
        recipe = lossplug.Recipe.load({"gates": gates, "reduction": {"name": "response", "population": population}})
        tokens = int(step["response_mask"].sum())
        normalizer = lossplug.Normalizer(action_tokens=tokens, sequences=ROWS, micro_batches=len(SPLITS[2]))
        full = lossplug.policy_loss(_batch(step), recipe).loss
        parts = sum(lossplug.policy_loss(_batch(mb), recipe, normalizer).loss for mb in micro_batches(step, 2))
        whole[population] = (float(full), float(parts))
    assert whole["step"][0] == pytest.approx(whole["step"][1], rel=1e-12)
    assert abs(whole["micro_batch"][0] - whole["micro_batch"][1]) > 1e-3


def _batch(mb) -> lossplug.PolicyBatch:
    return lossplug.PolicyBatch(
        logp=mb["log_prob"], old_logp=mb["old_log_prob"], advantage=mb["advantages"], action_mask=mb["response_mask"]
    )


def test_gpg_maps_to_reinforce_and_defaults_follow_verl():
    assert policy_gates({"policy_loss": {"loss_mode": "gpg"}}).gates == [{"name": "reinforce"}]
    assert policy_gates({}).gates == [{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2, "dual_clip_c": 3.0}]
    gates = policy_gates({"clip_ratio": 0.3, "clip_ratio_low": None, "clip_ratio_high": None}).gates
    assert gates[0]["eps_low"] == gates[0]["eps_high"] == 0.3
    kl = policy_gates({"policy_loss": {"loss_mode": "kl_cov", "ppo_kl_coef": None}}).gates[0]
    assert kl == {"name": "kl_cov", "ratio": 0.0002, "coef": 1.0}


def test_bypass_rejection_renormalises_only_where_the_mean_per_response_needs_it():
    corr = {"rollout_rs": "token_k1,seq_sum_k2", "rollout_rs_threshold": "2.0,0.5"}
    actor = {"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": corr}}
    rs = policy_gates({**actor, "loss_agg_mode": "seq-mean-token-mean"}).gates[-1]
    assert rs == {
        "name": "bypass_rs",
        "rules": [
            {"statistic": "token_k1", "upper": 2.0, "lower": 0.5},
            {"statistic": "seq_sum_k2", "upper": 0.5},
        ],
        "renormalize": True,
    }
    assert policy_gates({**actor, "loss_agg_mode": "token-mean"}).gates[-1]["renormalize"] is False


@pytest.mark.parametrize(
    "actor, names",
    [
        ({"policy_loss": {"loss_mode": "dro"}}, "dro_beta"),
        ({"policy_loss": {"loss_mode": "dro", "dro_beta": 0}}, "dro_beta"),
        ({"policy_loss": {"loss_mode": "grpo_magic"}}, "loss_mode='grpo_magic'"),
        ({"policy_loss": {"loss_mode": "lossplug"}}, "recipe"),
        ({"clip_ratio_c": 1.0}, "clip_ratio_c"),
        ({"policy_loss": {"loss_mode": "bypass_mode"}}, "rollout_correction"),
        ({"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": {"loss_type": "gae"}}}, "loss_type"),
        (
            {"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": {"rollout_rs": "token_k4"}}},
            "token_k4",
        ),
        (
            {"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": {"rollout_rs": "seq_max_k2"}}},
            "rollout_rs_threshold",
        ),
        (
            {
                "policy_loss": {
                    "loss_mode": "bypass_mode",
                    "rollout_correction": {"rollout_rs": "token_k2", "rollout_rs_threshold": "0.1_0.2"},
                }
            },
            "one upper bound",
        ),
        (
            {
                "policy_loss": {
                    "loss_mode": "bypass_mode",
                    "rollout_correction": {"loss_type": "reinforce", "rollout_is_threshold": "3_1"},
                }
            },
            "rollout_is_threshold",
        ),
        ({"policy_loss": {"loss_mode": "clip_cov", "clip_cov_ratio": 2.0}}, "clip_cov_ratio"),
    ],
)
def test_settings_without_an_exact_equivalent_are_refused_by_name(actor, names):
    with pytest.raises(LossplugError, match=names.replace("(", r"\(")):
        policy_gates(actor)
