"""The gates for verl 0.9.1's remaining policy losses against verl's own functions: float64, loss and gradient with
respect to ``log_prob``, at most 1e-8 relative, under every ``loss_agg_mode`` each honours, for dp_size 1 and 2.

A step of ``ROWS`` responses is cut into ``dp`` contiguous halves (one micro-batch per rank, each padded to its own
longest response, with finite junk off the mask and observation-token holes inside responses). verl's function runs
on each rank's half with ``config.global_batch_info`` (dp_size, global token and response counts,
``loss_scale_factor``) and returns its share already multiplied by dp_size; lossplug runs the same half with a
:class:`lossplug.Normalizer` over the whole step and multiplies by dp_size (what the verl adapter does). Relative
difference: ``max|ours − verl| / max|verl|``, for the loss and for the gradient.

``gpg`` is verl's ``−A·logp``: lossplug's existing ``reinforce`` gate, proven here. ``clip_cov`` draws random tokens:
both sides run under the same torch RNG state (seeded before each call).
"""

from __future__ import annotations

import functools
import json
import math
import textwrap
from typing import Any

import pytest
import torch

import lossplug

pytest.importorskip("verl")
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig, PolicyLossConfig

from lossplug.plugins.gates import covariance
from lossplug.plugins.gates.covariance import next_cpu_words, shuffled_prefix

from ..._torchrun import run_on_two_processes

DT = torch.float64
ROWS, T = 8, 11
LSF = 16  # verl's loss_scale_factor (seq-mean-token-sum-norm's budget)
TOL = 1e-8
REDUCTIONS = {
    "token-mean": {"name": "token"},
    "seq-mean-token-mean": {"name": "response"},
    "seq-mean-token-sum": {"name": "sequence_sum"},
    "seq-mean-token-sum-norm": {"name": "fixed", "budget": LSF},
}
AGG_MODES = list(REDUCTIONS)


def make_step(seed: int, *, scale: float = 0.4, sequence_advantage: bool = False, adv_scale: float = 1.0):
    """A step of ROWS responses: mixed lengths (≥ 1 action token each), holes, junk off the mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (ROWS,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    holes = (torch.rand(ROWS, T, generator=g) < 0.15) & (torch.arange(T) > 0)
    mask &= ~holes
    old = -torch.rand(ROWS, T, generator=g, dtype=DT) * 2.5 - 0.02
    logp = (old + scale * torch.randn(ROWS, T, generator=g, dtype=DT)).clamp(max=-1e-4)
    if sequence_advantage:
        adv = adv_scale * torch.randn(ROWS, 1, generator=g, dtype=DT).expand(ROWS, T).clone()
    else:
        adv = adv_scale * torch.randn(ROWS, T, generator=g, dtype=DT)
    junk = 30 * torch.rand(ROWS, T, generator=g, dtype=DT)
    return {
        "old_log_prob": torch.where(mask, old, -junk),
        "log_prob": torch.where(mask, logp, junk),
        "advantages": torch.where(mask, adv, junk),
        "response_mask": mask,
        "lengths": lengths,
    }


def ranks(step, dp: int):
    """The dp contiguous halves of the step, each padded to its own longest response."""
    per = ROWS // dp
    for r in range(dp):
        rows = slice(r * per, (r + 1) * per)
        width = int(step["lengths"][rows].max())
        yield {k: v[rows, :width] for k, v in step.items() if k != "lengths"}


def actor_config(mode: str, agg: str, policy: dict[str, Any] | None = None, **actor) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp",
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=ROWS,
        loss_agg_mode=agg,
        policy_loss=PolicyLossConfig(loss_mode=mode, **(policy or {})),
        **actor,
    )


def relative(ours: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item()
    return (ours - ref).abs().max().item() / (scale if scale > 0 else 1.0)


def compare(
    mode: str,
    agg: str,
    recipe: dict[str, Any],
    step,
    dp: int,
    *,
    policy: dict[str, Any] | None = None,
    seed: int | None = None,
    **actor,
) -> tuple[float, float, list[tuple[dict, dict]]]:
    """verl's ``mode`` vs the lossplug recipe on every rank: (max relative loss diff, max relative grad diff,
    metrics per rank)."""
    config = actor_config(mode, agg, policy, **actor)
    tokens = int(step["response_mask"].sum())
    config.global_batch_info.update(dp_size=dp, batch_num_tokens=tokens, global_batch_size=ROWS, loss_scale_factor=LSF)
    normalizer = lossplug.Normalizer(action_tokens=tokens, sequences=ROWS, budget=float(LSF))
    rec = lossplug.Recipe.load(recipe)
    fn = core_algos.get_policy_loss_fn(mode)
    worst_loss = worst_grad = 0.0
    metrics = []
    for mb in ranks(step, dp):
        verl_logp = mb["log_prob"].clone().requires_grad_()
        if seed is not None:
            torch.manual_seed(seed)
        v_loss, v_metrics = fn(
            old_log_prob=mb["old_log_prob"],
            log_prob=verl_logp,
            advantages=mb["advantages"],
            response_mask=mb["response_mask"],
            loss_agg_mode=agg,
            config=config,
            rollout_is_weights=None,
        )
        v_loss.backward()
        logp = mb["log_prob"].clone().requires_grad_()
        batch = lossplug.PolicyBatch(
            logp=logp, old_logp=mb["old_log_prob"], advantage=mb["advantages"], action_mask=mb["response_mask"]
        )
        if seed is not None:
            torch.manual_seed(seed)
        result = lossplug.policy_loss(batch, rec, normalizer)
        loss = result.loss * dp
        loss.backward()
        assert verl_logp.grad is not None and logp.grad is not None
        assert logp.grad.abs().sum() > 0
        worst_loss = max(worst_loss, relative(loss.detach(), v_loss.detach()))
        worst_grad = max(worst_grad, relative(logp.grad, verl_logp.grad))
        metrics.append((v_metrics, result.metrics))
    assert worst_loss <= TOL and worst_grad <= TOL, (
        f"{mode} vs {recipe['gates']} under {agg}, dp {dp}: loss {worst_loss:.3g}, grad {worst_grad:.3g}"
    )
    return worst_loss, worst_grad, metrics


def gates(*specs: dict[str, Any] | str, reduction: dict[str, Any] | None = None, agg: str = "token-mean"):
    return {"gates": list(specs), "reduction": reduction or REDUCTIONS[agg]}


DP = [1, 2]


# ---------------------------------------------------------------------------------------------------------------------
# gpg ≡ reinforce


@pytest.mark.parametrize("dp", DP)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_gpg_is_reinforce(agg, dp):
    compare("gpg", agg, gates("reinforce", agg=agg), make_step(1), dp)


# ---------------------------------------------------------------------------------------------------------------------
# DPPO


DPPO_CASES = [  # (clip_ratio_low, clip_ratio_high, clip_ratio_c)
    (0.2, 0.2, 3.0),
    (0.05, 0.1, 1.5),
    (0.1, 0.3, 20.0),
]


@pytest.mark.parametrize("dp", DP)
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("low, high, cap", DPPO_CASES)
def test_dppo(mode, low, high, cap, agg, dp):
    step = make_step(2, scale=0.9)
    gate = {"name": mode, "eps_low": low, "eps_high": high, "ratio_cap": cap}
    _, _, metrics = compare(
        mode, agg, gates(gate, agg=agg), step, dp, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=cap
    )
    for v, p in metrics:  # verl's metrics are lossplug's, under other names
        assert p[f"{mode}/mask_frac"] == pytest.approx(v["actor/pg_clipfrac"], abs=1e-12)
        assert p[f"{mode}/trunc_frac"] == pytest.approx(v["actor/pg_clipfrac_lower"], abs=1e-12)
    if (low, high) == (0.05, 0.1):  # the inputs reach both the divergence mask and the truncation
        assert sum(v["actor/pg_clipfrac"] for v, _ in metrics) > 0
        assert sum(v["actor/pg_clipfrac_lower"] for v, _ in metrics) > 0


# ---------------------------------------------------------------------------------------------------------------------
# DRO


@pytest.mark.parametrize("dp", DP)
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("beta", [0.05, 0.7])
def test_dro(beta, agg, dp):
    compare("dro", agg, gates({"name": "dro", "beta": beta}, agg=agg), make_step(3), dp, policy={"dro_beta": beta})


def test_dro_penalises_tokens_without_advantage():
    """The quadratic term is outside the advantage: with A = 0 the gradient is −beta·log r (verl's too)."""
    step = make_step(3)
    step["advantages"] = torch.zeros_like(step["advantages"])
    compare("dro", "token-mean", gates({"name": "dro", "beta": 0.3}), step, 1, policy={"dro_beta": 0.3})


# ---------------------------------------------------------------------------------------------------------------------
# GMPO (geo_mean): verl ignores loss_agg_mode and global_batch_info — the response reduction under every mode


@pytest.mark.parametrize("dp", DP)
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("sequence_advantage", [True, False])
@pytest.mark.parametrize("low, high", [(0.2, 0.2), (0.1, 0.4)])
def test_geo_mean(low, high, sequence_advantage, agg, dp):
    step = make_step(4, scale=0.5, sequence_advantage=sequence_advantage)
    gate = {"name": "gmpo", "eps_low": low, "eps_high": high}
    _, _, metrics = compare(
        "geo_mean",
        agg,
        gates(gate, reduction={"name": "response"}),
        step,
        dp,
        clip_ratio_low=low,
        clip_ratio_high=high,
    )
    for v, p in metrics:
        assert p["gmpo/clip_frac_high"] == pytest.approx(v["actor/pg_clipfrac"], abs=1e-12)
        assert p["gmpo/clip_frac_low"] == pytest.approx(v["actor/pg_clipfrac_lower"], abs=1e-12)
    assert sum(v["actor/pg_clipfrac"] + v["actor/pg_clipfrac_lower"] for v, _ in metrics) > 0


def test_geo_mean_is_a_mean_over_each_micro_batch_in_verl():
    """Why the recipe is exact only for one micro-batch per rank: verl's value is the mean over the rows it is
    given, so two micro-batches of a rank sum to twice lossplug's (DP-exact) share."""
    step = make_step(4)
    config = actor_config("geo_mean", "token-mean")
    fn = core_algos.get_policy_loss_fn("geo_mean")
    whole = fn(step["old_log_prob"], step["log_prob"], step["advantages"], step["response_mask"], config=config)[0]
    halves = sum(
        fn(mb["old_log_prob"], mb["log_prob"], mb["advantages"], mb["response_mask"], config=config)[0]
        for mb in ranks(step, 2)
    )
    torch.testing.assert_close(halves, 2 * whole, rtol=1e-12, atol=0)


# ---------------------------------------------------------------------------------------------------------------------
# Clip-Cov: random tokens, verl's RNG replayed


def test_the_replay_is_torch_randperm():
    for seed in range(40):
        for n in (1, 2, 3, 7, 50, 1000):
            for k in {1, min(n, 3), n}:
                torch.manual_seed(seed)
                torch.rand(seed * 37 % 900)  # any position in the MT19937 block, across regenerations
                state = torch.get_rng_state()
                expected = torch.randperm(n)[:k]
                torch.set_rng_state(state)
                got = shuffled_prefix(torch.tensor(n), torch.tensor(k), k + 2, max(n, 4), replay=True)
                assert got[:k].tolist() == expected.tolist()
                assert (got[k:] == max(n, 4)).all()


def test_the_replay_reads_without_advancing_and_then_advances():
    torch.manual_seed(5)
    state = torch.get_rng_state()
    first = next_cpu_words(3)
    assert torch.equal(torch.get_rng_state(), state) and next_cpu_words(3) == first
    shuffled_prefix(torch.tensor(9), torch.tensor(2), 4, 9, replay=True)
    torch.set_rng_state(state)
    torch.empty(4, dtype=torch.int32).random_()
    assert torch.equal(torch.get_rng_state(), state) is False
    advanced = torch.get_rng_state()
    torch.set_rng_state(state)
    shuffled_prefix(torch.tensor(9), torch.tensor(2), 4, 9, replay=True)
    assert torch.equal(torch.get_rng_state(), advanced)


CLIP_COV_CASES = [  # (clip_cov_ratio, lb, ub): the default budget (1 token) and a large one (many random picks)
    (2e-4, 1.0, 5.0),
    (0.2, 0.05, 5.0),
    (0.5, -1.0, 0.5),
]


@pytest.fixture(params=["cpu", "replay"])
def selection_path(request, monkeypatch):
    """clip_cov's two ways to draw verl's random tokens: torch.randperm itself (CPU tensors), and the sync-free replay
    of its shuffle that accelerators take (forced here on the CPU)."""
    if request.param == "replay":
        monkeypatch.setattr(covariance, "shuffled_prefix", functools.partial(shuffled_prefix, replay=True))
    return request.param


@pytest.mark.parametrize("dp", DP)
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("ratio, lb, ub", CLIP_COV_CASES)
def test_clip_cov(ratio, lb, ub, agg, dp, selection_path):
    step = make_step(5, scale=0.5, adv_scale=2.0)
    gate = {"name": "clip_cov", "eps_low": 0.2, "eps_high": 0.28, "ratio": ratio, "lb": lb, "ub": ub}
    policy = {"clip_cov_ratio": ratio, "clip_cov_lb": lb, "clip_cov_ub": ub}
    cut = []
    for seed in (0, 1, 2):
        _, _, metrics = compare(
            "clip_cov",
            agg,
            gates(gate, agg=agg),
            step,
            dp,
            policy=policy,
            seed=seed,
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
        )
        for v, p in metrics:
            assert p["clip_cov/cov_cut_frac"] == pytest.approx(v["actor/pg_clipfrac"], abs=1e-12)
        cut.append(sum(v["actor/pg_clipfrac"] for v, _ in metrics))
    assert all(c > 0 for c in cut)


def test_clip_cov_on_the_cpu_leaves_the_generator_where_verl_does():
    step = make_step(5, scale=0.5, adv_scale=2.0)
    config = actor_config("clip_cov", "token-mean", {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.05})
    torch.manual_seed(3)
    core_algos.get_policy_loss_fn("clip_cov")(
        step["old_log_prob"], step["log_prob"], step["advantages"], step["response_mask"], config=config
    )
    after_verl = torch.get_rng_state()
    torch.manual_seed(3)
    batch = lossplug.PolicyBatch(
        logp=step["log_prob"],
        old_logp=step["old_log_prob"],
        advantage=step["advantages"],
        action_mask=step["response_mask"],
    )
    lossplug.policy_loss(batch, gates({"name": "clip_cov", "ratio": 0.2, "lb": 0.05}))
    assert torch.equal(torch.get_rng_state(), after_verl)


def test_clip_cov_choice_depends_on_the_rng_and_matches_under_each_state(selection_path):
    """With many candidates and a budget below their number, different seeds cut different tokens — and each
    seed's cut is verl's (the gradients agree to 1e-8)."""
    step = make_step(5, scale=0.5, adv_scale=2.0)
    gate = {"name": "clip_cov", "ratio": 0.1, "lb": -1.0, "ub": 5.0}
    rec = lossplug.Recipe.load(gates(gate))
    cuts = set()
    for seed in range(4):
        compare(
            "clip_cov",
            "token-mean",
            gates(gate),
            step,
            1,
            policy={"clip_cov_ratio": 0.1, "clip_cov_lb": -1.0},
            seed=seed,
        )
        torch.manual_seed(seed)
        batch = lossplug.PolicyBatch(
            logp=step["log_prob"].clone().requires_grad_(),
            old_logp=step["old_log_prob"],
            advantage=step["advantages"],
            action_mask=step["response_mask"],
        )
        lossplug.policy_loss(batch, rec).loss.backward()
        cuts.add(tuple(((batch.logp.grad == 0) & step["response_mask"]).reshape(-1).tolist()))
    assert len(cuts) > 1


# ---------------------------------------------------------------------------------------------------------------------
# KL-Cov


@pytest.mark.parametrize("dp", DP)
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("ratio, coef", [(2e-4, 0.1), (0.2, 1.0), (0.6, 0.3)])
@pytest.mark.parametrize("sequence_advantage", [False, True])
def test_kl_cov(ratio, coef, sequence_advantage, agg, dp):
    step = make_step(6, scale=0.5, sequence_advantage=sequence_advantage)
    gate = {"name": "kl_cov", "ratio": ratio, "coef": coef}
    _, _, metrics = compare(
        "kl_cov", agg, gates(gate, agg=agg), step, dp, policy={"kl_cov_ratio": ratio, "ppo_kl_coef": coef}
    )
    assert all(p["kl_cov/kl_frac"] > 0 for _, p in metrics)
    for v, p in metrics:
        assert p["kl_cov/abs_kl"] == pytest.approx(v["actor/ppo_kl"], rel=1e-6)  # (metrics are float32)


# ---------------------------------------------------------------------------------------------------------------------
# bypass_mode: old_log_prob is the rollout policy's; IS weights and rejection on π_θ / π_rollout

BYPASS_CASES = [
    # (id, rollout_correction, lossplug correction gates after the update gate)
    ("reinforce-seq_tis", dict(loss_type="reinforce"), [{"name": "bypass_is_seq", "cap": 2.0}]),
    (
        "reinforce-token_tis-token_k1",
        dict(loss_type="reinforce", rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.6_1.8"),
        [
            {"name": "bypass_is", "cap": 2.0},
            {"name": "bypass_rs", "rules": [{"statistic": "token_k1", "lower": 0.6, "upper": 1.8}]},
        ],
    ),
    (
        "reinforce-token_icepop-normalized",
        dict(
            loss_type="reinforce", rollout_is="token", rollout_is_threshold="0.8_1.5", rollout_is_batch_normalize=True
        ),
        [{"name": "bypass_is", "cap": 1.5, "low": 0.8, "batch_normalize": True}],
    ),
    (
        "reinforce-seq_tis-normalized-seq_mean_k3-token_k2",
        dict(
            loss_type="reinforce",
            rollout_is="sequence",
            rollout_is_threshold=5.0,
            rollout_is_batch_normalize=True,
            rollout_rs="seq_mean_k3,token_k2",
            rollout_rs_threshold="0.08,0.3",
        ),
        [
            {"name": "bypass_is_seq", "cap": 5.0, "batch_normalize": True},
            {
                "name": "bypass_rs",
                "rules": [{"statistic": "seq_mean_k3", "upper": 0.08}, {"statistic": "token_k2", "upper": 0.3}],
            },
        ],
    ),
    (
        "reinforce-no_is-seq_sum_k1",
        dict(loss_type="reinforce", rollout_is=None, rollout_rs="seq_sum_k1", rollout_rs_threshold="0.3_4.0"),
        [{"name": "bypass_rs", "rules": [{"statistic": "seq_sum_k1", "lower": 0.3, "upper": 4.0}]}],
    ),
    ("ppo_clip", dict(loss_type="ppo_clip"), []),
    (
        "ppo_clip-token_k3-seq_max_k2",
        dict(loss_type="ppo_clip", rollout_rs="token_k3,seq_max_k2", rollout_rs_threshold="0.1,0.35"),
        [
            {
                "name": "bypass_rs",
                "rules": [{"statistic": "token_k3", "upper": 0.1}, {"statistic": "seq_max_k2", "upper": 0.35}],
            }
        ],
    ),
    (
        "ppo_clip-seq_mean_k1-single_bound",
        dict(loss_type="ppo_clip", rollout_rs="seq_mean_k1", rollout_rs_threshold=1.25),
        [{"name": "bypass_rs", "rules": [{"statistic": "seq_mean_k1", "upper": 1.25}]}],
    ),
]


@pytest.mark.parametrize("dp", DP)
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("case, corr, corrections", BYPASS_CASES, ids=[c[0] for c in BYPASS_CASES])
def test_bypass_mode(case, corr, corrections, agg, dp):
    step = make_step(7, scale=0.35)
    token_rules = any(
        r["statistic"].startswith("token") for g in corrections if g["name"] == "bypass_rs" for r in g["rules"]
    )
    corrections = [
        {**g, "renormalize": agg == "seq-mean-token-mean" and token_rules} if g["name"] == "bypass_rs" else g
        for g in corrections
    ]
    update = (
        {"name": "reinforce"}
        if corr["loss_type"] == "reinforce"
        else {"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": 3.0}
    )
    compare(
        "bypass_mode",
        agg,
        gates(update, *corrections, agg=agg),
        step,
        dp,
        policy={"rollout_correction": RolloutCorrectionConfig(**corr)},
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
    )


def test_bypass_cases_reject_and_truncate_something():
    """The bypass inputs exercise the rules: each rejects some tokens but not all, and the IS cap binds."""
    step = make_step(7, scale=0.35)
    batch = lossplug.PolicyBatch(
        logp=step["log_prob"],
        old_logp=step["old_log_prob"],
        advantage=step["advantages"],
        action_mask=step["response_mask"],
    )
    for _, _, corrections in BYPASS_CASES:
        for gate in corrections:
            result = lossplug.policy_loss(batch, {"gates": ["reinforce", gate], "reduction": "token"})
            for key, value in result.metrics.items():
                if key.endswith(("reject_frac", "trunc_frac")):
                    assert 0 < value < 1, (gate, key, value)


# ---------------------------------------------------------------------------------------------------------------------
# bypass_mode's batch-normalised IS weights across data-parallel ranks: verl's distributed_masked_mean

DISTRIBUTED_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    import torch.distributed as dist
    import lossplug
    from lossplug.adapters.verl import LossplugPolicyLossConfig
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig, PolicyLossConfig

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows, width = 8, 10
    g = torch.Generator().manual_seed(0)  # the same step on both ranks; each takes its half
    lengths = torch.randint(2, width + 1, (rows,), generator=g)
    mask = torch.arange(width) < lengths[:, None]
    old = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 2 - 0.05
    logp = (old + 0.4 * torch.randn(rows, width, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    adv = torch.randn(rows, width, generator=g, dtype=torch.float64)
    half = slice(rank * rows // 2, (rank + 1) * rows // 2)
    tokens = int(mask.sum())
    result = {}
    for level, gate in (("token", "bypass_is"), ("sequence", "bypass_is_seq")):
        corr = RolloutCorrectionConfig(
            loss_type="reinforce", rollout_is=level, rollout_is_threshold=1.5, rollout_is_batch_normalize=True
        )
        config = ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=4,
                             policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=corr))
        config.global_batch_info.update(dp_size=2, batch_num_tokens=tokens, global_batch_size=rows)
        verl_logp = logp[half].clone().requires_grad_()
        ref, _ = core_algos.get_policy_loss_fn("bypass_mode")(
            old_log_prob=old[half], log_prob=verl_logp, advantages=adv[half], response_mask=mask[half],
            loss_agg_mode="token-mean", config=config)
        ref.backward()
        ours_logp = logp[half].clone().requires_grad_()
        batch = lossplug.PolicyBatch(logp=ours_logp, old_logp=old[half], advantage=adv[half], action_mask=mask[half])
        recipe = {"gates": ["reinforce", {"name": gate, "cap": 1.5, "batch_normalize": True}], "reduction": "token"}
        population = lossplug.Normalizer(action_tokens=tokens, sequences=rows)
        peers = lossplug.Peers.torch_distributed()
        loss = lossplug.policy_loss(batch, recipe, population, peers=peers).loss * 2
        loss.backward()
        # through verl's own seam: the adapter pools over verl's process group itself
        seam_config = ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=4,
                                  policy_loss=LossplugPolicyLossConfig(loss_mode="lossplug", recipe=recipe))
        seam_config.global_batch_info.update(dp_size=2, batch_num_tokens=tokens, global_batch_size=rows)
        seam, _ = core_algos.get_policy_loss_fn("lossplug")(
            old_log_prob=old[half], log_prob=logp[half].clone(), advantages=adv[half], response_mask=mask[half],
            loss_agg_mode="token-mean", config=seam_config)
        # negative control: the same recipe pooled over this rank alone (no peers) differs from verl
        local = lossplug.policy_loss(batch, recipe, population)
        result[level] = [
            abs(float(loss - ref)) / abs(float(ref)),
            float((ours_logp.grad - verl_logp.grad).abs().max() / verl_logp.grad.abs().max()),
            abs(float(seam.detach() - ref)) / abs(float(ref)),
            abs(float(local.loss.detach() * 2 - ref)) / abs(float(ref)),
        ]
    # a rank whose micro-batch has no action token still joins its peer's pooled mean (else the peer would hang)
    empty = mask[half].clone()
    if rank == 1:
        empty[:] = False
    seam, _ = core_algos.get_policy_loss_fn("lossplug")(
        old_log_prob=old[half], log_prob=logp[half].clone(), advantages=adv[half], response_mask=empty,
        loss_agg_mode="token-mean", config=seam_config)
    result["empty_peer"] = float(seam.detach())
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
""")


@pytest.mark.slow
def test_bypass_batch_normalisation_is_global_across_ranks(tmp_path):
    script = tmp_path / "bypass_dp.py"
    script.write_text(DISTRIBUTED_SCRIPT)
    run_on_two_processes(script, str(tmp_path))
    for r in (0, 1):
        diffs = json.loads((tmp_path / f"rank{r}.json").read_text())
        empty_peer = diffs.pop("empty_peer")
        assert set(diffs) == {"token", "sequence"}
        assert max(max(d[:3]) for d in diffs.values()) <= TOL, diffs
        assert min(d[3] for d in diffs.values()) > 1e-6, diffs  # a rank-local mean would not do
        assert (empty_peer == 0.0) if r == 1 else math.isfinite(empty_peer)
