"""Rejection of responses or tokens whose engine mismatch is too large: verl's ``rollout_rs``, as one detached 0/1
correction.

With the engine log-ratio ``log ρ_t = old_logp_t − behavior_logp_t`` clamped to ``±20`` (verl's ``SAFETY_BOUND``),
three per-token divergence estimators of KL(π_behaviour ‖ π_old)::

    k1_t = −log ρ_t          k2_t = ½ (log ρ_t)²          k3_t = ρ_t − 1 − log ρ_t

Each criterion of ``options`` (verl's names, comma-chained) checks one statistic against its threshold:

* ``token_k1|k2|k3`` — per token: the token is rejected;
* ``seq_sum_k*`` (Σ_t over the response's action tokens), ``seq_mean_k*`` (that sum / L_i), ``seq_max_k2|k3``
  (max over the action tokens) — per response: the whole response is rejected.

A ``k1`` statistic is kept when ``log(lower) ≤ stat ≤ log(upper)`` (bounds on ``π_behaviour/π_old``, the threshold
``"lower_upper"``; a single value ``u`` means ``1/u_u``); a ``k2``/``k3`` statistic when ``stat ≤ upper``. A token
survives only if every criterion keeps it (verl's logical AND). The weight is ``1`` where it survives and ``0``
elsewhere, ``[B, T]``, detached: gradient flows only through the update gate's ``logp``.

``threshold`` follows verl's ``rollout_rs_threshold`` syntax: one value for every option or one per option,
comma-separated, e.g. ``options="token_k1,seq_max_k2", threshold="0.5_2.0,0.1"``.

Denominators. verl applies the rejection to ``response_mask`` in the driver, so rejected tokens also leave its loss
denominators. A 0-weight token here stays in the reduction's population. The two agree exactly under
``token_sum``, ``sequence_sum`` and ``fixed`` (verl's ``global_batch_size`` counts every response, rejected ones
too), and under ``response`` for response-level criteria (a kept response keeps all its tokens). Under ``token``
(verl's ``batch_num_tokens`` counts the survivors) and for token-level criteria under ``response`` (each response's
own count shrinks), apply the rejection where verl does, to the batch:
:func:`lossplug.plugins.gates.whole_batch_weight`'s ``kept_mask`` becomes the action mask and the
:class:`~lossplug.Normalizer`'s population (rows left without an action token are dropped, as the verl adapter
drops them).

Metrics (verl's ``compute_rs_metrics`` under verl's names without the ``rollout_rs_`` prefix): ``masked_fraction``
(rejected action tokens), ``seq_masked_fraction`` (responses with a rejected token) and per criterion
``<option>_masked_fraction``, ``<option>_seq_masked_fraction``; at ``metrics="full"`` also ``<option>_mean``,
``_max``, ``_min``, ``_std``, ``_fraction_high``, ``_fraction_low`` and the ``_seq_*`` statistics.

Paper: Liu, Li, Fu, Wang, Liu, Shen, 2025, *When Speed Kills Stability: Demystifying RL Collapse from the
Training-Inference Mismatch*, https://richardli.xyz/rl-collapse (rejection sampling against the rollout engine).

Reference: verl 0.9.1 ``rollout_corr_helper.compute_rollout_rejection_mask`` / ``compute_rs_metrics``
(``algorithm.rollout_correction.rollout_rs``, ``rollout_rs_threshold``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.ops import clamp_exact

from . import _rollout_stats as rs

Tensor = torch.Tensor

#: verl's ``SUPPORTED_ROLLOUT_RS_OPTIONS``: the divergence statistic and its level
Option = Literal[
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
]
#: the options, in a fixed order
OPTIONS: tuple[str, ...] = get_args(Option)


@dataclass(frozen=True)
class Criterion:
    """One parsed ``rollout_rs`` option: ``scope`` token / sum / mean / max, its estimator, and its bounds as verl's
    threshold gives them (``lower`` only for k1, where both are bounds on the ratio)."""

    option: str
    scope: Literal["token", "sum", "mean", "max"]
    estimator: Literal["k1", "k2", "k3"]
    lower: float | None
    upper: float

    @property
    def low(self) -> float | None:
        """The lower bound on the statistic: ``log(lower)`` for k1 (the statistic is the log-ratio), else none."""
        return None if self.lower is None else math.log(self.lower)

    @property
    def high(self) -> float:
        """The upper bound on the statistic: ``log(upper)`` for k1, the bound itself for k2/k3."""
        return math.log(self.upper) if self.estimator == "k1" else self.upper


def parse_options(options: str) -> tuple[str, ...]:
    """verl's ``rollout_rs`` string → the options, in order, duplicates dropped."""
    if not isinstance(options, str):
        raise ValueError(f"options must be a comma-separated string of {', '.join(OPTIONS)}, got {options!r}")
    names = [o.strip() for o in options.split(",") if o.strip()]
    if not names:
        raise ValueError("options must name at least one criterion")
    unknown = [n for n in names if n not in OPTIONS]
    if unknown:
        raise ValueError(f"unknown rollout_rs option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}")
    return tuple(dict.fromkeys(names))


def parse_thresholds(options: tuple[str, ...], threshold: str | float) -> tuple[Criterion, ...]:
    """verl's ``rollout_rs_threshold`` for these options (``_parse_rollout_rs_thresholds``, same rules)."""
    if isinstance(threshold, bool) or not isinstance(threshold, (str, int, float)):
        raise ValueError(f"threshold must be a number or a string, got {threshold!r}")
    specs = (
        [str(threshold)]
        if not isinstance(threshold, str)
        else [part.strip() for part in threshold.split(",") if part.strip()]
    )
    if not specs:
        raise ValueError("threshold must contain at least one value")
    if len(specs) not in (1, len(options)):
        raise ValueError(
            f"threshold gives {len(specs)} values for {len(options)} options: give one value shared by every "
            f"option or exactly one per option"
        )
    if len(specs) == 1:
        specs = specs * len(options)
    out = []
    for option, spec in zip(options, specs, strict=True):
        scope_name, estimator = option.rsplit("_", 1)
        scope = "token" if scope_name == "token" else scope_name.split("_", 1)[1]
        try:
            if estimator == "k1":
                lower_str, upper_str = spec.split("_", 1) if "_" in spec else (str(1.0 / float(spec)), spec)
                lower, upper = float(lower_str), float(upper_str)
                if lower <= 0 or upper <= 0:
                    raise ValueError(f"bounds must be positive, got {spec!r}")
                if lower > upper:
                    raise ValueError(f"lower bound must not exceed the upper one, got {spec!r}")
                out.append(Criterion(option, scope, estimator, lower, upper))  # type: ignore[arg-type]
            else:
                if "_" in spec:
                    raise ValueError(f"a k2/k3 option takes one upper bound (no '_'), got {spec!r}")
                upper = float(spec)
                if upper <= 0:
                    raise ValueError(f"the bound must be positive, got {spec!r}")
                out.append(Criterion(option, scope, estimator, None, upper))  # type: ignore[arg-type]
        except ValueError as err:
            raise ValueError(f"threshold for option {option!r}: {err}") from None
    return tuple(out)


@functools.lru_cache(maxsize=128)
def criteria(options: str, threshold: str | float) -> tuple[Criterion, ...]:
    """The parsed criteria of a ``rollout_rs`` gate (cached: parsed once per parameter set)."""
    return parse_thresholds(parse_options(options), threshold)


class RolloutRSParams(lossplug.Params):
    options: str = Field(
        "token_k1",
        description=(
            "verl's rollout_rs: comma-separated criteria, every one must pass (token_k1..k3, seq_sum_k1..k3, "
            "seq_mean_k1..k3, seq_max_k2, seq_max_k3)"
        ),
    )
    threshold: str | float = Field(
        2.0,
        description=(
            "verl's rollout_rs_threshold: one value for every option or one per option, comma-separated; a k1 "
            "option takes 'lower_upper' bounds on π_behaviour/π_old (one value u means 1/u_u), k2/k3 an upper bound"
        ),
    )

    @model_validator(mode="after")
    def _parses(self) -> RolloutRSParams:
        criteria(self.options, self.threshold)
        return self


def _statistics(log_ratio: Tensor) -> dict[str, Tensor]:
    """The per-token estimators, verl's arithmetic (0 off the actions, where the log-ratio is 0)."""
    return {
        "k1": -log_ratio,
        "k2": 0.5 * log_ratio**2,
        "k3": torch.exp(log_ratio) - 1.0 - log_ratio,
    }


def _per_response(inp: lossplug.GateInput, token_stat: Tensor, scope: str) -> Tensor:
    if scope == "sum":
        return torch.where(inp.mask, token_stat, 0).sum(-1)
    if scope == "mean":
        return rs.row_mean(inp, token_stat)
    top = torch.where(inp.mask, token_stat, float("-inf")).amax(-1)
    return torch.where(top == float("-inf"), torch.zeros_like(top), top)  # (a row without actions: 0, as verl)


def _keep(stat: Tensor, c: Criterion) -> Tensor:
    if c.low is not None:
        return (stat >= c.low) & (stat <= c.high)
    return stat <= c.high


def _criterion_metrics(
    inp: lossplug.GateInput, c: Criterion, stat: Tensor, keep: Tensor
) -> tuple[dict[str, Callable[[], Tensor]], dict[str, Callable[[], Tensor]]]:
    """verl's ``compute_rs_metrics`` and masked fractions for one criterion: (basic metrics, details).
    ``stat``/``keep``: ``[B, T]`` for a token criterion, ``[B]`` for a response criterion."""
    p = c.option
    is_k1 = c.low is not None
    low = c.low if c.low is not None else 0.0
    dtype = stat.dtype
    zero = torch.zeros((), dtype=torch.float32, device=stat.device)
    token_level = stat.ndim == 2
    # built on first use: at metrics="off" nothing here runs
    seq = functools.cache(lambda: rs.ValidRows(inp, rs.row_mean(inp, stat) if token_level else stat))

    def rejected_responses() -> Tensor:
        hit = ~keep if not token_level else (~keep & inp.mask).any(-1)
        rows = seq()
        count = torch.count_nonzero(hit & rows.valid)
        return count.to(dtype) / rows.count.clamp(min=1).to(dtype)

    metrics: dict[str, Callable[[], Tensor]] = {
        f"{p}_masked_fraction": lambda: rs.token_mean(inp, (~keep).to(dtype)),
        f"{p}_seq_masked_fraction": rejected_responses,
    }
    details: dict[str, Callable[[], Tensor]] = {f"{p}_mean": lambda: rs.token_mean(inp, stat)}
    if token_level:
        details[f"{p}_max"] = lambda: rs.token_max(inp, stat)
        details[f"{p}_min"] = lambda: rs.token_min(inp, stat)
        details[f"{p}_fraction_high"] = lambda: rs.token_fraction(inp, stat > c.high)
        details[f"{p}_fraction_low"] = (lambda: rs.token_fraction(inp, stat < low)) if is_k1 else (lambda: zero)
    else:
        details[f"{p}_max"] = lambda: seq().max()
        details[f"{p}_min"] = lambda: seq().min()
        details[f"{p}_fraction_high"] = lambda: seq().fraction(stat > c.high)
        details[f"{p}_fraction_low"] = (lambda: seq().fraction(stat < low)) if is_k1 else (lambda: zero)
    details[f"{p}_std"] = lambda: rs.clamped_std(inp, stat, low, c.high)
    details[f"{p}_seq_mean"] = lambda: seq().mean()
    details[f"{p}_seq_std"] = lambda: seq().std()
    details[f"{p}_seq_max"] = lambda: seq().max()
    details[f"{p}_seq_min"] = lambda: seq().min()
    details[f"{p}_seq_max_deviation"] = lambda: seq().abs_max()
    details[f"{p}_seq_fraction_high"] = lambda: seq().fraction(seq().values > c.high)
    if is_k1:
        details[f"{p}_seq_fraction_low"] = lambda: seq().fraction(seq().values < low)
    return metrics, details


def survivors(
    inp: lossplug.GateInput, p: RolloutRSParams
) -> tuple[Tensor, dict[str, Callable[[], Tensor]], dict[str, Callable[[], Tensor]]]:
    """``(keep [B, T], metrics, details)``: the tokens every criterion keeps (True off the actions too: the caller
    masks), and each criterion's metrics — the ``rollout_rs`` gate's weight, the ``mismatch_rejection`` filter's
    mask (one implementation)."""
    log_ratio = clamp_exact(inp.engine_log_ratio(), -rs.SAFETY_BOUND, rs.SAFETY_BOUND)
    token_stats = _statistics(log_ratio)
    keep = torch.ones_like(inp.mask)
    metrics: dict[str, Callable[[], Tensor]] = {}
    details: dict[str, Callable[[], Tensor]] = {}
    for c in criteria(p.options, p.threshold):
        if c.scope == "token":
            stat = token_stats[c.estimator]
            kept = _keep(stat, c)
            keep = keep & kept
        else:
            stat = _per_response(inp, token_stats[c.estimator], c.scope)
            kept = _keep(stat, c)
            keep = keep & kept.unsqueeze(-1)
        m, d = _criterion_metrics(inp, c, stat, kept)
        metrics.update(m)
        details.update(d)
    return keep, metrics, details


@lossplug.gate(
    "rollout_rs", params=RolloutRSParams, requires=("old_logp", "behavior_logp"), role="correction", level="token"
)
def rollout_rs(inp: lossplug.GateInput, p: RolloutRSParams) -> lossplug.GateOutput:
    """Rejection by engine mismatch (verl's rollout_rs): detached weight 1 where every criterion keeps the token or
    its response, else 0; k1 = −log ρ, k2 = ½(log ρ)², k3 = ρ − 1 − log ρ, ρ = π_old/π_behaviour, per token or
    summed / averaged / maxed over the response."""
    with torch.no_grad():
        survives, metrics, details = survivors(inp, p)
        dtype = inp.compute_dtype
        metrics["masked_fraction"] = lambda: rs.token_mean(inp, (~survives).to(dtype))
        # verl: the fraction of all rows (not only those with an action token) with a rejected action token
        metrics["seq_masked_fraction"] = lambda: (~survives & inp.mask).any(-1).float().mean()
        return lossplug.GateOutput(
            weight=survives.to(dtype).detach(), metrics=metrics, details=details, active=lambda: survives
        )
