"""verl ``actor.policy_loss.loss_mode`` → lossplug gates.

Interface (used by :func:`lossplug.adapters.verl_recipes.verl_equivalent`)::

    policy_gates(actor: Mapping[str, Any]) -> PolicyStages

``actor`` is verl's actor config as a plain dict (``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``,
``clip_ratio_c``, ``loss_agg_mode``, ``policy_loss: {loss_mode, clip_cov_*, kl_cov_*, ppo_kl_coef, ...}``, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PolicyStages:
    """The gates of a verl loss mode (update gate first), and a reduction when the mode ignores ``loss_agg_mode``
    (None: the caller maps ``loss_agg_mode``)."""

    gates: list[dict[str, Any]]
    reduction: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


def policy_gates(actor: Mapping[str, Any]) -> PolicyStages:
    raise NotImplementedError("being written (verl parity: policy losses)")
