"""verl's reward side of ``algorithm`` → the recipe's shapers and filters.

Interface (used by :func:`lossplug.adapters.verl.equivalent.verl_equivalent`)::

    reward_shapers(algorithm: Mapping[str, Any]) -> list[dict[str, Any]]   # the recipe's shapers
    batch_filters(algorithm: Mapping[str, Any]) -> list[dict[str, Any]]    # the recipe's filters

* ``use_kl_in_reward`` (``apply_kl_penalty``: ``token_level_rewards = token_level_scores − β·kl_penalty(old, ref)``
  before any estimator), ``kl_penalty`` and ``kl_ctrl.{type, kl_coef, target_kl, horizon}`` →
  ``{name: kl_in_reward, estimator, coef, controller, target_kl, horizon}``, for every estimator. Under verl the
  recipe's shaper then replaces verl's: set ``algorithm.use_kl_in_reward=false`` (the adapter refuses both, the KL
  would be counted twice) and keep the reference policy with ``actor.use_kl_loss=true actor.kl_loss_coef=0`` when
  the actor has no KL loss (verl builds it only for one of the two).
* ``filter_groups.enable`` with ``metric: reward`` (DAPO's dynamic sampling on the canonical reward, the sum of the
  reward manager's scores) → ``zero_variance``: the groups whose rewards are all equal leave the update, groups of one
  stay, as verl keeps them. Only the filtering: verl also re-samples prompts until the batch is full again, which no
  recipe does — the filtered batch is smaller. Other metrics (``acc``, ``score``…) read the reward manager's
  ``reward_extra_info``, which a recipe does not see: refused. With ``use_kl_in_reward`` too, refused: verl filters
  on the reward before the KL, a recipe's filters run after its shapers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lossplug.contracts import LossplugError

__all__ = ["FILTER_GROUPS_KEYS", "KL_PENALTIES", "batch_filters", "reward_shapers"]

#: verl 0.9.1's ``kl_penalty`` modes that the ``kl_in_reward`` shaper computes (``full`` raises in verl itself)
KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "low_var_kl+", "k3+")
#: verl 0.9.1's ``KLControlConfig`` defaults
KL_CTRL_DEFAULTS: dict[str, Any] = {"type": "fixed", "kl_coef": 0.001, "horizon": 10000, "target_kl": 0.1}
#: the ``algorithm.filter_groups`` keys read here
FILTER_GROUPS_KEYS = ("enable", "metric")
#: the ``filter_groups.metric`` that reads the canonical reward (verl 0.9.1's ``FILTER_GROUPS_REWARD_METRIC``)
_REWARD_METRIC = "reward"


def _get(section: Mapping[str, Any], key: str, default: Any) -> Any:
    value = section.get(key, default)
    return default if value is None else value


def reward_shapers(algorithm: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The ``kl_in_reward`` shaper of ``use_kl_in_reward`` (none when it is off)."""
    if not _get(algorithm, "use_kl_in_reward", False):
        return []
    penalty = str(_get(algorithm, "kl_penalty", "kl"))
    if penalty not in KL_PENALTIES:
        raise LossplugError(
            f"algorithm.kl_penalty={penalty!r} with use_kl_in_reward=True: not one of the modes the kl_in_reward "
            f"shaper computes ({', '.join(KL_PENALTIES)}; verl itself raises for 'full')"
        )
    ctrl = {**KL_CTRL_DEFAULTS, **{k: v for k, v in dict(_get(algorithm, "kl_ctrl", {})).items() if v is not None}}
    kind = str(ctrl["type"])
    shaper: dict[str, Any] = {"name": "kl_in_reward", "estimator": penalty, "coef": float(ctrl["kl_coef"])}
    if kind == "fixed":
        return [shaper | {"controller": "fixed"}]
    if kind == "adaptive":
        target, horizon = float(ctrl["target_kl"]), float(ctrl["horizon"])
        return [shaper | {"controller": "adaptive", "target_kl": target, "horizon": horizon}]
    raise LossplugError(f"algorithm.kl_ctrl.type={kind!r}: verl's get_kl_controller knows 'fixed' and 'adaptive' only")


def batch_filters(algorithm: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The ``zero_variance`` filter of ``filter_groups`` (none when it is off)."""
    groups = _get(algorithm, "filter_groups", {})
    if not _get(groups, "enable", False):
        return []
    metric = groups.get("metric")
    if metric != _REWARD_METRIC:
        raise LossplugError(
            f"algorithm.filter_groups.metric={metric!r}: verl reads it from the reward manager's reward_extra_info, "
            f"which a recipe's filter does not see; the zero_variance filter tests the reward itself — set "
            f"algorithm.filter_groups.metric=reward (verl's canonical reward, the sum of the scores) for its "
            f"equivalent"
        )
    if _get(algorithm, "use_kl_in_reward", False):
        raise LossplugError(
            "algorithm.filter_groups with use_kl_in_reward=True: verl filters the groups on the reward before the KL "
            "penalty, and a recipe's filters run after its shapers (on the KL-shaped reward, which is almost never "
            "constant in a group); set use_kl_in_reward=false or filter_groups.enable=false"
        )
    return [{"name": "zero_variance"}]
