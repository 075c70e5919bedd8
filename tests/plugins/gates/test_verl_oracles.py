"""lossplug against verl 0.9.1's own policy losses, numerically (float64, loss and gradient wrt log_prob ≤ 1e-6).

verl's loss functions return each micro-batch's share of the global step already multiplied by ``dp_size`` (its
``agg_loss`` with ``config.global_batch_info``). The lossplug side does what a verl adapter does: a
:class:`lossplug.Normalizer` for the global population (all micro-batches of both ranks) and ``loss × dp_size``.

verl ``loss_agg_mode`` → lossplug reduction::

    token-mean               → token
    seq-mean-token-mean      → response        (verl divides by |o_i| + 1e-8: a 1e-8 relative difference)
    seq-mean-token-sum       → sequence_sum
    seq-mean-token-sum-norm  → fixed, budget = loss_scale_factor

``token-sum`` has no lossplug reduction (it has no denominator at all). verl's ``sapo`` ignores ``loss_agg_mode`` and
always aggregates with ``seq-mean-token-mean``, so it is matched by ``response`` under every mode.
"""

from __future__ import annotations

import pytest
import torch

import lossplug

pytest.importorskip("verl")
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
from verl.workers.config.actor import ActorConfig

DP = 2  # data-parallel ranks
MICRO = 2  # micro-batches per rank
ROWS = 3  # responses per micro-batch
T = 7
LOSS_SCALE_FACTOR = 16  # verl's loss_scale_factor: the fixed budget of seq-mean-token-sum-norm

MODES = {
    "token-mean": {"name": "token"},
    "seq-mean-token-mean": {"name": "response"},
    "seq-mean-token-sum": {"name": "sequence_sum"},
    "seq-mean-token-sum-norm": {"name": "fixed", "budget": LOSS_SCALE_FACTOR},
}
TOL = dict(rtol=1e-6, atol=1e-9)


def global_batch(seed: int, *, delta_scale: float, delta_max: float, seq_advantage: bool):
    """A global step: DP × MICRO micro-batches of ROWS responses, padded per micro-batch, with holes in the masks
    (observation tokens of multi-turn responses) and finite junk at masked positions."""
    g = torch.Generator().manual_seed(seed)
    n = DP * MICRO * ROWS
    length = torch.randint(1, T + 1, (n,), generator=g)
    mask = torch.arange(T) < length.unsqueeze(-1)
    mask &= (torch.rand(n, T, generator=g) > 0.2) | (torch.arange(T) == 0)
    old = -(torch.rand(n, T, generator=g, dtype=torch.float64) * 3 + 0.05)
    delta = (torch.randn(n, T, generator=g, dtype=torch.float64) * delta_scale).clamp(-delta_max, delta_max)
    logp = (old + delta).clamp(max=-1e-4)
    behavior = (old - 0.4 * torch.randn(n, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    if seq_advantage:
        adv = torch.randn(n, 1, generator=g, dtype=torch.float64).expand(n, T).clone()
    else:
        adv = torch.randn(n, T, generator=g, dtype=torch.float64)
    chunks = []
    for i in range(0, n, ROWS):
        sl = slice(i, i + ROWS)
        chunks.append(
            dict(logp=logp[sl], old_logp=old[sl], behavior_logp=behavior[sl], advantage=adv[sl], action_mask=mask[sl])
        )
    return chunks, int(mask.sum()), n


def actor_config(**kw) -> ActorConfig:
    return ActorConfig(strategy="fsdp", rollout_n=ROWS, ppo_micro_batch_size_per_gpu=ROWS, **kw)


def verl_side(fn, mb, mode, config, rollout_is_weights=None):
    log_prob = mb["logp"].clone().requires_grad_()
    loss, metrics = fn(
        old_log_prob=mb["old_logp"],
        log_prob=log_prob,
        advantages=mb["advantage"],
        response_mask=mb["action_mask"],
        loss_agg_mode=mode,
        config=config,
        rollout_is_weights=rollout_is_weights,
    )
    loss.backward()
    return loss.detach(), log_prob.grad, metrics


def lossplug_side(recipe, mb, normalizer):
    logp = mb["logp"].clone().requires_grad_()
    batch = lossplug.PolicyBatch(**{**mb, "logp": logp})
    result = lossplug.policy_loss(batch, recipe, normalizer)
    loss = result.loss * DP  # what a verl adapter returns: verl's DP gradient averaging divides by dp_size
    loss.backward()
    return loss.detach(), logp.grad, result.metrics


def compare(fn, gates, config, mode, chunks, tokens, sequences, *, rollout_is=None, reduction=None):
    config.global_batch_info.update(
        dp_size=DP, batch_num_tokens=tokens, global_batch_size=sequences, loss_scale_factor=LOSS_SCALE_FACTOR
    )
    recipe = lossplug.Recipe.load({"gates": gates, "reduction": reduction or MODES[mode]})
    normalizer = lossplug.Normalizer(action_tokens=tokens, sequences=sequences)
    total_verl = total_plug = 0.0
    out = []
    for mb in chunks:
        weights = None
        if rollout_is is not None:
            weights, _ = compute_rollout_correction_weights(
                log_ratio=mb["old_logp"] - mb["behavior_logp"], response_mask=mb["action_mask"], **rollout_is
            )
        v_loss, v_grad, v_metrics = verl_side(fn, mb, mode, config, weights)
        p_loss, p_grad, p_metrics = lossplug_side(recipe, mb, normalizer)
        torch.testing.assert_close(p_loss, v_loss, **TOL)
        torch.testing.assert_close(p_grad, v_grad, **TOL)
        assert p_grad.abs().sum() > 0
        total_verl, total_plug = total_verl + v_loss, total_plug + p_loss
        out.append((v_metrics, p_metrics))
    torch.testing.assert_close(total_plug, total_verl, **TOL)
    return out


VANILLA = [
    # (name, verl config, lossplug gate, delta scale, delta max)
    (
        "plain",
        dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2),
        {"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2},
        0.3,
        1.0,
    ),
    (
        "clip_higher",
        dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28),
        {"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.28},
        0.3,
        1.0,
    ),
    (
        "dual_clip",
        dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=2.5),
        {"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": 2.5},
        1.0,
        2.5,
    ),
]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name, cfg, gate, scale, max_delta", VANILLA, ids=[v[0] for v in VANILLA])
def test_vanilla(name, cfg, gate, scale, max_delta, mode):
    # verl's vanilla always applies dual-clip (clip_ratio_c, default 3): the "plain" inputs keep every ratio below
    # e^1 < 3 so that it never binds, and lossplug's plain ppo_clip (no dual clip) must agree
    chunks, tokens, sequences = global_batch(11, delta_scale=scale, delta_max=max_delta, seq_advantage=False)
    pairs = compare(
        core_algos.compute_policy_loss_vanilla, [gate], actor_config(**cfg), mode, chunks, tokens, sequences
    )
    dual_seen = 0.0
    for v, p in pairs:
        assert p["ppo_clip/clip_frac_low"] + p["ppo_clip/clip_frac_high"] == pytest.approx(
            v["actor/pg_clipfrac"], abs=1e-6
        )
        assert p.get("ppo_clip/clip_frac_dual", 0.0) == pytest.approx(v["actor/pg_clipfrac_lower"], abs=1e-6)
        dual_seen += v["actor/pg_clipfrac_lower"]
    assert (dual_seen > 0) == (name == "dual_clip")
    assert sum(v["actor/pg_clipfrac"] for v, _ in pairs) > 0


GSPO = [
    ("paper_range", dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4), {"eps_low": 3e-4, "eps_high": 4e-4}, 1e-3),
    ("wide_range", dict(clip_ratio_low=0.2, clip_ratio_high=0.28), {"eps_low": 0.2, "eps_high": 0.28}, 0.6),
]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("variant, seq_advantage", [("gspo", True), ("gspo_token", True), ("gspo_token", False)])
@pytest.mark.parametrize("name, cfg, params, scale", GSPO, ids=[g[0] for g in GSPO])
def test_gspo(name, cfg, params, scale, variant, seq_advantage, mode):
    # verl implements GSPO-token; the sequence-level gspo equals it for response-constant advantages
    chunks, tokens, sequences = global_batch(12, delta_scale=scale, delta_max=5 * scale, seq_advantage=seq_advantage)
    pairs = compare(
        core_algos.compute_policy_loss_gspo,
        [{"name": variant, **params}],
        actor_config(**cfg),
        mode,
        chunks,
        tokens,
        sequences,
    )
    clipped = 0.0
    for v, p in pairs:
        frac = p[f"{variant}/clip_frac_low"] + p[f"{variant}/clip_frac_high"]
        assert frac == pytest.approx(v["actor/pg_clipfrac"], abs=1e-6)
        clipped += frac
    assert 0 < clipped < len(pairs)  # the inputs exercise both clipped and unclipped responses


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (1.0, 2.0)])
def test_sapo(tau_pos, tau_neg, mode):
    chunks, tokens, sequences = global_batch(13, delta_scale=0.5, delta_max=3.0, seq_advantage=False)
    compare(
        core_algos.compute_policy_loss_sapo,
        [{"name": "sapo", "tau_pos": tau_pos, "tau_neg": tau_neg}],
        actor_config(tau_pos=tau_pos, tau_neg=tau_neg),
        mode,
        chunks,
        tokens,
        sequences,
        reduction={"name": "response"},
    )


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("low, high", [(0.2, 0.2), (0.1, 0.3)])
def test_cispo(low, high, mode):
    chunks, tokens, sequences = global_batch(14, delta_scale=0.3, delta_max=2.0, seq_advantage=False)
    pairs = compare(
        core_algos.compute_policy_loss_cispo,
        [{"name": "cispo", "eps_low": low, "eps_high": high}],
        actor_config(clip_ratio_low=low, clip_ratio_high=high),
        mode,
        chunks,
        tokens,
        sequences,
    )
    for v, p in pairs:
        assert p["cispo/clip_frac"] == pytest.approx(v["actor/pg_clipfrac"], abs=1e-6)


CORRECTIONS = [
    ("tis", {"name": "tis", "cap": 2.0}, dict(rollout_is="token", rollout_is_threshold=2.0)),
    ("tis_seq", {"name": "tis_seq", "cap": 2.0}, dict(rollout_is="sequence", rollout_is_threshold=2.0)),
    ("icepop", {"name": "icepop", "low": 0.5, "high": 5.0}, dict(rollout_is="token", rollout_is_threshold="0.5_5.0")),
    (
        "icepop_seq",
        {"name": "icepop_seq", "low": 0.5, "high": 5.0},
        dict(rollout_is="sequence", rollout_is_threshold="0.5_5.0"),
    ),
]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("name, gate, rollout_is", CORRECTIONS, ids=[c[0] for c in CORRECTIONS])
def test_rollout_corrections_with_vanilla(name, gate, rollout_is, mode):
    # verl's rollout_corr_helper weights (old vs rollout log-probs) fed to vanilla as rollout_is_weights
    chunks, tokens, sequences = global_batch(15, delta_scale=0.3, delta_max=1.0, seq_advantage=False)
    ppo = {"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.28}
    compare(
        core_algos.compute_policy_loss_vanilla,
        [ppo, gate],
        actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28),
        mode,
        chunks,
        tokens,
        sequences,
        rollout_is=rollout_is,
    )


@pytest.mark.parametrize("mode", list(MODES))
def test_reinforce_with_tis(mode):
    # verl's compute_policy_loss_reinforce (bypass mode's REINFORCE) with TIS weights ↔ reinforce + tis
    chunks, tokens, sequences = global_batch(16, delta_scale=0.3, delta_max=1.0, seq_advantage=False)

    def fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights):
        return core_algos.compute_policy_loss_reinforce(
            old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
        )

    compare(
        fn,
        ["reinforce", {"name": "tis", "cap": 2.0}],
        actor_config(),
        mode,
        chunks,
        tokens,
        sequences,
        rollout_is=dict(rollout_is="token", rollout_is_threshold=2.0),
    )
