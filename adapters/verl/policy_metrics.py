"""verl's own metric keys for lossplug's policy loss — ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``,
``actor/ppo_kl``, ``actor/rollout_corr/kl`` with the definitions of the verl loss mode the update gate reproduces —
beside lossplug's under ``actor/lossplug/`` (:func:`verl_loss_metrics`)."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping

import torch

from lossplug.adapters.common import metric_floats

__all__ = ["VERL_METRICS", "verl_loss_metrics", "verl_metrics"]

Tensor = torch.Tensor


def _sum(*keys: str) -> Callable[[Callable[[str], Tensor | None]], Tensor | None]:
    def total(get: Callable[[str], Tensor | None]) -> Tensor | None:
        parts = [get(k) for k in keys]
        return None if any(p is None for p in parts) else functools.reduce(operator.add, parts)

    return total


def _zero(get: Callable[[str], Tensor | None]) -> Tensor | None:
    approx_kl = get("@approx_kl")
    return None if approx_kl is None else approx_kl * 0


#: update gate → verl's metric keys with the definitions of the verl loss mode that gate reproduces (``core_algos``);
#: each entry reads the gate's own metrics (``get("clip_frac_low")``) — ``"@approx_kl"`` is lossplug's
#: ``update/approx_kl``, verl's ``ppo_kl`` for every mode but ``kl_cov``
VERL_METRICS: dict[str, dict[str, Callable[[Callable[[str], Tensor | None]], Tensor | None]]] = {
    # vanilla: clipped-branch tokens; tokens held at the dual-clip bound c·A (A < 0)
    "ppo_clip": {
        "actor/pg_clipfrac": _sum("clip_frac_low", "clip_frac_high"),
        "actor/pg_clipfrac_lower": lambda get: (
            get("clip_frac_dual") if get("clip_frac_dual") is not None else _zero(get)
        ),
    },
    # gspo (GSPO-token): clipped tokens; pg_clipfrac_lower is always 0 in verl
    "gspo_token": {"actor/pg_clipfrac": _sum("clip_frac_low", "clip_frac_high"), "actor/pg_clipfrac_lower": _zero},
    "gspo": {"actor/pg_clipfrac": _sum("clip_frac_low", "clip_frac_high"), "actor/pg_clipfrac_lower": _zero},
    "cispo": {"actor/pg_clipfrac": lambda get: get("clip_frac"), "actor/pg_clipfrac_lower": _zero},
    "sapo": {"actor/pg_clipfrac": _zero, "actor/pg_clipfrac_lower": _zero},  # verl reports 0 for both
    # dppo: tokens masked out of the update; kept tokens whose ratio exceeds clip_ratio_c
    "dppo_tv": {
        "actor/pg_clipfrac": lambda get: get("mask_frac"),
        "actor/pg_clipfrac_lower": lambda get: get("trunc_frac"),
    },
    "dppo_kl": {
        "actor/pg_clipfrac": lambda get: get("mask_frac"),
        "actor/pg_clipfrac_lower": lambda get: get("trunc_frac"),
    },
    "clip_cov": {"actor/pg_clipfrac": lambda get: get("cov_cut_frac")},  # tokens whose gradient the covariance cut
    "kl_cov": {"actor/ppo_kl": lambda get: get("abs_kl")},  # verl's kl_cov reports mean |log-ratio| as ppo_kl
    # geo_mean: clipped tokens with A > 0 / with A < 0
    "gmpo": {
        "actor/pg_clipfrac": lambda get: get("clip_frac_high"),
        "actor/pg_clipfrac_lower": lambda get: get("clip_frac_low"),
    },
}


def verl_metrics(update_gate: str, found: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """verl's own metric keys for the update gate, with the definitions of the verl loss mode it reproduces (means over
    the micro-batch's action tokens, like verl's ``masked_mean``), so a dashboard built on verl's keys keeps working
    after ``loss_mode=lossplug``: ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower`` and, for ``kl_cov``,
    ``actor/ppo_kl`` (see :data:`VERL_METRICS`). A gate verl has no loss for adds none."""

    def get(name: str) -> Tensor | None:
        return found.get("update/approx_kl" if name == "@approx_kl" else f"{update_gate}/{name}")

    out = {}
    for key, compute in VERL_METRICS.get(update_gate, {}).items():
        value = compute(get)
        if value is not None:
            out[key] = value
    return out


def verl_loss_metrics(metric_tensors: Mapping[str, Tensor], update_gate: str) -> dict[str, float]:
    """The metrics verl's policy loss returns, as floats (one device→host transfer): verl's keys (above) and
    lossplug's own under ``actor/lossplug/``."""
    found = dict(metric_tensors)
    found.pop("loss", None)
    # verl's ppo_kl is lossplug's update/approx_kl: mean over the actions of old_log_prob − log_prob
    approx_kl = found.pop("update/approx_kl", None)
    tensors = {} if approx_kl is None else {"actor/ppo_kl": approx_kl}
    # lossplug's engine/approx_kl is verl's rollout_corr/kl (mean of rollout − old log-probs); under the actor's
    # prefix, beside the trainer's own whole-batch value rather than in its place
    engine_kl = found.pop("engine/approx_kl", None)
    if engine_kl is not None:
        tensors["actor/rollout_corr/kl"] = engine_kl
    gate_metrics = found if approx_kl is None else {**found, "update/approx_kl": approx_kl}
    tensors.update(verl_metrics(update_gate, gate_metrics))
    tensors.update({f"actor/lossplug/{k}": v for k, v in found.items()})
    return metric_floats(tensors)
