"""verl ``algorithm.adv_estimator`` → lossplug advantage stage.

Interface (used by :func:`lossplug.adapters.verl.equivalent.verl_equivalent`)::

    advantage_stage(algorithm: Mapping[str, Any]) -> dict[str, Any]   # the recipe's advantage spec

``algorithm`` is verl's ``algorithm`` config as a plain dict (``adv_estimator``, ``norm_adv_by_std_in_grpo``,
``gamma``, ``lam``, and each estimator's own options). Missing keys take verl 0.9.1's ``AlgoConfig`` defaults.

What verl 0.9.1 itself does is mapped, including where it ignores a setting: ``ray_trainer.compute_advantage``
passes ``norm_adv_by_std_in_grpo`` only to ``grpo`` (and ``grpo_passk`` reads it from the config), so
``grpo_vectorized`` and ``gdpo`` always divide by the std; ``gamma`` is read by ``gae`` and ``reinforce_plus_plus``
only, ``lam`` by ``gae`` only.

verl ``adv_estimator`` → lossplug advantage spec:

* ``gae`` → ``{name: gae, gamma, lam, whiten: true}`` (``use_pf_ppo`` refused); ``use_kl_in_reward`` is not the
  estimator's, for any estimator: it becomes the recipe's ``kl_in_reward`` shaper (:mod:`.rollout_side`)
* ``grpo`` → ``{name: grpo, scale: group | none, std: sample, eps: 1e-6, eps_mode: add}``
* ``grpo_vectorized`` → ``{name: grpo, scale: group, std: sample, eps: 1e-6, eps_mode: add}``
* ``rloo``, ``rloo_vectorized`` → ``{name: rloo}``
* ``reinforce_plus_plus`` → ``{name: reinforce_plus_plus, gamma}``
* ``reinforce_plus_plus_baseline`` → ``{name: reinforce_plus_plus_baseline}``
* ``remax`` → ``{name: remax}`` (reads ``PolicyBatch.reward_baseline``)
* ``opo`` → ``{name: opo}``
* ``grpo_passk`` → ``{name: grpo_passk, scale_by_std: norm_adv_by_std_in_grpo, eps: 1e-6}``
* ``gpg`` → ``{name: gpg}``
* ``gdpo`` → ``{name: gdpo, eps: 1e-6, weights: gdpo_reward_weights}`` (weights only when set; reads
  ``PolicyBatch.reward_components``, one column per ``gdpo_reward_keys`` entry, in that order)
* ``optimal_token_baseline``, ``tir_optimal_token_baseline`` → ``{name: <the same>}`` (read
  ``PolicyBatch.old_logp`` and ``sum_pi_squared``); refused when ``algorithm.rollout_correction`` computes rollout IS
  weights (``rollout_is`` set, not ``bypass_mode``): verl then scales the baseline's weights by ``rollout_is_weights²``,
  which a PolicyBatch does not carry

Differences that remain (documented at each plugin): lossplug's ``grpo`` gives a group of one advantage 0 where verl
gives ``R / (1 + 1e-6)``; lossplug's ``rloo`` refuses groups of one (verl: ``rloo`` keeps ``R``, ``rloo_vectorized``
gives 0); verl computes ``grpo_vectorized`` and ``gdpo`` in float32; lossplug's ``gae`` whitens with a float64 Bessel
factor (verl's is float32: ≤ 3e-8 relative); ``optimal_token_baseline`` counts positions from each response's first
action token (verl: from its first token — the same for responses that start with a generated token).

Inside verl's trainer (``adv_estimator=lossplug``) a plugin sees only what ``compute_advantage`` hands a registered
estimator — rewards, mask, uid and ``reward_baselines``: ``gae`` (values), ``gdpo`` (reward components) and the
optimal token baselines (``old_log_probs``, ``sum_pi_squared``) run there as verl's own estimators, or through
``lossplug.adapters.verl.compute_advantage(data, recipe)`` in a custom trainer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lossplug.contracts import LossplugError

#: verl 0.9.1's ``AdvantageEstimator`` values, in its enum's order
VERL_ESTIMATORS: tuple[str, ...] = (
    "gae",
    "grpo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
    "opo",
    "grpo_passk",
    "gpg",
    "rloo_vectorized",
    "grpo_vectorized",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
    "gdpo",
)

#: verl's epsilon of the group std (``compute_grpo_outcome_advantage`` and its relatives; not configurable)
VERL_GROUP_EPS = 1e-6

#: the ``algorithm`` keys :func:`advantage_stage` (and verl_equivalent, for ``rollout_correction``) reads, and those of
#: ``algorithm.kl_ctrl`` — the valid keys of those sections where verl is not installed (:mod:`.keys`)
ALGORITHM_KEYS: tuple[str, ...] = (
    "adv_estimator",
    "gamma",
    "lam",
    "norm_adv_by_std_in_grpo",
    "use_kl_in_reward",
    "kl_penalty",
    "kl_ctrl",
    "filter_groups",
    "use_pf_ppo",
    "gdpo_reward_keys",
    "gdpo_reward_weights",
    "rollout_correction",
)
KL_CTRL_KEYS: tuple[str, ...] = ("type", "kl_coef", "target_kl", "horizon")

_OPTIMAL_BASELINE_REFUSAL = (
    "algorithm.rollout_correction.rollout_is={rollout_is!r} with adv_estimator={name}: no lossplug equivalent — "
    "verl then weighs the optimal token baseline by rollout_is_weights² (w_t = (1 − 2·π(a_t) + Σπ²)·ρ̄_t²), and a "
    "PolicyBatch does not carry verl's rollout IS weights; set rollout_is=null (the correction gates still apply "
    "IS weights to the loss) or bypass_mode=true"
)


def _get(algorithm: Mapping[str, Any], key: str, default: Any) -> Any:
    value = algorithm.get(key, default)
    return default if value is None else value


def advantage_stage(algorithm: Mapping[str, Any]) -> dict[str, Any]:
    """The lossplug advantage spec equivalent to verl's ``algorithm`` config (see the module's table).

    Raises :class:`~lossplug.LossplugError` naming the setting for an estimator or option without an exact
    equivalent.
    """
    name = str(_get(algorithm, "adv_estimator", "gae"))
    gamma = float(_get(algorithm, "gamma", 1.0))
    lam = float(_get(algorithm, "lam", 1.0))
    norm_by_std = bool(_get(algorithm, "norm_adv_by_std_in_grpo", True))
    grpo = {"name": "grpo", "std": "sample", "eps": VERL_GROUP_EPS, "eps_mode": "add"}

    if name == "gae":
        if _get(algorithm, "use_pf_ppo", False):
            raise LossplugError(
                "algorithm.use_pf_ppo=True: no lossplug equivalent — PF-PPO reweights and resamples the batch by "
                "reward after GAE (compute_pf_ppo_reweight_data), which is not an advantage; set it to False"
            )
        return {"name": "gae", "gamma": gamma, "lam": lam, "whiten": True}
    if name == "grpo":
        return grpo | {"scale": "group" if norm_by_std else "none"}
    if name == "grpo_vectorized":  # compute_advantage does not pass norm_adv_by_std_in_grpo: verl always divides
        return grpo | {"scale": "group"}
    if name in ("rloo", "rloo_vectorized"):
        return {"name": "rloo"}
    if name == "reinforce_plus_plus":
        return {"name": "reinforce_plus_plus", "gamma": gamma}
    if name in ("reinforce_plus_plus_baseline", "remax", "opo", "gpg"):
        return {"name": name}
    if name == "grpo_passk":
        return {"name": "grpo_passk", "scale_by_std": norm_by_std, "eps": VERL_GROUP_EPS}
    if name == "gdpo":
        keys = algorithm.get("gdpo_reward_keys")
        if not keys:
            raise LossplugError(
                "algorithm.gdpo_reward_keys: adv_estimator=gdpo needs the reward component keys (verl asserts the "
                "same); each key becomes one column of PolicyBatch.reward_components, in this order"
            )
        weights = algorithm.get("gdpo_reward_weights")
        if weights is not None and len(weights) != len(keys):
            raise LossplugError(
                f"algorithm.gdpo_reward_weights has {len(weights)} entries for {len(keys)} gdpo_reward_keys "
                f"(one weight per reward component)"
            )
        gdpo: dict[str, Any] = {"name": "gdpo", "eps": VERL_GROUP_EPS}
        if weights is not None:
            gdpo["weights"] = [float(w) for w in weights]
        return gdpo
    if name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        correction = algorithm.get("rollout_correction") or {}
        # as verl's compute_rollout_correction_and_add_to_batch reads it (decoupled mode only)
        rollout_is = correction.get("rollout_is")
        if rollout_is is not None and not correction.get("bypass_mode", False):
            raise LossplugError(_OPTIMAL_BASELINE_REFUSAL.format(rollout_is=rollout_is, name=name))
        return {"name": name}
    raise LossplugError(
        f"algorithm.adv_estimator={name}: not a verl 0.9.1 advantage estimator (known: {', '.join(VERL_ESTIMATORS)})"
    )
