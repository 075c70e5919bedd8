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
    # TRL's multi-reward aggregation (TRL parity)


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
    # verl's rollout correction suite (verl parity)
    # TRL's loss options (TRL parity)


@lossplug.hookimpl
def lossplug_register_reductions(register: Callable[[lossplug.ReductionPlugin], None]) -> None:
    for plugin in (
        reductions.response_mean,
        reductions.token_mean,
        reductions.fixed_budget,
        reductions.sequence_sum,
        reductions.token_sum,
    ):
        register(plugin)


@lossplug.hookimpl
def lossplug_register_presets(register: RegisterPreset) -> None:
    for name, (recipe, source) in PRESETS.items():
        register(name, recipe, source=source)
