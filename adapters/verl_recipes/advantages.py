"""verl ``algorithm.adv_estimator`` → lossplug advantage stage.

Interface (used by :func:`lossplug.adapters.verl_recipes.verl_equivalent`)::

    advantage_stage(algorithm: Mapping[str, Any]) -> dict[str, Any]   # the recipe's advantage spec

``algorithm`` is verl's ``algorithm`` config as a plain dict (``adv_estimator``, ``norm_adv_by_std_in_grpo``,
``gamma``, ``lam``, and each estimator's own options).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def advantage_stage(algorithm: Mapping[str, Any]) -> dict[str, Any]:
    raise NotImplementedError("being written (verl parity: advantage estimators)")
