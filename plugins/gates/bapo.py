"""BAPO (arXiv:2510.18927; WooooDyy/BAPO's ``compute_policy_loss_bapo``): PPO's clip with bounds ``[c_low, c_high]``
searched per micro-batch, in steps, until the positive-advantage tokens' contribution is ``target`` × the negative.

With ``r = exp(clamp(logp − old_logp, ±20))`` and advantage ``A``, the contributions at bounds ``(l, h)`` are taken
over the micro-batch's action tokens (pooled over ``peers``, below)::

    e_t = min(r_t, h)·A_t  if A_t ≥ 0,   max(r_t, l)·A_t  if A_t < 0
    P(l, h) = Σ_t max(e_t, 0),   N(l, h) = Σ_t max(−e_t, 0)
    ρ(l, h) = ∞ if N ≤ 0,   else P / (N + eps)

The search starts at ``(lower_start, upper_start)``; while ``ρ < target`` it raises the lower bound by
``lower_step`` (capped at ``lower_max``), and once that is exhausted the upper bound by ``upper_step`` (capped at
``upper_max``), stopping at the first pair with ``ρ ≥ target`` — or at ``(lower_max, upper_max)``. The steps
accumulate in Python floats as the reference does (``0.6 + 0.05 + 0.05 …``), and a NaN ``ρ`` stops the search as
its ``ρ < target`` does. The objective is then PPO's with those bounds and verl's dual clip::

    J = min(r·A, clip(r, c_low, c_high)·A),   J = max(J, c·A) where A < 0

The bounds are explicit ratio bounds (0.6, 1.2), not ``1 ± ε`` (the reference's current convention).

As the reference computes it, ``ρ`` is a ratio of the clipped surrogate's *values*: raising ``c_low`` raises the
negative tokens' ``max(r, c_low)·|A|``, so ``ρ`` never grows along the lower range — a search that does not stop at
the start always takes the lower bound to ``lower_max`` (the negative tokens below it lose their gradient) and then
stops inside the upper range or at its end. lossplug keeps that behaviour (it is the reference's loss). The bounds carry
no gradient; every candidate pair is evaluated in one tensor pass and the first to satisfy is picked on the device
(no host synchronisation; the reference evaluates them one by one with ``.item()``).

**Population.** The reference's policy loss runs per micro-batch (verl's ``dp_actor`` calls it once per micro-batch
of each mini-batch) and, since its commit 3b8389c, all-reduces ``P`` and ``N`` over the data-parallel ranks before
each comparison, so every rank picks the same bounds. lossplug does the same: the statistic is over the gate input's
micro-batch, with ``P`` and ``N`` summed over ``inp.peers`` (float32 sums, as the reference's ``all_reduce``) —
the verl adapter passes verl's default process group, the TRL adapter every process. Under gradient accumulation
each micro-batch picks its own bounds: splitting a step into other micro-batches changes the loss (the reference's
too), so the gate is not additive over micro-batches. A statistic over the whole optimizer step is not available
inside a loss seam (later micro-batches' ratios do not exist yet).

Defaults: the paper's ``ρ0 = 0.5`` and ranges ``[a⁻, b⁻] = [0.6, 0.9]``, ``[a⁺, b⁺] = [1.2, 3.0]`` (the
reference's README), steps 0.05 (its ``BAPOPolicyLossConfig``), ``c = 3`` (verl's ``clip_ratio_c``, which the
reference reads), ``eps = 1e-8``. Metrics: the chosen ``clip_low`` / ``clip_high`` and, at them, ``pos_contrib`` /
``neg_contrib`` — ``P`` and ``N`` as pooled (the reference logs ``ρ = P/(N + eps)``, which is ∞ without negative
tokens; a metric stays finite), ``clip_frac_low`` / ``clip_frac_high`` / ``clip_frac_dual`` as ``ppo_clip``'s.

Reference: WooooDyy/BAPO (commit 7287044444d5d578529ea464b45f090a36e8da3a) ``recipe/bapo/policy_loss.py``
(``_compute_effective_advantage``, ``compute_policy_loss_bapo``) and ``recipe/bapo/config.py``
(``BAPOPolicyLossConfig``).

>>> import torch, lossplug
>>> r = torch.tensor([[0.5, 0.7, 1.0, 1.5]], dtype=torch.float64)
>>> half = torch.full((1, 4), 0.5, dtype=torch.float64)
>>> batch = lossplug.PolicyBatch(logp=(half * r).log(), old_logp=half.log(),
...                              advantage=torch.tensor([[-1.0, -1.0, 1.0, 1.0]], dtype=torch.float64),
...                              action_mask=torch.ones(1, 4, dtype=torch.bool))
>>> plugin = lossplug.registry().plugins["gate"]["bapo"]
>>> out = plugin(lossplug.GateInput.from_batch(batch), plugin.params(target=1.5))
>>> # P = 1 + min(1.5, h), N = max(0.5, l) + max(0.7, l): (0.6, 1.2) gives 2.2/1.3 ≥ 1.5 at once
>>> [round(float(out.metrics[k]()), 4) for k in ("clip_low", "clip_high", "pos_contrib", "neg_contrib")]
[0.6, 1.2, 2.2, 1.3]
>>> out = plugin(lossplug.GateInput.from_batch(batch), plugin.params(target=1.9))
>>> # the lower bound rises to 0.9 (N = 1.8, ρ = 1.22), then the upper to 3.0 (P stops at 2.5 once h ≥ 1.5):
>>> # ρ = 1.39 < 1.9 all the way, so the search ends at the last pair
>>> [round(float(out.metrics[k]()), 4) for k in ("clip_low", "clip_high", "pos_contrib", "neg_contrib")]
[0.9, 3.0, 2.5, 1.8]

Paper: Xi et al., 2025, *BAPO: Stabilizing Off-Policy Reinforcement Learning for LLMs via Balanced Policy
Optimization with Adaptive Clipping*, arXiv:2510.18927.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.ops import clamp_exact

Tensor = torch.Tensor


class BAPOParams(lossplug.Params):
    target: float = Field(
        0.5,
        ge=0,
        allow_inf_nan=False,
        description="ρ0: the bounds move until the positive tokens' contribution is at least target × the negative "
        "tokens' (the reference's adv_ratio_target; paper: 0.5)",
    )
    lower_start: float = Field(0.6, gt=0, le=1, description="a⁻: the lower ratio bound the search starts from")
    lower_max: float = Field(0.9, gt=0, le=1, description="b⁻: the highest the lower bound may rise")
    lower_step: float = Field(0.05, ge=0, allow_inf_nan=False, description="δ⁻: the lower bound's step (0: fixed)")
    upper_start: float = Field(1.2, ge=1, allow_inf_nan=False, description="a⁺: the upper bound the search starts from")
    upper_max: float = Field(3.0, ge=1, allow_inf_nan=False, description="b⁺: the highest the upper bound may rise")
    upper_step: float = Field(0.05, ge=0, allow_inf_nan=False, description="δ⁺: the upper bound's step (0: fixed)")
    dual_clip_c: float = Field(3.0, gt=1, description="dual-clip bound c·A for A < 0 (verl's clip_ratio_c)")
    eps: float = Field(
        1e-8, ge=0, allow_inf_nan=False, description="added to the negative contribution in ρ = P/(N+eps)"
    )
    log_ratio_clamp: float = Field(20.0, gt=0, description="the log-ratio is clamped to ± this before exp")

    @model_validator(mode="after")
    def _ranges(self) -> BAPOParams:
        for side in ("lower", "upper"):
            start, top = getattr(self, f"{side}_start"), getattr(self, f"{side}_max")
            if top < start:
                raise ValueError(f"{side}_max ({top}) must not be below {side}_start ({start}): the search only rises")
        return self


def bound_schedule(p: BAPOParams) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The candidate ``(lows, highs)`` in the order the reference tries them: the start, the lower bound's steps,
    then the upper bound's at the final lower bound (steps accumulated in Python floats, as the reference)."""
    low, high = p.lower_start, p.upper_start
    lows, highs = [low], [high]
    while low < p.lower_max and p.lower_step > 0:
        low = min(low + p.lower_step, p.lower_max)
        lows.append(low)
        highs.append(high)
    while high < p.upper_max and p.upper_step > 0:
        high = min(high + p.upper_step, p.upper_max)
        lows.append(low)
        highs.append(high)
    return tuple(lows), tuple(highs)


def contributions(ratio: Tensor, adv: Tensor, lows: Tensor, highs: Tensor) -> Tensor:
    """``[2, K]``: the positive and negative contributions ``P``, ``N`` at each of the ``K`` candidate bounds (``adv`` is
    0 off the actions, so those tokens add nothing)."""
    shape = (-1,) + (1,) * ratio.ndim
    effective = (
        torch.where(adv >= 0, torch.minimum(ratio, highs.view(shape)), torch.maximum(ratio, lows.view(shape))) * adv
    )
    dims = tuple(range(1, effective.ndim))
    return torch.stack([effective.clamp(min=0).sum(dims), (-effective.clamp(max=0)).sum(dims)])


def choose_bounds(inp: lossplug.GateInput, ratio: Tensor, p: BAPOParams) -> tuple[Tensor, Tensor, Tensor]:
    """The chosen ``(c_low, c_high)`` as 0-d tensors — the first candidate with ``ρ ≥ target`` (pooled over
    ``inp.peers``), else the last — and ``[P, N]`` there."""
    lows_list, highs_list = bound_schedule(p)
    with torch.no_grad():
        lows = torch.tensor(lows_list, dtype=ratio.dtype, device=ratio.device)
        highs = torch.tensor(highs_list, dtype=ratio.dtype, device=ratio.device)
        adv = inp.advantage
        stats = contributions(ratio.detach(), adv, lows, highs)
        if not inp.peers.local:  # every rank's micro-batch: the reference's all_reduce of float32 sums
            stats = inp.peers.sum(stats.float()).to(ratio.dtype)
        positive, negative = stats
        balance = torch.where(negative <= 0, torch.inf, positive / (negative + p.eps))
        short = balance < p.target  # NaN is not short: it stops the search, as the reference's `while ρ < target`
        first = torch.where(short.all(), len(lows_list) - 1, (~short).int().argmax())
        pick = first.reshape(1)  # (indexing with a 0-d tensor would read it on the host)
    return lows.index_select(0, pick)[0], highs.index_select(0, pick)[0], stats.index_select(1, pick)[:, 0]


@lossplug.gate("bapo", params=BAPOParams, requires=("old_logp",), pools=True)
def bapo(inp: lossplug.GateInput, p: BAPOParams) -> lossplug.GateOutput:
    """BAPO: PPO clip min(r·A, clip(r, c_low, c_high)·A) (dual clip c·A for A < 0) with the bounds raised in steps
    until the positive tokens' clipped contribution is ≥ target × the negative tokens' (pooled over the peers)."""
    adv = inp.broadcast_advantage()
    ratio = clamp_exact(inp.update_log_ratio(), -p.log_ratio_clamp, p.log_ratio_clamp).exp()
    low, high, contributions_there = choose_bounds(inp, ratio, p)
    clipped = torch.clamp(ratio, low, high) * adv
    surrogate = torch.minimum(ratio * adv, clipped)
    bound = p.dual_clip_c * adv
    objective = torch.where(adv < 0, torch.maximum(surrogate, bound), surrogate)

    # Off the actions r = 1 exactly, inside [c_low, c_high] (c_low ≤ 1 ≤ c_high) and never past the dual bound.
    @functools.cache
    def cut() -> dict[str, Tensor]:
        return {
            "clip_frac_low": (ratio < low) & (adv < 0),
            "clip_frac_high": (ratio > high) & (adv > 0),
            "clip_frac_dual": (surrogate < bound) & (adv < 0),
        }

    def fraction(name: str) -> Tensor:
        return inp.token_fraction(cut()[name], false_off_actions=True)

    def active() -> Tensor:
        hits = cut()
        return ~(hits["clip_frac_low"] | hits["clip_frac_high"] | hits["clip_frac_dual"])

    names = ("clip_frac_low", "clip_frac_high", "clip_frac_dual")
    metrics: dict[str, Callable[[], Tensor]] = {name: functools.partial(fraction, name) for name in names}
    metrics.update(
        clip_low=lambda: low,
        clip_high=lambda: high,
        pos_contrib=lambda: contributions_there[0],
        neg_contrib=lambda: contributions_there[1],
    )
    return lossplug.GateOutput(objective=objective, metrics=metrics, active=active)
