"""The built-in plugins, registered through the very hooks a third-party package implements."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import lossplug
from lossplug.plugins import reductions
from lossplug.plugins.advantages import group_relative
from lossplug.plugins.gates import ppo_clip

from .presets import PRESETS

if TYPE_CHECKING:
    from lossplug.hookspecs import RegisterPreset


@lossplug.hookimpl
def lossplug_register_advantages(register: Callable[[lossplug.AdvantagePlugin], None]) -> None:
    from lossplug.plugins.advantages import gae, length_adaptive_gae

    register(group_relative.grpo)
    register(group_relative.rloo)
    register(gae.gae)
    register(length_adaptive_gae.length_adaptive_gae)
    # verl's estimators (verl parity)
    from lossplug.plugins.advantages import gdpo, gpg, opo, optimal_baseline, passk, reinforce_plus_plus, remax

    for estimator in (
        optimal_baseline.optimal_token_baseline,
        optimal_baseline.tir_optimal_token_baseline,
        reinforce_plus_plus.reinforce_plus_plus,
        reinforce_plus_plus.reinforce_plus_plus_baseline,
        remax.remax,
        opo.opo,
        passk.grpo_passk,
        gpg.gpg,
        gdpo.gdpo,
    ):
        register(estimator)
    # TRL's multi-reward aggregation (TRL parity)
    from lossplug.plugins.advantages import multi_reward

    register(multi_reward.normalize_then_sum)
    # the field's estimators (MaxRL, GiGPO, on-policy distillation)
    from lossplug.plugins.advantages import distillation, gigpo, maxrl

    for field_estimator in (maxrl.maxrl, gigpo.gigpo, distillation.opd):
        register(field_estimator)
    # found missing by the field inventory (docs/field.md): NeMo-RL's leave-one-out GRPO, a batch baseline, AReaL's
    # token-weighted normalisation
    from lossplug.plugins.advantages import batch_normalized, grpo_loo, length_weighted

    register(grpo_loo.grpo_loo)
    register(batch_normalized.batch_normalized)
    register(length_weighted.length_weighted_grpo)


@lossplug.hookimpl
def lossplug_register_gates(register: Callable[[lossplug.GatePlugin], None]) -> None:
    from lossplug.plugins.gates import cispo, corrections, dis, gspo, reinforce, sapo

    for plugin in (
        ppo_clip.ppo_clip,
        gspo.gspo,
        gspo.gspo_token,
        sapo.sapo,
        cispo.cispo,
        dis.dis,
        reinforce.reinforce,
        corrections.tis,
        corrections.tis_seq,
        corrections.icepop,
        corrections.icepop_seq,
    ):
        register(plugin)
    # verl's policy losses (verl parity)
    from lossplug.plugins.gates import bypass, covariance, dppo, dro, geo_mean

    for plugin in (
        dppo.dppo_tv,
        dppo.dppo_kl,
        dro.dro,
        geo_mean.gmpo,
        covariance.clip_cov,
        covariance.kl_cov,
        bypass.bypass_is,
        bypass.bypass_is_seq,
        bypass.bypass_rs,
    ):
        register(plugin)
    # ROLL's and AReaL's policy losses
    from lossplug.plugins.gates import decoupled_ppo, kimi15, m2po, topr

    for plugin in (topr.topr, kimi15.kimi15, decoupled_ppo.decoupled_ppo, m2po.m2po):
        register(plugin)
    # verl's rollout correction suite (verl parity)
    from lossplug.plugins.gates import offpolicy_metrics, rollout_rejection

    register(rollout_rejection.rollout_rs)
    register(offpolicy_metrics.offpolicy_metrics)
    # TRL's loss options (TRL parity)
    from lossplug.plugins.gates import off_policy_mask, top_entropy, vespo

    for trl_gate in (
        cispo.cispo_seq,
        sapo.sapo_seq,
        vespo.vespo,
        off_policy_mask.off_policy_mask,
        top_entropy.top_entropy,
    ):
        register(trl_gate)
    # the field's other trainers: SkyRL (rollout-anchored), NeMo-RL, OpenRLHF, prime-rl
    from lossplug.plugins.gates import forced_ratio, probability_trust_region, rollout_anchored, seq_mask_tis

    for field_gate in (
        rollout_anchored.importance_sampling,
        rollout_anchored.rollout_is,
        rollout_anchored.cispo_rollout,
        forced_ratio.force_on_policy,
        seq_mask_tis.seq_mask_tis,
        probability_trust_region.dppo_binary_tv,
        probability_trust_region.ipo,
    ):
        register(field_gate)
    # found missing by the field inventory (docs/field.md): OpenRLHF's binary-KL / TV engine trust region, SkyRL's
    # outlier-token rejection
    from lossplug.plugins.gates import cispo_masked, engine_divergence, outlier_mask

    register(engine_divergence.engine_divergence_mask)
    register(outlier_mask.outlier_sequence_mask)
    register(cispo_masked.cispo_masked)  # ROLL's cispo_use_unified_mask


@lossplug.hookimpl
def lossplug_register_reductions(register: Callable[[lossplug.ReductionPlugin], None]) -> None:
    for plugin in (
        reductions.response_mean,
        reductions.token_mean,
        reductions.fixed_budget,
        reductions.sequence_sum,
        reductions.token_sum,
        reductions.prompt_mean,
    ):
        register(plugin)


@lossplug.hookimpl
def lossplug_register_presets(register: RegisterPreset) -> None:
    for name, (recipe, source) in PRESETS.items():
        register(name, recipe, source=source)


@lossplug.hookimpl
def lossplug_register_regularizers(register: Callable[[lossplug.RegularizerPlugin], None]) -> None:
    from lossplug.plugins.regularizers import entropy, kl, nll

    register(kl.kl)
    register(entropy.entropy)
    register(nll.nll)
    # found missing by the field inventory (docs/field.md): NeMo-RL's KL with its score-function weight
    from lossplug.plugins.regularizers import kl_on_policy

    register(kl_on_policy.kl_on_policy)
