"""verl ``algorithm.rollout_correction`` → lossplug correction gates.

Interface (used by :func:`lossplug.adapters.verl.equivalent.verl_equivalent`)::

    correction_gates(rollout_correction: Mapping[str, Any]) -> list[dict[str, Any]]   # correction gate specs

``rollout_correction`` is verl's ``algorithm.rollout_correction`` config as a plain dict (``rollout_is``,
``rollout_is_threshold``, ``rollout_is_batch_normalize``, ``rollout_rs``, ``rollout_rs_threshold``, ...). An empty
list when nothing is switched on.

Mapping (decoupled mode, ``bypass_mode: false``: verl computes the correction once per rollout batch in the driver,
from ``old_log_probs`` against ``rollout_log_probs``; lossplug's ``old_logp`` / ``behavior_logp``)::

    rollout_is: token,    rollout_is_threshold: u          → {name: tis, cap: u}
    rollout_is: sequence, rollout_is_threshold: u          → {name: tis_seq, cap: u}
    rollout_is: token,    rollout_is_threshold: "l_u"      → {name: icepop, low: l, high: u}
    rollout_is: sequence, rollout_is_threshold: "l_u"      → {name: icepop_seq, low: l, high: u}
    rollout_is_batch_normalize: true                       → batch_normalize: true on that gate (whole_batch=True
                                                             only; see below)
    rollout_rs: "<opt>[,<opt>…]", rollout_rs_threshold: s  → {name: rollout_rs, options: "<opt>,…", threshold: s}
    (anything switched on)                                 → {name: offpolicy_metrics} (verl's rollout_corr/ metrics)

``rollout_is: null`` or ``rollout_is_threshold: null`` (verl then computes no weights) and ``rollout_rs: null`` give
no gate. ``bypass_mode: true`` gives none either: verl then computes no driver-side correction — the policy loss
(``loss_mode=bypass_mode``, mapped with the policy losses) applies the options itself.

Refused (a :class:`~lossplug.LossplugError` naming the setting), because a recipe would not reproduce verl exactly:

* ``rollout_is_batch_normalize: true`` unless ``whole_batch=True`` — verl divides by the mean weight of the whole
  rollout batch (before its split into mini- and micro-batches); a gate normalises over the batch it is given. Say
  ``whole_batch=True`` when every ``policy_loss`` call sees one whole rollout batch, or compute the weights once per
  rollout batch with :func:`lossplug.plugins.gates.whole_batch_weight` and pass them as
  ``policy_loss(weight=...)``.
* ``rollout_rs`` under ``loss_agg_mode: token-mean`` (verl's default, assumed when ``loss_agg_mode`` is not given),
  and token-level options (``token_k*``) under ``seq-mean-token-mean`` — verl removes rejected tokens from the loss
  denominators; a 0 weight leaves them in the population. ``token-sum``, ``seq-mean-token-sum(-norm)`` and
  response-level options under ``seq-mean-token-mean`` are exact (verl's ``global_batch_size`` counts rejected
  responses too). Otherwise apply the rejection to the batch as verl's driver does:
  :func:`~lossplug.plugins.gates.whole_batch_weight`'s ``kept_mask`` as the action mask and the
  ``Normalizer``'s population.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lossplug.adapters.verl.equivalent.keys import unknown_keys, valid_keys
from lossplug.adapters.verl.equivalent.settings import ROLLOUT_CORRECTION_DEFAULTS
from lossplug.contracts import LossplugError
from lossplug.plugins.gates.rollout_rejection import parse_options, parse_thresholds

#: verl's ``RolloutCorrectionConfig`` fields with the defaults of its ``algorithm/rollout_correction.yaml``
DEFAULTS: dict[str, Any] = ROLLOUT_CORRECTION_DEFAULTS
#: verl's ``loss_agg_mode`` values under which a 0/1 rejection weight reproduces verl's masked denominators
EXACT_REJECTION_MODES = {
    "token-sum": "all",
    "seq-mean-token-sum": "all",
    "seq-mean-token-sum-norm": "all",
    "seq-mean-token-mean": "sequence",  # response-level options only
    "token-mean": "none",
}
WHERE = "algorithm.rollout_correction"


def _error(setting: str, message: str) -> LossplugError:
    return LossplugError(f"{WHERE}.{setting}: {message}")


def parse_is_threshold(spec: Any) -> tuple[float, float | None]:
    """verl's ``_parse_rollout_is_threshold``: ``(upper, lower)``; ``lower`` is None for TIS (a single value)."""
    setting = "rollout_is_threshold"
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise _error(setting, f"must be a number or a 'lower_upper' string, got {spec!r}")
    lower: float | None = None
    try:
        if isinstance(spec, str):
            text = spec.strip()
            if not text:
                raise ValueError("empty")
            if "_" in text:
                low_text, up_text = text.split("_", 1)
                lower, upper = float(low_text), float(up_text)
            else:
                upper = float(text)
        else:
            upper = float(spec)
    except ValueError:
        raise _error(setting, f"cannot read {spec!r} (a number, or 'lower_upper' for IcePop)") from None
    if upper <= 0:
        raise _error(setting, f"the upper bound must be positive, got {upper}")
    if lower is not None and (lower <= 0 or lower > upper):
        raise _error(setting, f"the lower bound must be positive and at most the upper one, got {spec!r}")
    return upper, lower


def correction_gates(
    rollout_correction: Mapping[str, Any],
    *,
    loss_agg_mode: str | None = None,
    whole_batch: bool = False,
    metrics: bool = True,
) -> list[dict[str, Any]]:
    """The correction gates reproducing verl's ``algorithm.rollout_correction`` (see the module docstring).

    ``loss_agg_mode``: the actor's (decides whether ``rollout_rs`` is exact; verl's default ``token-mean`` when not
    given). ``whole_batch``: every loss call sees one whole rollout batch (makes ``rollout_is_batch_normalize``
    exact). ``metrics``: add ``offpolicy_metrics`` when anything is switched on, as verl always logs them."""
    if rollout_correction is None:
        return []
    if not isinstance(rollout_correction, Mapping):
        raise LossplugError(f"{WHERE}: expected a mapping, got {type(rollout_correction).__name__}")
    source, valid = valid_keys()
    unknown = unknown_keys(rollout_correction, WHERE, valid["rollout_correction"])
    if unknown:
        raise LossplugError(f"unknown rollout-correction key (checked against {source}): {'; '.join(unknown)}")
    cfg = {**DEFAULTS, **rollout_correction}
    if cfg["loss_type"] not in ("ppo_clip", "reinforce"):
        raise _error("loss_type", f"must be 'ppo_clip' or 'reinforce', got {cfg['loss_type']!r}")
    if cfg["bypass_mode"]:
        return []  # bypass mode: no driver-side correction (the bypass_mode policy loss applies the options)

    gates: list[dict[str, Any]] = []
    importance = _importance_gate(cfg, whole_batch)
    if importance is not None:
        gates.append(importance)
    rejection = _rejection_gate(cfg, loss_agg_mode)
    if rejection is not None:
        gates.append(rejection)

    if gates and metrics:
        gates.append({"name": "offpolicy_metrics"})
    return gates


def _importance_gate(cfg: Mapping[str, Any], whole_batch: bool) -> dict[str, Any] | None:
    """``rollout_is`` / ``rollout_is_threshold`` (/ ``rollout_is_batch_normalize``) → a ``tis`` or ``icepop`` gate
    (token or sequence level); None when importance sampling is off."""
    level, threshold = cfg["rollout_is"], cfg["rollout_is_threshold"]
    if level is None or threshold is None:
        return None
    if level not in ("token", "sequence"):
        raise _error("rollout_is", f"must be 'token', 'sequence' or null, got {level!r}")
    upper, lower = parse_is_threshold(threshold)
    suffix = "_seq" if level == "sequence" else ""
    gate: dict[str, Any] = (
        {"name": f"tis{suffix}", "cap": upper}
        if lower is None
        else {"name": f"icepop{suffix}", "low": lower, "high": upper}
    )
    if cfg["rollout_is_batch_normalize"]:
        if not whole_batch:
            raise _error(
                "rollout_is_batch_normalize",
                "verl divides the weights by their mean over the whole rollout batch (in the driver, before "
                "the mini-/micro-batch split); a gate normalises over the batch it is given, so the recipe is "
                "exact only when every loss call sees one whole rollout batch (correction_gates(..., "
                "whole_batch=True)); otherwise compute the weights once per rollout batch with "
                "lossplug.plugins.gates.whole_batch_weight and pass them as "
                "policy_loss(weight=...)",
            )
        gate["batch_normalize"] = True
    return gate


def _rejection_gate(cfg: Mapping[str, Any], loss_agg_mode: str | None) -> dict[str, Any] | None:
    """``rollout_rs`` / ``rollout_rs_threshold`` → a ``rollout_rs`` gate, refused where a 0 weight is not what verl's
    removal of rejected tokens from the loss denominators does under ``loss_agg_mode``; None when rejection
    sampling is off."""
    options = cfg["rollout_rs"]
    if options is None:
        return None
    try:
        names = parse_options(options)
    except ValueError as err:
        raise _error("rollout_rs", str(err)) from None
    if cfg["rollout_rs_threshold"] is None:
        raise _error("rollout_rs_threshold", "required when rollout_rs is set (verl raises too)")
    try:
        parse_thresholds(names, cfg["rollout_rs_threshold"])
    except ValueError as err:
        raise _error("rollout_rs_threshold", str(err)) from None
    mode = "token-mean" if loss_agg_mode is None else loss_agg_mode
    exact = EXACT_REJECTION_MODES.get(mode)
    if exact is None:
        raise LossplugError(f"actor.loss_agg_mode: unknown mode {mode!r} (known: {', '.join(EXACT_REJECTION_MODES)})")
    token_options = [n for n in names if n.startswith("token_")]
    if exact == "none" or (exact == "sequence" and token_options):
        if exact == "sequence":
            what, denominator = f"the token-level option(s) {', '.join(token_options)}", "each response's count"
        else:
            what, denominator = "a rejection", "batch_num_tokens"
        raise _error(
            "rollout_rs",
            f"under loss_agg_mode={mode} verl removes rejected tokens from the loss denominators "
            f"({denominator}); {what} as a 0 weight leaves them in the population. Exact alternatives: "
            f"loss_agg_mode token-sum, "
            f"seq-mean-token-sum(-norm) (or response-level options under seq-mean-token-mean); or apply the "
            f"rejection to the batch as verl's driver does: lossplug.plugins.gates."
            f"whole_batch_weight(...).kept_mask as the action mask and the Normalizer's population",
        )
    return {"name": "rollout_rs", "options": ",".join(names), "threshold": cfg["rollout_rs_threshold"]}
