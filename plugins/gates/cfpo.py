"""CFPO, J = r·A − |A|·(r − 1)²/(2ε): the clipping-free quadratic-penalty surrogate of Çağatan et al., 2026,
*Clipping-Free Policy Optimization for Large Language Models*, arXiv:2601.22801; re-derived from the verl port that
cites it (verl PR #5252, github.com/asparius/verl, ``verl/trainer/ppo/core_algos.py``, ``compute_policy_loss_cfpo``,
commit 18bd5cde9ed769b91b6b2537e6c4ffb80e0dd0b1; the same change was opened in TRL #5027 and OpenRLHF #1184).

Per action token, with the update ratio ``r = exp(clamp(logp − old_logp, ±log_ratio_clamp))`` and advantage ``A``::

    J = r·A − |A|·(r − 1)² / (2ε)              ∂J/∂logp = r·(A − |A|·(r − 1)/ε)

No ratio is clipped: the penalty is convex in ``r`` and differentiable everywhere, so every token keeps a gradient.
The objective peaks at ``r* = 1 + ε·sign(A)`` — exactly where PPO's clip with ``eps_low = eps_high = ε`` starts to
cut — and past that peak the gradient changes sign and pulls the ratio back instead of vanishing. At ``r = 1`` value
and gradient are PPO's (``A`` and ``A``); everywhere else CFPO lies below PPO's clipped surrogate (the gap is
``|A|·((|r − 1| − ε)² + ε²)/(2ε)`` past the peak on the advantage's side, ``|A|·(r − 1)²/(2ε)`` elsewhere: at the
peak CFPO's ``A·(1 + ε/2)`` against PPO's ``A·(1 + ε)``), and as ``ε → ∞`` it becomes the unclipped
importance-sampled policy gradient ``r·A``.

Choices the paper's abstract leaves to code, made as that verl port makes them: one symmetric ``ε`` (the port reads
verl's ``clip_ratio``, 0.2 by default; ``clip_ratio_low``/``clip_ratio_high`` only feed its clip-fraction metrics),
the log-ratio clamped to ±20 before ``exp`` (verl's safety clamp), gradient through ``logp`` only (``old_logp`` and
``A`` are constants). The same objective is Simple Policy Optimization's (Xie et al., 2025, arXiv:2401.16025), which
CFPO brings to LLM post-training.

Metrics: ``past_peak_frac_high`` — the action tokens with ``A > 0`` and ``r > 1 + ε``, ``past_peak_frac_low`` —
with ``A < 0`` and ``r < 1 − ε``: the tokens PPO's clip would have cut (the port's ``pg_clipfrac`` is their sum, its
``pg_clipfrac_lower`` the second), which CFPO instead pulls back toward its peak. ``active``: every token but those whose log-ratio the safety clamp
binds (no gradient there).

>>> import torch, lossplug
>>> logp = torch.log(torch.tensor([[0.5, 0.6, 0.4]])).requires_grad_()       # ratios 1.0, 1.2, 0.8
>>> batch = lossplug.PolicyBatch(logp=logp, old_logp=torch.log(torch.full((1, 3), 0.5)),
...                              advantage=torch.tensor([[1.0, 1.0, -2.0]]),
...                              action_mask=torch.ones(1, 3, dtype=torch.bool))
>>> result = lossplug.policy_loss(batch, {"gates": [{"name": "cfpo", "eps": 0.2}], "reduction": "sequence_sum"})
>>> round(-result.loss.item(), 6)          # 1·1 + (1.2 − 0.04/0.4) + (−1.6 − 2·0.04/0.4)
0.3
>>> result.loss.backward()
>>> [round(-g, 6) + 0.0 for g in logp.grad[0].tolist()]   # r·(A − |A|(r − 1)/ε): 1; 0 at both peaks 1 ± ε
[1.0, 0.0, 0.0]

Paper: *Clipping-Free Policy Optimization for Large Language Models*, 2026, arXiv:2601.22801.

Reference: asparius/verl (commit 18bd5cde9ed769b91b6b2537e6c4ffb80e0dd0b1) ``verl/trainer/ppo/core_algos.py``
``compute_policy_loss_cfpo`` (verl PR #5252; the same change as TRL #5027 and OpenRLHF #1184).
"""

from __future__ import annotations

import functools

import torch
from pydantic import Field

import lossplug
from lossplug.ops import clamp_exact


class CFPOParams(lossplug.Params):
    eps: float = Field(
        0.2,
        gt=0,
        description="ε of the penalty abs(A)·(r − 1)²/(2ε): the objective peaks at r = 1 + ε·sign(A), where PPO's clip "
        "would start (the verl port reads clip_ratio)",
    )
    log_ratio_clamp: float = Field(20.0, gt=0, description="the log-ratio is clamped to ± this before exp")


@lossplug.gate("cfpo", params=CFPOParams, requires=("old_logp",))
def cfpo(inp: lossplug.GateInput, p: CFPOParams) -> lossplug.GateOutput:
    """CFPO: r·A − |A|·(r − 1)²/(2ε), no clip; peaks at r = 1 + ε·sign(A) (arXiv:2601.22801)."""
    adv = inp.broadcast_advantage()
    log_ratio = inp.update_log_ratio()
    ratio = clamp_exact(log_ratio, -p.log_ratio_clamp, p.log_ratio_clamp).exp()
    objective = ratio * adv - adv.abs() * (ratio - 1).square() / (2 * p.eps)

    # Off the actions the cleaned log-ratio is 0, so r = 1 exactly: never past either peak, and no mask pass is needed.
    @functools.cache
    def past_peak() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {"high": (ratio > 1 + p.eps, adv > 0), "low": (ratio < 1 - p.eps, adv < 0)}

    def fraction(side: str) -> torch.Tensor:
        return inp.token_fraction(*past_peak()[side], false_off_actions=True)

    def active() -> torch.Tensor:
        # nothing is clipped: only the safety clamp, where it binds, leaves a token without gradient
        return log_ratio.abs() <= p.log_ratio_clamp

    return lossplug.GateOutput(
        objective=objective,
        metrics={"past_peak_frac_high": lambda: fraction("high"), "past_peak_frac_low": lambda: fraction("low")},
        active=active,
    )
