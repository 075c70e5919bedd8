"""verl's settings as lossplug reads them — the leaf every module of :mod:`lossplug.adapters.verl.equivalent` (and
the adapter) shares: verl 0.9.1's defaults for what an omitted key means, the ``loss_agg_mode`` and ``kl_loss_type``
tables, the keys lossplug adds to verl's ``policy_loss`` section, and :func:`as_plain` (any verl config → a plain
``dict``). It imports nothing of the package, so the modules that compose a recipe depend on it and never on each
other in a loop."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lossplug.contracts import LossplugError

__all__ = [
    "ACTOR_DEFAULTS",
    "KL_ESTIMATORS",
    "LOSSPLUG_POLICY_LOSS_KEYS",
    "LOSS_AGG_REDUCTIONS",
    "ROLLOUT_CORRECTION_DEFAULTS",
    "as_plain",
]

#: verl 0.9.1's defaults for the actor settings the loss reads (``actor.yaml``): what an omitted key means to verl
ACTOR_DEFAULTS: dict[str, Any] = {
    "clip_ratio": 0.2,
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.2,
    "clip_ratio_c": 3.0,
    "tau_pos": 1.0,
    "tau_neg": 1.05,
    "loss_agg_mode": "token-mean",
    "loss_scale_factor": None,
    "entropy_coeff": 0.0,
    "use_kl_loss": False,
    "kl_loss_coef": 0.001,
    "kl_loss_type": "low_var_kl",
    "policy_loss": {
        "loss_mode": "vanilla",
        "clip_cov_ratio": 0.0002,
        "clip_cov_lb": 1.0,
        "clip_cov_ub": 5.0,
        "kl_cov_ratio": 0.0002,
        "ppo_kl_coef": 0.1,
        "dro_beta": None,
    },
}

#: verl's ``loss_agg_mode`` (``core_algos.agg_loss``) → the lossplug reduction computing the same aggregation over the
#: same global population (``seq-mean-token-sum-norm`` is ``fixed`` with ``loss_scale_factor`` as its budget)
LOSS_AGG_REDUCTIONS: dict[str, str] = {
    "token-mean": "token",
    "token-sum": "token_sum",
    "seq-mean-token-mean": "response",
    "seq-mean-token-sum": "sequence_sum",
    "seq-mean-token-sum-norm": "fixed",
}

#: verl's ``kl_loss_type`` values (``core_algos.kl_penalty``): the ``kl`` regularizer's ``estimator`` takes the same
#: names with the same meaning (``+``: straight-through, the value of the mode and the gradient of k2)
KL_ESTIMATORS: tuple[str, ...] = (
    "kl",
    "k1",
    "abs",
    "mse",
    "k2",
    "low_var_kl",
    "k3",
    "kl+",
    "k1+",
    "abs+",
    "mse+",
    "k2+",
    "low_var_kl+",
    "k3+",
)


#: verl's ``RolloutCorrectionConfig`` fields with the defaults of its ``algorithm/rollout_correction.yaml``
ROLLOUT_CORRECTION_DEFAULTS: dict[str, Any] = {
    "rollout_is": None,
    "rollout_is_threshold": 2.0,
    "rollout_is_batch_normalize": False,
    "rollout_rs": None,
    "rollout_rs_threshold": None,
    "bypass_mode": False,
    "loss_type": "ppo_clip",
}

#: the keys :class:`~lossplug.adapters.verl.LossplugPolicyLossConfig` adds to verl's ``PolicyLossConfig`` (kept here,
#: verl-free, so that the key check knows them without importing the config class; a test holds the two equal)
LOSSPLUG_POLICY_LOSS_KEYS: frozenset[str] = frozenset({"recipe", "validation", "metrics"})


def as_plain(config: Any, what: str) -> dict[str, Any] | None:
    """A verl config (``DictConfig``, verl's config dataclass, or a mapping) as a plain ``dict`` (``None`` stays
    ``None``). ``what`` names the argument in the error for anything else."""
    if config is None:
        return None
    plain = _plain(config)
    if not isinstance(plain, dict):
        raise LossplugError(
            f"verl_equivalent: {what} must be verl's config (an OmegaConf DictConfig, verl's config dataclass or a "
            f"mapping), got {type(config).__name__}"
        )
    return plain


def _plain(value: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf comes with verl; plain mappings need no conversion
        pass
    else:
        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # field by field: dataclasses.asdict deep-copies every value, and verl's configs hold model objects
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if not f.name.startswith("_")}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
