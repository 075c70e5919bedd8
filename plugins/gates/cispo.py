"""CISPO: a clipped, detached importance weight times the policy log-prob (MiniMax-M1, arXiv:2506.13585).

Per action token, with ``r = exp(logp − old_logp)`` (log-ratio clamped to ``± log_ratio_clamp`` unless that is
``None``)::

    J = sg(clip(r, lower, upper)) · A · logp        ∂J/∂logp = clip(r, lower, upper) · A

``lower = 1 − eps_low`` (no lower bound if ``eps_low`` is ``None``; ``eps_low: 0`` is a lower bound of exactly 1,
every weight below 1 raised to 1); ``upper = 1 + eps_high`` or, with
``ratio_max``, the absolute cap ``ratio_max``. Unlike PPO's clip no token's gradient is dropped: the clip only
saturates the weight, so every action token stays ``active``.

The two references differ, and both are reproduced exactly:

* verl ``compute_policy_loss_cispo``: ``clamp(r, 1 − clip_ratio_low, 1 + clip_ratio_high)`` with the log-ratio
  clamped to ±20 → ``{name: cispo, eps_low: 0.2, eps_high: 0.2}`` (the defaults);
* TRL ``loss_type="cispo"``: ``clamp(r, max=epsilon_high)``, an absolute upper cap only (ScaleRL's ε_max, TRL
  recommends 5.0), no log-ratio clamp → ``{name: cispo, eps_low: null, ratio_max: 5.0, log_ratio_clamp: null}``.
  MiniMax-M1 itself sets no lower bound either;
* SkyRL ``compute_policy_loss_cispo`` (``policy_loss_type: cispo``): ``clamp(r, 1 − cispo_eps_clip_low,
  1 + cispo_eps_clip_high)``, the log-ratio clamped to ±20 → its defaults ``{name: cispo, eps_low: 0.0, eps_high:
  5.0}``: a weight never below 1.

``cispo_seq`` uses the sequence ratio ``s_i = exp(mean_t log r_it)`` (GSPO's) in place of ``r`` — one weight per
response, each token's gradient still through its own ``logp`` (TRL ``importance_sampling_level="sequence"``)::

    J_it = sg(clip(s_i, lower, upper)) · A_it · logp_it

Without a log-ratio clamp the weight stays finite anyway: an upper bound is mandatory, and ``clamp(inf, max=c) = c``.

Detach/gradient contract: the coefficient ``clip(r)`` is explicitly ``.detach()``-ed — gradient flows through the
``logp`` factor only (and ``old_logp``/the advantage are constants).

Paper: MiniMax, 2025, *MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention*,
arXiv:2506.13585 (CISPO); the absolute cap ``ratio_max`` as in ScaleRL (Khatri et al., 2025, arXiv:2510.13786).

Reference: verl ``compute_policy_loss_cispo``; TRL ``loss_type="cispo"`` (``importance_sampling_level`` token or
sequence); SkyRL 0.3.0 ``skyrl/backends/skyrl_train/utils/ppo_utils.py``, ``compute_policy_loss_cispo``.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.ops import clamp_exact, clamp_moved_fast, count_actions, count_moved


class CISPOParams(lossplug.Params):
    eps_low: float | None = Field(
        0.2,
        ge=0,
        le=1,
        description="weights below 1 − eps_low are raised to it (0: to 1, SkyRL's default); null: no lower bound "
        "(TRL, MiniMax-M1)",
    )
    eps_high: float | None = Field(
        0.2, gt=0, description="weights above 1 + eps_high are capped (verl); null when ratio_max is used"
    )
    ratio_max: float | None = Field(
        None,
        gt=0,
        description="absolute cap on the weight instead of 1 + eps_high (TRL's epsilon_high for cispo, e.g. 5.0)",
    )
    log_ratio_clamp: float | None = Field(
        20.0, gt=0, le=80, description="the log-ratio is clamped to ± this before exp (verl: 20); null: no clamp (TRL)"
    )

    @model_validator(mode="before")
    @classmethod
    def _one_upper_bound(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("ratio_max") is not None:
            if data.get("eps_high") is not None:
                raise ValueError(
                    "give either eps_high (cap 1 + eps_high, verl) or ratio_max (absolute cap, TRL), not both"
                )
            data = {**data, "eps_high": None}
        return data

    @model_validator(mode="after")
    def _has_upper_bound(self) -> CISPOParams:
        if self.eps_high is None and self.ratio_max is None:
            raise ValueError("cispo needs an upper bound on the weight: set eps_high or ratio_max")
        return self

    @property
    def upper(self) -> float:
        # (one of them is set: _has_upper_bound)
        return self.ratio_max if self.ratio_max is not None else 1 + cast(float, self.eps_high)

    @property
    def lower(self) -> float | None:
        return None if self.eps_low is None else 1 - self.eps_low


@lossplug.gate("cispo", params=CISPOParams, requires=("old_logp",))
def cispo(inp: lossplug.GateInput, p: CISPOParams) -> lossplug.GateOutput:
    """CISPO: sg(clip(r, 1−eps_low, 1+eps_high or ratio_max))·A·logp; every token keeps its gradient."""
    with torch.no_grad():
        log_ratio = inp.update_log_ratio().detach()
        if p.log_ratio_clamp is not None:
            log_ratio = clamp_exact(log_ratio, -p.log_ratio_clamp, p.log_ratio_clamp)
    return _cispo(inp, p, log_ratio.exp(), per_response=False)


@lossplug.gate("cispo_seq", params=CISPOParams, requires=("old_logp",), level="sequence")
def cispo_seq(inp: lossplug.GateInput, p: CISPOParams) -> lossplug.GateOutput:
    """CISPO on the sequence ratio: sg(clip(s, 1−eps_low, 1+eps_high or ratio_max))·A·logp, s = exp(mean_t log r_t).

    One weight per response, the length-normalised (geometric-mean) ratio of GSPO, saturated by the same bounds;
    each token's gradient still flows through its own ``logp`` only. TRL's ``loss_type="cispo"`` with
    ``importance_sampling_level="sequence"``: ``{name: cispo_seq, eps_low: null, ratio_max: epsilon_high,
    log_ratio_clamp: null}``.

    Paper: MiniMax, 2025, *MiniMax-M1*, arXiv:2506.13585 (CISPO); the sequence ratio of Zheng et al., 2025,
    *Group Sequence Policy Optimization*, arXiv:2507.18071.

    Reference: TRL ``GRPOTrainer._compute_loss`` (``loss_type="cispo"``, ``importance_sampling_level="sequence"``).
    """
    with torch.no_grad():
        log_ratio = inp.update_log_ratio().detach()
        # mean over each response's action tokens (0 off them), [B, 1]
        seq_log_ratio = log_ratio.sum(-1, keepdim=True) / inp.lengths.clamp(min=1).unsqueeze(-1).to(log_ratio.dtype)
        if p.log_ratio_clamp is not None:
            seq_log_ratio = seq_log_ratio.clamp(-p.log_ratio_clamp, p.log_ratio_clamp)
    return _cispo(inp, p, seq_log_ratio.exp(), per_response=True)


def _cispo(inp: lossplug.GateInput, p: CISPOParams, ratio: torch.Tensor, *, per_response: bool) -> lossplug.GateOutput:
    """The objective sg(clip(ratio))·A·logp and its cut fractions; ``ratio`` is ``[B, T]`` (1 off the actions) or a
    ``[B, 1]`` column (counted once per action token of its response)."""
    adv = inp.broadcast_advantage()  # × logp, which is 0 off the actions
    with torch.no_grad():
        coefficient = ratio.clamp(min=p.lower, max=p.upper)
    objective = coefficient.detach() * adv * inp.logp

    # off the actions r = exp(0) = 1: never below lower (≤ 1, strictly); above upper only for a cap below 1
    @functools.cache
    def counts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mask, lengths = inp.mask, inp.lengths
        low = (
            count_actions(ratio < p.lower, mask, lengths, false_off_actions=True)
            if p.lower is not None
            else lengths.new_zeros(())
        )
        if not per_response and p.lower is None and p.upper >= 1 and clamp_moved_fast(ratio, coefficient):
            # the weight is ratio.clamp(max=upper): the tokens above upper are those it moved (never off the
            # actions, where the ratio is 1), counted without a comparison's bool tensor
            high = count_moved(ratio, coefficient)
        else:
            high = count_actions(ratio > p.upper, mask, lengths, false_off_actions=p.upper >= 1)
        if p.lower is None:  # no lower bound (TRL): the clipped count is the upper side's
            return high, low, high
        if p.lower < p.upper:  # the two sides are disjoint: their sum is the clipped count
            return low + high, low, high
        return count_actions((ratio < p.lower) | (ratio > p.upper), mask, lengths), low, high

    @functools.cache
    def fractions() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        clipped, low, high = counts()
        high_frac = high / inp.action_tokens
        return (high_frac if clipped is high else clipped / inp.action_tokens), low / inp.action_tokens, high_frac

    def fraction(i: int) -> torch.Tensor:
        return fractions()[i]

    return lossplug.GateOutput(
        objective=objective,
        metrics={
            "clip_frac": lambda: fraction(0),
            "clip_frac_low": lambda: fraction(1),
            "clip_frac_high": lambda: fraction(2),
        },
        # the clip saturates the weight only: every action token (every non-empty response) keeps its gradient
        active=lambda: inp.lengths > 0 if per_response else inp.mask,
    )
