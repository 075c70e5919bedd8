"""CISPO: a clipped, detached importance weight times the policy log-prob (MiniMax-M1, arXiv:2506.13585).

Per action token, with ``r = exp(logp − old_logp)`` (log-ratio clamped to ``± log_ratio_clamp`` unless that is
``None``)::

    J = sg(clip(r, lower, upper)) · A · logp        ∂J/∂logp = clip(r, lower, upper) · A

``lower = 1 − eps_low`` (no lower bound if ``eps_low`` is ``None``); ``upper = 1 + eps_high`` or, with
``ratio_max``, the absolute cap ``ratio_max``. Unlike PPO's clip no token's gradient is dropped: the clip only
saturates the weight, so every action token stays ``active``.

The two references differ, and both are reproduced exactly:

* verl ``compute_policy_loss_cispo``: ``clamp(r, 1 − clip_ratio_low, 1 + clip_ratio_high)`` with the log-ratio
  clamped to ±20 → ``{name: cispo, eps_low: 0.2, eps_high: 0.2}`` (the defaults, also the seed's example);
* TRL ``loss_type="cispo"``: ``clamp(r, max=epsilon_high)``, an absolute upper cap only (ScaleRL's ε_max, TRL
  recommends 5.0), no log-ratio clamp → ``{name: cispo, eps_low: null, ratio_max: 5.0, log_ratio_clamp: null}``.
  MiniMax-M1 itself sets no lower bound either.

Without a log-ratio clamp the weight stays finite anyway: an upper bound is mandatory, and ``clamp(inf, max=c) = c``.

Detach/gradient contract: the coefficient ``clip(r)`` is explicitly ``.detach()``-ed — gradient flows through the
``logp`` factor only (and ``old_logp``/the advantage are constants).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.ops import clamp_exact, count_on_actions


class CISPOParams(lossplug.Params):
    eps_low: Optional[float] = Field(0.2, gt=0, le=1,
                                     description="weights below 1 − eps_low are raised to it; null: no lower bound "
                                                 "(TRL, MiniMax-M1)")
    eps_high: Optional[float] = Field(0.2, gt=0,
                                      description="weights above 1 + eps_high are capped (verl); null when ratio_max "
                                                  "is used")
    ratio_max: Optional[float] = Field(None, gt=0,
                                       description="absolute cap on the weight instead of 1 + eps_high (TRL's "
                                                   "epsilon_high for cispo, e.g. 5.0)")
    log_ratio_clamp: Optional[float] = Field(20.0, gt=0, le=80,
                                             description="the log-ratio is clamped to ± this before exp (verl: 20); "
                                                         "null: no clamp (TRL)")

    @model_validator(mode="before")
    @classmethod
    def _one_upper_bound(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("ratio_max") is not None:
            if data.get("eps_high") is not None:
                raise ValueError("give either eps_high (cap 1 + eps_high, verl) or ratio_max (absolute cap, TRL), "
                                 "not both")
            data = {**data, "eps_high": None}
        return data

    @model_validator(mode="after")
    def _has_upper_bound(self) -> "CISPOParams":
        if self.eps_high is None and self.ratio_max is None:
            raise ValueError("cispo needs an upper bound on the weight: set eps_high or ratio_max")
        return self

    @property
    def upper(self) -> float:
        return self.ratio_max if self.ratio_max is not None else 1 + self.eps_high

    @property
    def lower(self) -> Optional[float]:
        return None if self.eps_low is None else 1 - self.eps_low


@lossplug.gate("cispo", params=CISPOParams, requires=("old_logp",))
def cispo(inp: lossplug.GateInput, p: CISPOParams) -> lossplug.GateOutput:
    """CISPO: sg(clip(r, 1−eps_low, 1+eps_high or ratio_max))·A·logp; every token keeps its gradient."""
    adv = inp.broadcast_advantage()  # × logp, which is 0 off the actions
    with torch.no_grad():
        log_ratio = inp.update_log_ratio().detach()
        if p.log_ratio_clamp is not None:
            log_ratio = clamp_exact(log_ratio, -p.log_ratio_clamp, p.log_ratio_clamp)
        ratio = log_ratio.exp()
        coefficient = ratio.clamp(min=p.lower, max=p.upper)
    if not inp.metrics:
        return lossplug.GateOutput(objective=coefficient.detach() * adv * inp.logp)
    with torch.no_grad():
        mask = inp.mask
        n = inp.lengths.sum().clamp(min=1)
        # off the actions r = exp(0) = 1: never below lower (< 1); above upper only for a cap below 1
        low = torch.count_nonzero(ratio < p.lower) if p.lower is not None else n.new_zeros(())
        high = count_on_actions(ratio > p.upper, mask, p.upper >= 1)
        # the two sides are disjoint (lower < 1 ≤ upper, or no lower bound): their sum is the clipped count
        clip = low + high if p.lower is None or p.lower < p.upper else torch.count_nonzero(
            ((ratio < p.lower) | (ratio > p.upper)) & mask)
        metrics = {"clip_frac": clip / n, "clip_frac_low": low / n, "clip_frac_high": high / n}
    objective = coefficient.detach() * adv * inp.logp
    return lossplug.GateOutput(objective=objective, active=mask, metrics=metrics)
