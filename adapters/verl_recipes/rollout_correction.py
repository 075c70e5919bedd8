"""verl ``algorithm.rollout_correction`` → lossplug correction gates.

Interface (used by :func:`lossplug.adapters.verl_recipes.verl_equivalent`)::

    correction_gates(rollout_correction: Mapping[str, Any]) -> list[dict[str, Any]]   # correction gate specs

``rollout_correction`` is verl's ``algorithm.rollout_correction`` config as a plain dict (``rollout_is``,
``rollout_is_threshold``, ``rollout_is_batch_normalize``, ``rollout_rs``, ``rollout_rs_threshold``, ...). An empty
list when nothing is switched on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def correction_gates(rollout_correction: Mapping[str, Any]) -> list[dict[str, Any]]:
    raise NotImplementedError("being written (verl parity: rollout correction)")
