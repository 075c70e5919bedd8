"""ASPO (arXiv:2510.06062; Archer2.0's ``compute_policy_loss_archer``): positive-advantage tokens' ratio flipped to
``1/r`` (value ``A/p``, gradient ``A·∇logπ/r``), PPO's lower clip for negative ones, a soft dual clip ``c·A·logπ``.

With ``r = exp(clamp(logp − old_logp, ±20))``, advantage ``A`` and per-token bounds ``ε_low``, ``ε_high`` (below),
the objective per action token (to maximise; Archer2.0's loss is its negative) is::

    A < 0:  n = max(r, 1 − ε_low)                         (no upper clip on this side)
            J = c⁻·A·logp        if n > c⁻                (soft dual clip: value c⁻·A·logπ, gradient c⁻·A·∇logπ)
            J = A·n              otherwise                (PPO's lower clip: gradient A·r·∇logπ, 0 where clipped)
    A ≥ 0:  p = min(r, 1 + ε_high)                        (no lower clip on this side)
            J = c⁺·A·logp        if 1/p > c⁺, i.e. r < 1/c⁺
            J = A·(p / sg(p)) / sg(p)    otherwise        (value A/p, gradient A·∇logπ/r; 0 above 1 + ε_high)

``sg`` is stop-gradient. The flip is the detached trick of the reference code: the *value* of a positive token's
term is ``A/p`` — the flipped ratio — but its *gradient* is ``A·(1/r)·∇logπ``, the REINFORCE gradient weighted by
``π_old/π_θ`` instead of ``π_θ/π_old``, so a token whose probability already rose gets a smaller update, one that
fell a larger one, as for negative tokens (the gradient of ``A/r`` itself would point the other way). The dual clip
is *soft*: past the bound the term becomes ``c·A·logπ``, gradient ``c·A·∇logπ``, instead of PPO's constant (no
gradient); its value is ``c·A·logπ``, not ``c·A``, as the reference code computes it. A zero advantage goes to the
positive branch (``torch.where(A < 0, …)``), where every term is 0.

**Bounds.** The reference code takes them per token from the token's entropy (Archer's dual-token constraint,
which Archer2.0's actor applies with ASPO): the tokens whose entropy is at most the ``entropy_quantile``-quantile of
*their own response's* action tokens (``torch.nanquantile`` along the response, linear interpolation) get
``eps_low`` / ``eps_high`` (0.2), the others ``high_entropy_eps_low`` / ``high_entropy_eps_high`` (0.4). The split
needs the current policy's entropy (``PolicyBatch.entropy``, read without gradient); with both high-entropy bounds
null the bounds are ``eps_low`` / ``eps_high`` for every token and no entropy is read. The statistic is per
response, so splitting a batch into micro-batches changes nothing.

Defaults are the reference run: ``ε = 0.2`` for the low-entropy 80 % of each response's tokens, ``0.4`` for the
rest, ``c⁻ = c⁺ = 3`` (Archer2.0's actor passes these constants whatever its ``clip_ratio_*`` settings). Metrics:
``clip_frac_low`` (``A < 0``, ``r < 1 − ε_low``), ``clip_frac_high`` (``A ≥ 0``, ``r > 1 + ε_high``: the reference's
``pg_clipfrac_upper`` counts the zero-advantage tokens too), ``dual_frac_neg`` / ``dual_frac_pos`` — all over the
micro-batch's action tokens (the reference divides its two dual fractions by the tokens of that sign).

Paper: Wang et al., 2025, *ASPO: Asymmetric Importance Sampling Policy Optimization*, arXiv:2510.06062.

Reference: wizard-III/Archer2.0 (commit b08d963d5d65909ef1f24dba2f382006d0be33e1)
``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_archer``, called from ``verl/workers/actor/dp_actor.py``
(``use_archer_policy_loss``: the per-response entropy quantile ``token_entropy_quantile`` and the bounds above).

>>> import torch, lossplug
>>> old = torch.log(torch.tensor([[0.5, 0.5, 0.5]], dtype=torch.float64))
>>> logp = torch.log(torch.tensor([[0.55, 0.5, 0.1]], dtype=torch.float64)).requires_grad_()
>>> batch = lossplug.PolicyBatch(logp=logp, old_logp=old, advantage=torch.tensor([1.0], dtype=torch.float64),
...                              action_mask=torch.ones(1, 3, dtype=torch.bool))
>>> plugin = lossplug.registry().plugins["gate"]["aspo"]
>>> out = plugin(lossplug.GateInput.from_batch(batch), plugin.params(high_entropy_eps_low=None,
...                                                                   high_entropy_eps_high=None))
>>> [round(v, 4) for v in out.objective[0].tolist()]      # 1/r = 0.9091, 1; r = 0.2 < 1/3: 3·A·logπ
[0.9091, 1.0, -6.9078]
>>> out.objective.sum().backward()
>>> [round(v, 4) for v in logp.grad[0].tolist()]          # A/r, A, c⁺·A
[0.9091, 1.0, 3.0]
"""

from __future__ import annotations

import functools
from typing import cast

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.ops import clamp_exact

Tensor = torch.Tensor


class ASPOParams(lossplug.Params):
    eps_low: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="lower clip of negative-advantage tokens: r below 1 − eps_low is cut (the "
        "low-entropy tokens' when the entropy split is on)",
    )
    eps_high: float = Field(
        0.2,
        gt=0,
        description="upper clip of positive-advantage tokens: r above 1 + eps_high is cut (the "
        "low-entropy tokens' when the entropy split is on)",
    )
    high_entropy_eps_low: float | None = Field(
        0.4,
        gt=0,
        lt=1,
        description="eps_low of the tokens above their response's entropy quantile (null, with "
        "high_entropy_eps_high null: no entropy split)",
    )
    high_entropy_eps_high: float | None = Field(
        0.4,
        gt=0,
        description="eps_high of the tokens above their response's entropy quantile (null, with "
        "high_entropy_eps_low null: no entropy split)",
    )
    entropy_quantile: float = Field(
        0.8,
        ge=0,
        le=1,
        description="the per-response entropy quantile that splits the tokens (Archer2.0's "
        "token_entropy_quantile): at most it takes eps_low/eps_high, above it the high-entropy bounds",
    )
    dual_clip_c: float = Field(
        3.0, gt=1, description="c⁻: a negative-advantage token whose max(r, 1 − ε_low) exceeds it gets c⁻·A·logπ"
    )
    positive_dual_clip_c: float = Field(
        3.0,
        gt=1,
        description="c⁺: a positive-advantage token whose flipped ratio 1/min(r, 1 + ε_high) exceeds it gets c⁺·A·logπ",
    )
    log_ratio_clamp: float = Field(20.0, gt=0, description="the log-ratio is clamped to ± this before exp")

    @model_validator(mode="after")
    def _split_both_or_neither(self) -> ASPOParams:
        if (self.high_entropy_eps_low is None) != (self.high_entropy_eps_high is None):
            raise ValueError(
                "high_entropy_eps_low and high_entropy_eps_high: set both (the entropy split) or neither (one pair "
                f"of bounds), got {self.high_entropy_eps_low!r} and {self.high_entropy_eps_high!r}"
            )
        return self

    @property
    def entropy_split(self) -> bool:
        return self.high_entropy_eps_low is not None


def low_entropy_tokens(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """``[B, T]`` bool: the action tokens whose entropy is at most the ``quantile``-quantile of their own response's
    action-token entropies (``torch.nanquantile`` along the response, as the reference); False off the actions."""
    masked = torch.where(mask, entropy.detach(), torch.nan)
    threshold = torch.nanquantile(masked, quantile, dim=-1, keepdim=True)
    return (masked <= threshold) & mask


def _bounds(inp: lossplug.GateInput, p: ASPOParams) -> tuple[Tensor | float, Tensor | float]:
    """The ratio bounds ``(1 − ε_low, 1 + ε_high)``: floats without the entropy split, else ``[B, T]`` tensors chosen
    per token. Each bound is computed in Python floats and rounded once to the compute dtype, as the reference's
    ``torch.clamp(ratio, min=1 - 0.2)``."""
    if not p.entropy_split:
        return 1 - p.eps_low, 1 + p.eps_high
    with torch.no_grad():
        low = low_entropy_tokens(cast(Tensor, inp.entropy), inp.mask, p.entropy_quantile)
        shape, dtype, device = inp.mask.shape, inp.compute_dtype, inp.mask.device
        lower = torch.full(shape, 1 - cast(float, p.high_entropy_eps_low), dtype=dtype, device=device)
        upper = torch.full(shape, 1 + cast(float, p.high_entropy_eps_high), dtype=dtype, device=device)
    return lower.masked_fill_(low, 1 - p.eps_low), upper.masked_fill_(low, 1 + p.eps_high)


def _requires(p: ASPOParams) -> tuple[str, ...]:
    return ("old_logp", "entropy") if p.entropy_split else ("old_logp",)


@lossplug.gate("aspo", params=ASPOParams, requires=_requires)
def aspo(inp: lossplug.GateInput, p: ASPOParams) -> lossplug.GateOutput:
    """ASPO: A·(p/sg(p))/sg(p) with p = min(r, 1+ε_high) for A ≥ 0 (value A/p, gradient A·∇logπ/r), PPO's
    A·max(r, 1−ε_low) for A < 0, and the soft dual clip c·A·logπ past c (A < 0) or past 1/p > c (A ≥ 0)."""
    adv = inp.broadcast_advantage()
    ratio = clamp_exact(inp.update_log_ratio(), -p.log_ratio_clamp, p.log_ratio_clamp).exp()
    lower, upper = _bounds(inp, p)

    negative_ratio = torch.maximum(ratio, lower) if isinstance(lower, Tensor) else ratio.clamp(min=lower)
    positive_ratio = torch.minimum(ratio, upper) if isinstance(upper, Tensor) else ratio.clamp(max=upper)
    with torch.no_grad():
        negative_dual = negative_ratio > p.dual_clip_c
        positive_dual = positive_ratio.reciprocal() > p.positive_dual_clip_c
    # the flip: the value is A/p, the gradient A·∇p/p² = A·∇logπ/r (p = r below the clip, a constant above it)
    held = positive_ratio.detach()
    flipped = positive_ratio / held / held
    negative = torch.where(negative_dual, (p.dual_clip_c * adv) * inp.logp, adv * negative_ratio)
    positive = torch.where(positive_dual, (p.positive_dual_clip_c * adv) * inp.logp, adv * flipped)
    objective = torch.where(adv < 0, negative, positive)

    # Off the actions r = exp(0) = 1 exactly: inside every bound (ε > 0, c > 1), so no hit there.
    @functools.cache
    def hits() -> dict[str, Tensor]:
        with torch.no_grad():
            return {
                "clip_frac_low": (ratio < lower) & (adv < 0),
                "clip_frac_high": (ratio > upper) & (adv >= 0),
                "dual_frac_neg": negative_dual & (adv < 0),
                "dual_frac_pos": positive_dual & (adv > 0),
            }

    def fraction(name: str) -> Tensor:
        return inp.token_fraction(hits()[name], false_off_actions=True)

    def active() -> Tensor:
        return ~(hits()["clip_frac_low"] | hits()["clip_frac_high"])

    names = ("clip_frac_low", "clip_frac_high", "dual_frac_neg", "dual_frac_pos")
    metrics = {name: functools.partial(fraction, name) for name in names}
    return lossplug.GateOutput(objective=objective, metrics=metrics, active=active)
