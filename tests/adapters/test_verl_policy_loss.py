"""verl policy loss ``lossplug`` against verl's built-in losses, through verl's own registry.

Every case goes through ``get_policy_loss_fn("lossplug")`` with an ``ActorConfig`` whose ``policy_loss`` is a
``LossplugPolicyLossConfig`` carrying the recipe, on random float64 inputs (masks with observation-token holes,
garbage off the mask), split over dp_size = 2 ranks × 2 micro-batches, each micro-batch padded to its own longest
response and given verl's ``global_batch_info``. Loss and gradient of every micro-batch must match verl's built-in to
1e-6 (they match to ~1e-15).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

import numpy as np
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn
from verl.workers.config import ActorConfig, PolicyLossConfig

import lossplug
from lossplug.adapters.verl import LOSS_AGG_MODES, LossplugPolicyLossConfig, verl_normalizer
from lossplug.contracts import LossplugError, Normalizer

DT = torch.float64
TOL = 1e-6
B, T, DP, MICRO = 8, 14, 2, 2
#: every loss_agg_mode: each has a lossplug reduction
MODES = list(LOSS_AGG_MODES)


def make_inputs(
    seed: int, *, sequence_advantage: bool = False, empty_rows: tuple[int, ...] = (), noise: float = 0.4
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    holes = torch.rand(B, T, generator=g) < 0.15  # observation/tool tokens inside the response
    holes[torch.arange(B), 0] = False
    mask = mask & ~holes
    for r in empty_rows:  # verl's synthetic padding rows / rejected responses: no action token at all
        mask[r] = False
    old = -torch.rand(B, T, generator=g, dtype=DT) * 3
    logp = (old + noise * torch.randn(B, T, generator=g, dtype=DT)).clamp(max=0)
    big = torch.rand(B, T, generator=g) < 0.1  # a few far-off-policy tokens: dual-clip territory
    logp = torch.where(big & mask, (old + 1.5).clamp(max=0), logp)
    if sequence_advantage:
        adv = torch.randn(B, 1, generator=g, dtype=DT).expand(B, T).clone()
    else:
        adv = torch.randn(B, T, generator=g, dtype=DT)
    garbage = 50 * torch.rand(B, T, generator=g, dtype=DT)  # whatever verl holds off the mask, finite
    return {
        "old_log_prob": torch.where(mask, old, -garbage),
        "log_prob": torch.where(mask, logp, garbage),
        "advantages": torch.where(mask, adv, garbage),
        "response_mask": mask,
        "lengths": lengths,
    }


def actor_config(policy_loss, mode: str, **kw) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp",
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=MICRO,
        loss_agg_mode=mode,
        policy_loss=policy_loss,
        **kw,
    )


def lossplug_config(gates, reduction, mode: str, **kw) -> ActorConfig:
    recipe = {"gates": gates, "reduction": reduction}
    return actor_config(LossplugPolicyLossConfig(loss_mode="lossplug", recipe=recipe), mode, **kw)


def global_info(inputs, loss_scale_factor=None) -> dict:
    return {
        "dp_size": DP,
        "batch_num_tokens": int(inputs["response_mask"].sum()),
        "global_batch_size": B,
        "loss_scale_factor": loss_scale_factor,
    }


def micro_batches(inputs):
    """dp_size ranks × micro-batches, each padded to its own longest response (as verl's micro-batches are)."""
    for start in range(0, B, MICRO):
        rows = slice(start, start + MICRO)
        width = int(inputs["lengths"][rows].max())
        yield {k: v[rows, :width] for k, v in inputs.items() if k != "lengths"}


def run(name: str, config: ActorConfig, mb, mode: str, weights=None):
    log_prob = mb["log_prob"].clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn(name)(
        old_log_prob=mb["old_log_prob"],
        log_prob=log_prob,
        advantages=mb["advantages"],
        response_mask=mb["response_mask"],
        loss_agg_mode=mode,
        config=config,
        rollout_is_weights=weights,
    )
    loss.backward()
    return loss.detach(), log_prob.grad, metrics


def compare(verl_name, verl_cfg, ours_cfg, inputs, mode, weights=None) -> float:
    """Max |difference| of loss and gradient over every micro-batch of every rank."""
    worst = 0.0
    for i, mb in enumerate(micro_batches(inputs)):
        w = None if weights is None else weights[i * MICRO : (i + 1) * MICRO, : mb["log_prob"].shape[1]]
        ref_loss, ref_grad, _ = run(verl_name, verl_cfg, mb, mode, w)
        loss, grad, metrics = run("lossplug", ours_cfg, mb, mode, w)
        assert loss.dtype == DT and torch.isfinite(loss)
        worst = max(worst, (loss - ref_loss).abs().item(), (grad - ref_grad).abs().max().item())
    assert worst <= TOL, f"lossplug vs verl {verl_name} under {mode}: max difference {worst:.3g}"
    return worst


def with_info(config, inputs, lsf):
    config.global_batch_info.update(global_info(inputs, lsf))
    return config


def lsf_for(mode):
    return T if mode == "seq-mean-token-sum-norm" else None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("eps_low,eps_high,clip_c", [(0.2, 0.2, 3.0), (0.2, 0.28, 3.0), (0.1, 0.3, 1.5)])
def test_vanilla_clip_higher_and_dual_clip(mode, eps_low, eps_high, clip_c):
    inputs = make_inputs(1)
    lsf = lsf_for(mode)
    ref = with_info(
        actor_config(
            PolicyLossConfig(loss_mode="vanilla"),
            mode,
            clip_ratio_low=eps_low,
            clip_ratio_high=eps_high,
            clip_ratio_c=clip_c,
            loss_scale_factor=lsf,
        ),
        inputs,
        lsf,
    )
    ours = with_info(
        lossplug_config(
            [{"name": "ppo_clip", "eps_low": eps_low, "eps_high": eps_high, "dual_clip_c": clip_c}],
            {"name": LOSS_AGG_MODES[mode]},
            mode,
            loss_scale_factor=lsf,
        ),
        inputs,
        lsf,
    )
    compare("vanilla", ref, ours, inputs, mode)


def test_the_cases_exercise_every_clip_branch():
    inputs = make_inputs(1)
    cfg = with_info(
        lossplug_config(
            [{"name": "ppo_clip", "eps_low": 0.1, "eps_high": 0.3, "dual_clip_c": 1.5}], "token", "token-mean"
        ),
        inputs,
        None,
    )
    totals = {"clip_frac_low": 0.0, "clip_frac_high": 0.0, "clip_frac_dual": 0.0}
    for mb in micro_batches(inputs):
        _, _, metrics = run("lossplug", cfg, mb, "token-mean")
        for k in totals:
            totals[k] += metrics[f"actor/lossplug/ppo_clip/{k}"]
    assert all(v > 0 for v in totals.values()), totals


@pytest.mark.parametrize("level", ["basic", "full", "off", True, False])
def test_metric_levels_and_verls_ppo_kl(level):
    """``metrics`` picks lossplug's level; verl's ``actor/ppo_kl`` comes from lossplug's approx_kl, equal to verl's."""
    inputs = make_inputs(1)
    gates = [{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2, "dual_clip_c": 3.0}]
    config = actor_config(
        LossplugPolicyLossConfig(loss_mode="lossplug", recipe={"gates": gates, "reduction": "token"}, metrics=level),
        "token-mean",
    )
    cfg = with_info(config, inputs, None)
    ref = with_info(
        actor_config(
            PolicyLossConfig(loss_mode="vanilla"),
            "token-mean",
            clip_ratio_low=0.2,
            clip_ratio_high=0.2,
            clip_ratio_c=3.0,
        ),
        inputs,
        None,
    )
    mb = next(micro_batches(inputs))
    _, _, ours = run("lossplug", cfg, mb, "token-mean")
    _, _, theirs = run("vanilla", ref, mb, "token-mean")
    if level in ("off", False):
        assert ours == {}
        return
    assert ours["actor/ppo_kl"] == pytest.approx(theirs["actor/ppo_kl"], rel=1e-12, abs=1e-15)
    assert "actor/lossplug/update/approx_kl" not in ours and "actor/lossplug/loss" not in ours
    # verl's pg_clipfrac counts both sides (a token is on one side only): lossplug splits them
    assert ours["actor/lossplug/ppo_clip/clip_frac_low"] + ours[
        "actor/lossplug/ppo_clip/clip_frac_high"
    ] == pytest.approx(theirs["actor/pg_clipfrac"], abs=1e-12)
    full = level in ("full", True)
    assert ("actor/lossplug/ratio/update/p95" in ours) is full
    assert ("actor/lossplug/effective/token_frac" in ours) is full


@pytest.mark.parametrize("bad", ["verbose", 2])
def test_an_unknown_metric_level_is_refused_at_config_time(bad):
    with pytest.raises(
        LossplugError,
        match=r"actor_rollout_ref\.actor\.policy_loss\.metrics must be one of "
        r"'off', 'basic', 'full'",
    ):
        LossplugPolicyLossConfig(loss_mode="lossplug", recipe="dapo", metrics=bad)


@pytest.mark.parametrize("mode", MODES)
def test_gspo_token_matches_verl_gspo(mode):
    inputs = make_inputs(2, noise=0.15)
    lsf = lsf_for(mode)
    ref = with_info(
        actor_config(
            PolicyLossConfig(loss_mode="gspo"), mode, clip_ratio_low=0.2, clip_ratio_high=0.28, loss_scale_factor=lsf
        ),
        inputs,
        lsf,
    )
    ours = with_info(
        lossplug_config(
            [{"name": "gspo_token", "eps_low": 0.2, "eps_high": 0.28}],
            {"name": LOSS_AGG_MODES[mode]},
            mode,
            loss_scale_factor=lsf,
        ),
        inputs,
        lsf,
    )
    compare("gspo", ref, ours, inputs, mode)


@pytest.mark.parametrize("mode", MODES)
def test_gspo_sequence_matches_verl_gspo_with_sequence_advantages(mode):
    inputs = make_inputs(3, sequence_advantage=True, noise=0.15)
    lsf = lsf_for(mode)
    ref = with_info(
        actor_config(
            PolicyLossConfig(loss_mode="gspo"), mode, clip_ratio_low=3e-2, clip_ratio_high=4e-2, loss_scale_factor=lsf
        ),
        inputs,
        lsf,
    )
    ours = with_info(
        lossplug_config(
            [{"name": "gspo", "eps_low": 3e-2, "eps_high": 4e-2}],
            {"name": LOSS_AGG_MODES[mode]},
            mode,
            loss_scale_factor=lsf,
        ),
        inputs,
        lsf,
    )
    compare("gspo", ref, ours, inputs, mode)


@pytest.mark.filterwarnings("ignore:lossplug. the recipe reduces the policy term")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (0.5, 2.0)])
def test_sapo_matches_verl_sapo(mode, tau_pos, tau_neg):
    # verl's sapo reduces with seq-mean-token-mean whatever loss_agg_mode says: lossplug's 'response'
    inputs = make_inputs(4)
    lsf = lsf_for(mode)
    ref = with_info(
        actor_config(PolicyLossConfig(loss_mode="sapo"), mode, tau_pos=tau_pos, tau_neg=tau_neg, loss_scale_factor=lsf),
        inputs,
        lsf,
    )
    ours = with_info(
        lossplug_config(
            [{"name": "sapo", "tau_pos": tau_pos, "tau_neg": tau_neg}],
            {"name": "response"},
            mode,
            loss_scale_factor=lsf,
        ),
        inputs,
        lsf,
    )
    compare("sapo", ref, ours, inputs, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.2), (0.1, 0.3)])
def test_cispo_matches_verl_cispo(mode, eps_low, eps_high):
    inputs = make_inputs(5)
    lsf = lsf_for(mode)
    ref = with_info(
        actor_config(
            PolicyLossConfig(loss_mode="cispo"),
            mode,
            clip_ratio_low=eps_low,
            clip_ratio_high=eps_high,
            loss_scale_factor=lsf,
        ),
        inputs,
        lsf,
    )
    ours = with_info(
        lossplug_config(
            [{"name": "cispo", "eps_low": eps_low, "eps_high": eps_high}],
            {"name": LOSS_AGG_MODES[mode]},
            mode,
            loss_scale_factor=lsf,
        ),
        inputs,
        lsf,
    )
    compare("cispo", ref, ours, inputs, mode)


@pytest.mark.parametrize("mode", MODES)
def test_rollout_is_weights_apply_like_verl(mode):
    inputs = make_inputs(6)
    g = torch.Generator().manual_seed(60)
    weights = (2 * torch.rand(B, T, generator=g, dtype=DT)) * (torch.rand(B, T, generator=g) > 0.1)  # TIS/IcePop-ish
    weights = torch.where(inputs["response_mask"], weights, 0)
    lsf = lsf_for(mode)
    ref = with_info(actor_config(PolicyLossConfig(loss_mode="vanilla"), mode, loss_scale_factor=lsf), inputs, lsf)
    ours = with_info(
        lossplug_config(
            [{"name": "ppo_clip", "dual_clip_c": 3.0}], {"name": LOSS_AGG_MODES[mode]}, mode, loss_scale_factor=lsf
        ),
        inputs,
        lsf,
    )
    compare("vanilla", ref, ours, inputs, mode, weights=weights)


@pytest.mark.parametrize("mode", MODES)
def test_rows_without_action_tokens_contribute_nothing(mode):
    # verl's synthetic padding rows and rejection-sampled responses reach the loss with an all-zero response_mask
    inputs = make_inputs(7, empty_rows=(1, 4, 5))
    lsf = lsf_for(mode)
    ref = with_info(actor_config(PolicyLossConfig(loss_mode="vanilla"), mode, loss_scale_factor=lsf), inputs, lsf)
    ours = with_info(
        lossplug_config(
            [{"name": "ppo_clip", "dual_clip_c": 3.0}], {"name": LOSS_AGG_MODES[mode]}, mode, loss_scale_factor=lsf
        ),
        inputs,
        lsf,
    )
    compare("vanilla", ref, ours, inputs, mode)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_losses_add_up_to_the_full_batch(mode):
    """Σ over ranks and micro-batches of the (×dp_size) losses, averaged over ranks as DDP does, is the full-batch
    loss on one rank without any global info."""
    inputs = make_inputs(8)
    lsf = lsf_for(mode)
    gates, red = [{"name": "ppo_clip", "eps_high": 0.28, "dual_clip_c": 3.0}], {"name": LOSS_AGG_MODES[mode]}
    split = with_info(lossplug_config(gates, red, mode, loss_scale_factor=lsf), inputs, lsf)
    total = sum(run("lossplug", split, mb, mode)[0] for mb in micro_batches(inputs)) / DP
    whole = lossplug_config(gates, red, mode, loss_scale_factor=lsf)
    whole.global_batch_info.update(
        {"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None, "loss_scale_factor": lsf}
    )
    full = {k: v for k, v in inputs.items() if k != "lengths"}
    loss, _, _ = run("lossplug", whole, full, mode)
    assert (total - loss).abs().item() <= 1e-12
    # and that is verl's own full-batch aggregation of the same per-token losses
    ref = actor_config(PolicyLossConfig(loss_mode="vanilla"), mode, clip_ratio_high=0.28, loss_scale_factor=lsf)
    ref.global_batch_info.update({"dp_size": 1, "loss_scale_factor": lsf})
    ref_loss, _, _ = run("vanilla", ref, full, mode)
    assert (ref_loss - loss).abs().item() <= 1e-12


@pytest.fixture
def fresh_warnings(monkeypatch):
    from lossplug.adapters import common

    monkeypatch.setattr(common, "ONCE_WARNED", set())


def test_a_reduction_that_differs_from_loss_agg_mode_is_reported(fresh_warnings):
    inputs = make_inputs(9)
    cfg = with_info(lossplug_config(["sapo"], "response", "token-mean"), inputs, None)
    with pytest.warns(UserWarning, match="set loss_agg_mode to seq-mean-token-mean"):
        run("lossplug", cfg, next(micro_batches(inputs)), "token-mean")


def test_a_token_reduction_under_token_sum_is_reported(fresh_warnings):
    inputs = make_inputs(9)
    cfg = with_info(lossplug_config(["ppo_clip"], "token", "token-sum"), inputs, None)
    with pytest.warns(UserWarning, match="loss_agg_mode=token-sum"):
        run("lossplug", cfg, next(micro_batches(inputs)), "token-sum")


def test_every_loss_agg_mode_has_a_reduction():
    assert set(LOSS_AGG_MODES) == {
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "token-sum",
    }
    assert all(lossplug.registry().plugins["reduction"].get(r) is not None for r in LOSS_AGG_MODES.values())


@pytest.mark.parametrize("mode", MODES)
def test_each_reduction_is_verls_agg_loss_under_its_dp_scaling(mode):
    """lossplug.reduce with the adapter's Normalizer × dp_size against verl's agg_loss itself, on a per-token loss
    matrix with garbage off the mask and an empty row, rank by rank and micro-batch by micro-batch: loss and
    gradient."""
    inputs = make_inputs(15, empty_rows=(2,))
    g = torch.Generator().manual_seed(150)
    loss_mat = torch.where(inputs["response_mask"], torch.randn(B, T, generator=g, dtype=DT), 1e3)
    info = global_info(inputs, lsf_for(mode))
    ours_mat, verl_mat = loss_mat.clone().requires_grad_(), loss_mat.clone().requires_grad_()
    total = 0
    for start in range(0, B, MICRO):
        rows = slice(start, start + MICRO)
        width = int(inputs["lengths"][rows].max())
        mask = inputs["response_mask"][rows, :width]
        ref = agg_loss(verl_mat[rows, :width], mask, mode, **info)
        normalizer, dp_size = verl_normalizer(info, mask)
        ours = (
            lossplug.reduce(ours_mat[rows, :width], mask, normalizer=normalizer, reduction=LOSS_AGG_MODES[mode])
            * dp_size
        )
        assert (ours - ref).abs().item() <= 1e-15 * max(1.0, ref.abs().item())
        ref.backward()
        ours.backward()
        total = total + ours.detach()
    assert (ours_mat.grad - verl_mat.grad).abs().max().item() <= 1e-15
    # DDP averages the ×dp_size losses over the ranks: the whole step's aggregation on one rank
    whole = agg_loss(loss_mat, inputs["response_mask"], mode, **{**info, "dp_size": 1})
    assert (total / DP - whole).abs().item() <= 1e-12


@pytest.mark.parametrize("key", ["batch_num_tokens", "global_batch_size", "dp_size"])
@pytest.mark.parametrize("wrap", [float, lambda v: torch.tensor(v)], ids=["float", "tensor"])
def test_fractional_counts_are_refused_like_normalizer_refuses_them(key, wrap):
    inputs = make_inputs(16)
    info = {**global_info(inputs), key: wrap(3.5)}
    with pytest.raises(LossplugError) as ours:
        verl_normalizer(info, inputs["response_mask"])
    with pytest.raises(LossplugError) as normalizer:
        Normalizer(action_tokens=3.5, sequences=2)
    assert str(ours.value) == f"config.global_batch_info[{key!r}]: must be a whole number, got float 3.5"
    assert str(ours.value).split(": ", 1)[1] == str(normalizer.value).split(": ", 1)[1]
    # whole numbers in any numeric type (verl's counts are Python ints, tensors or numpy scalars) pass unchanged
    whole = {**global_info(inputs), key: wrap(4.0)}
    assert verl_normalizer(whole, inputs["response_mask"])[1] == (4 if key == "dp_size" else DP)
    assert verl_normalizer({**global_info(inputs), key: np.int64(4)}, inputs["response_mask"])


def test_engine_kl_is_reported_under_verls_rollout_corr_name():
    from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics

    inputs = make_inputs(17)
    g = torch.Generator().manual_seed(170)
    rollout = (inputs["old_log_prob"] + 0.3 * torch.randn(B, T, generator=g, dtype=DT)).clamp(max=0)
    cfg = with_info(lossplug_config(["ppo_clip", {"name": "tis", "cap": 2.0}], "token", "token-mean"), inputs, None)
    for i, mb in enumerate(micro_batches(inputs)):
        rows, width = slice(i * MICRO, (i + 1) * MICRO), mb["log_prob"].shape[1]
        _, metrics = get_policy_loss_fn("lossplug")(
            old_log_prob=mb["old_log_prob"],
            log_prob=mb["log_prob"],
            advantages=mb["advantages"],
            response_mask=mb["response_mask"],
            loss_agg_mode="token-mean",
            config=cfg,
            rollout_log_probs=rollout[rows, :width],
        )
        verl = compute_offpolicy_metrics(mb["old_log_prob"], rollout[rows, :width], mb["response_mask"])
        assert metrics["actor/rollout_corr/kl"] == pytest.approx(verl["kl"], rel=1e-12, abs=1e-15)
    _, plain = run(
        "lossplug",
        with_info(lossplug_config(["ppo_clip"], "token", "token-mean"), inputs, None),
        next(micro_batches(inputs)),
        "token-mean",
    )[1:]
    assert "actor/rollout_corr/kl" not in plain and "actor/ppo_kl" in plain


def test_fixed_reduction_without_a_budget_names_the_config_key():
    inputs = make_inputs(10)
    cfg = with_info(lossplug_config(["ppo_clip"], "fixed", "seq-mean-token-sum-norm"), inputs, None)
    with pytest.raises(LossplugError, match="loss_scale_factor"):
        run("lossplug", cfg, next(micro_batches(inputs)), "seq-mean-token-sum-norm")


def test_dp_size_above_one_without_global_counts_is_an_error():
    inputs = make_inputs(11)
    cfg = lossplug_config(["ppo_clip"], "token", "token-mean")
    cfg.global_batch_info.update({"dp_size": 2, "batch_num_tokens": None, "global_batch_size": B})
    with pytest.raises(LossplugError, match="batch_num_tokens"):
        run("lossplug", cfg, next(micro_batches(inputs)), "token-mean")


def test_token_sum_needs_no_global_counts_like_verls():
    inputs = make_inputs(18)
    info = {"dp_size": DP, "batch_num_tokens": None, "global_batch_size": None}
    ref = actor_config(PolicyLossConfig(loss_mode="vanilla"), "token-sum")
    ours = lossplug_config([{"name": "ppo_clip", "dual_clip_c": 3.0}], "token_sum", "token-sum")
    ref.global_batch_info.update(info)
    ours.global_batch_info.update(info)
    compare("vanilla", ref, ours, inputs, "token-sum")


def test_recipe_corrections_run_as_verls_forwarded_rollout_correction():
    """verl passes rollout_is_weights, never rollout_log_probs: a recipe's engine corrections are verl's own rollout
    correction, accepted when algorithm.rollout_correction is forwarded to the actor and maps to them — then verl's
    weights replace them, once (equal to verl's vanilla with the same weights); else refused with the lines to set."""
    inputs = make_inputs(12)
    gates = [{"name": "ppo_clip", "dual_clip_c": 3.0}, {"name": "tis", "cap": 2.0}, {"name": "offpolicy_metrics"}]
    g = torch.Generator().manual_seed(120)
    weights = torch.where(inputs["response_mask"], 2.0 * torch.rand(B, T, generator=g, dtype=DT), 0)

    def ours(rollout_correction):
        policy = LossplugPolicyLossConfig(
            loss_mode="lossplug", recipe={"gates": gates, "reduction": "token"}, rollout_correction=rollout_correction
        )
        return with_info(actor_config(policy, "token-mean"), inputs, None)

    mb = next(micro_batches(inputs))
    w = weights[:MICRO, : mb["log_prob"].shape[1]]
    wanted = (
        r"'\+actor_rollout_ref\.actor\.policy_loss\.rollout_correction=\$\{algorithm\.rollout_correction\}' "
        r"algorithm\.rollout_correction\.rollout_is=token algorithm\.rollout_correction\.rollout_is_threshold=2\.0"
    )
    for weight in (w, None):
        with pytest.raises(LossplugError, match="never passes.*" + wanted):
            run("lossplug", ours(None), mb, "token-mean", weights=weight)
    with pytest.raises(LossplugError, match=r"maps to \[\{'name': 'tis_seq', 'cap': 2\.0\}\]"):
        run("lossplug", ours({"rollout_is": "sequence"}), mb, "token-mean", weights=w)
    token_tis = {"rollout_is": "token", "rollout_is_threshold": 2.0}
    with pytest.raises(LossplugError, match="no rollout_is_weights"):
        run("lossplug", ours(token_tis), mb, "token-mean")
    ref = with_info(actor_config(PolicyLossConfig(loss_mode="vanilla"), "token-mean"), inputs, None)
    for forwarded in (token_tis, RolloutCorrectionConfig(**token_tis)):  # a dict, or verl's own dataclass
        compare("vanilla", ref, ours(forwarded), inputs, "token-mean", weights=weights)


def test_corrections_verl_has_no_setting_for_are_refused_with_that_reason():
    inputs = make_inputs(14)
    recipe = {"gates": ["ppo_clip", {"name": "tis", "cap": 2.0, "floor": 0.5}], "reduction": "token"}
    policy = LossplugPolicyLossConfig(loss_mode="lossplug", recipe=recipe, rollout_correction=None)
    cfg = with_info(actor_config(policy, "token-mean"), inputs, None)
    mb = next(micro_batches(inputs))
    with pytest.raises(LossplugError, match="has no setting for them"):
        run("lossplug", cfg, mb, "token-mean", weights=torch.ones_like(mb["log_prob"]))


def test_rollout_log_probs_feed_the_recipe_corrections():
    """A caller that passes rollout_log_probs gets the recipe's corrections on the engine ratio; with TIS this equals
    verl's vanilla loss given verl's own token TIS weights min(exp(old − rollout), cap)."""
    inputs = make_inputs(13)
    g = torch.Generator().manual_seed(130)
    rollout = (inputs["old_log_prob"] + 0.3 * torch.randn(B, T, generator=g, dtype=DT)).clamp(max=0)
    mode = "token-mean"
    ours = with_info(
        lossplug_config([{"name": "ppo_clip", "dual_clip_c": 3.0}, {"name": "tis", "cap": 2.0}], "token", mode),
        inputs,
        None,
    )
    ref = with_info(actor_config(PolicyLossConfig(loss_mode="vanilla"), mode), inputs, None)
    mask = inputs["response_mask"]
    weights = torch.where(mask, (inputs["old_log_prob"] - rollout).clamp(-20, 20).exp().clamp(max=2.0), 0)
    for i, mb in enumerate(micro_batches(inputs)):
        rows, width = slice(i * MICRO, (i + 1) * MICRO), mb["log_prob"].shape[1]
        ref_loss, ref_grad, _ = run("vanilla", ref, mb, mode, weights[rows, :width])
        log_prob = mb["log_prob"].clone().requires_grad_(True)
        loss, _ = get_policy_loss_fn("lossplug")(
            old_log_prob=mb["old_log_prob"],
            log_prob=log_prob,
            advantages=mb["advantages"],
            response_mask=mb["response_mask"],
            loss_agg_mode=mode,
            config=ours,
            rollout_log_probs=rollout[rows, :width],
        )
        loss.backward()
        assert (loss - ref_loss).abs().item() <= TOL
        assert (log_prob.grad - ref_grad).abs().max().item() <= TOL


def test_a_plain_policy_loss_config_says_how_to_pass_the_recipe():
    inputs = make_inputs(14)
    cfg = actor_config(PolicyLossConfig(loss_mode="lossplug"), "token-mean")
    with pytest.raises(LossplugError, match="LossplugPolicyLossConfig"):
        run("lossplug", cfg, next(micro_batches(inputs)), "token-mean")


def test_entropy_and_kl_stay_verls_in_ppo_loss():
    """verl's own ``ppo_loss`` (workers/utils/losses.py) with loss_mode=lossplug on CPU: same total loss (policy term +
    verl's entropy bonus + verl's KL loss), same gradient and same entropy/KL metrics as with loss_mode=vanilla."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    inputs = make_inputs(15)
    mask, lengths = inputs["response_mask"], inputs["lengths"]
    # ppo_loss slices the response out of the un-padded model output: each sequence is prompt + response tokens
    P = 3
    g = torch.Generator().manual_seed(150)
    ref_logp = (inputs["old_log_prob"] + 0.1 * torch.randn(B, T, generator=g, dtype=DT)).clamp(max=0)
    entropy = torch.rand(B, T, generator=g, dtype=DT)
    attention = torch.cat([torch.ones(B, P, dtype=torch.long), (torch.arange(T) < lengths[:, None]).long()], 1)

    def flat(per_token):
        return torch.cat(
            [
                torch.cat([torch.zeros(P - 1, dtype=DT), per_token[i, : lengths[i]], torch.zeros(1, dtype=DT)])
                for i in range(B)
            ]
        )

    def data(dp_size):
        td = TensorDict(
            {
                "prompts": torch.ones(B, P, dtype=torch.long),
                "responses": torch.ones(B, T, dtype=torch.long),
                "attention_mask": attention,
                "response_mask": mask.long(),
                "old_log_probs": inputs["old_log_prob"],
                "advantages": inputs["advantages"],
                "ref_log_prob": ref_logp,
            },
            batch_size=[B],
        )
        tu.assign_non_tensor(td, dp_size=dp_size, batch_num_tokens=int(mask.sum()), global_batch_size=B)
        return td

    results = {}
    for name, policy in (
        ("vanilla", PolicyLossConfig(loss_mode="vanilla")),
        (
            "lossplug",
            LossplugPolicyLossConfig(
                loss_mode="lossplug",
                recipe={"gates": [{"name": "ppo_clip", "eps_high": 0.28, "dual_clip_c": 3.0}], "reduction": "token"},
            ),
        ),
    ):
        cfg = actor_config(
            policy,
            "token-mean",
            clip_ratio_high=0.28,
            entropy_coeff=0.01,
            use_kl_loss=True,
            kl_loss_coef=0.1,
            kl_loss_type="low_var_kl",
        )
        log_probs = flat(inputs["log_prob"]).requires_grad_(True)
        loss, metrics = ppo_loss(cfg, {"log_probs": log_probs, "entropy": flat(entropy)}, data(DP))
        loss.backward()
        results[name] = (loss.detach(), log_probs.grad, metrics)
    (ref_loss, ref_grad, ref_m), (loss, grad, m) = results["vanilla"], results["lossplug"]
    assert (loss - ref_loss).abs().item() <= TOL
    assert (grad - ref_grad).abs().max().item() <= TOL
    for key in ("actor/pg_loss", "actor/entropy_loss", "kl_loss"):
        assert abs(float(m[key].aggregate()) - float(ref_m[key].aggregate())) <= TOL, key
    assert any(k.startswith("actor/lossplug/") for k in m)
    # the policy term alone is verl's vanilla, so entropy and KL were added exactly once
    assert float(m["actor/entropy_loss"].aggregate()) != 0 and float(m["kl_loss"].aggregate()) != 0
    assert abs(float(ref_m["actor/pg_loss"].aggregate()) - float(m["actor/pg_loss"].aggregate())) <= TOL
    kl_once = float(ref_m["kl_loss"].aggregate()) * 0.1
    ent_once = float(ref_m["actor/entropy_loss"].aggregate()) * 0.01
    assert abs(float(loss) - (float(m["actor/pg_loss"].aggregate()) - ent_once + kl_once)) <= TOL
