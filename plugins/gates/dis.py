"""DIS: direct double-sided importance sampling — a detached keep/drop gate on the current/behaviour ratio.

DIS (GLM-5; used by SAO) keeps the token-level importance-weighted update only where the ratio of the *current*
policy to the *behaviour* (rollout) policy lies strictly inside an asymmetric interval, and drops the token's
policy-gradient signal otherwise — whatever the advantage's sign (unlike PPO, which keeps the raw branch on the
side the advantage does not guard). Per action token::

    ρ     = exp(logp − behavior_logp)                    (log-ratio clamped to ± log_ratio_clamp)
    keep  = 1 − low < ρ < 1 + high
    c     = sg(where(keep, ρ, 0))
    J     = c · A · logp                                  ∂J/∂logp = c · A

Detach/gradient contract: the coefficient ``c`` is explicitly ``.detach()``-ed (a choice this project makes and
states: the SAO paper writes no stop-gradient, and not detaching would add a ``ρ·A·logp`` derivative term) —
gradient flows through the ``logp`` factor only, and is exactly zero on dropped tokens. Needs ``behavior_logp``.
Defaults ``low = 0.2``, ``high = 0.28`` (the asymmetric interval of DAPO's clip-higher, arXiv:2503.14476).

Paper: double-sided importance sampling as introduced with GLM-5 (Zhipu AI / Z.ai) and used by SAO; no arXiv id is
recorded in this project yet, and no official training code settles the detach, hence the contract above.
"""

from __future__ import annotations

from typing import cast

import torch
from pydantic import Field

import lossplug
from lossplug.ops import clamp_exact, response_stats


class DISParams(lossplug.Params):
    low: float = Field(0.2, gt=0, lt=1, description="tokens with ρ ≤ 1 − low are dropped")
    high: float = Field(0.28, gt=0, description="tokens with ρ ≥ 1 + high are dropped")
    log_ratio_clamp: float = Field(20.0, gt=0, le=80, description="the log-ratio is clamped to ± this before exp")


@lossplug.gate("dis", params=DISParams, requires=("behavior_logp",))
def dis(inp: lossplug.GateInput, p: DISParams) -> lossplug.GateOutput:
    """DIS: sg(where(1−low < ρ < 1+high, ρ, 0))·A·logp with ρ = π_θ/π_behaviour."""
    adv = inp.broadcast_advantage()  # × logp, which is 0 off the actions
    with torch.no_grad():
        behavior_logp = cast(torch.Tensor, inp.behavior_logp)  # set: declared in requires
        log_ratio = clamp_exact(inp.logp.detach() - behavior_logp, -p.log_ratio_clamp, p.log_ratio_clamp)
        ratio = log_ratio.exp()
        keep = (ratio > 1 - p.low) & (ratio < 1 + p.high)
        coefficient = torch.where(keep, ratio, torch.zeros_like(ratio))
    objective = coefficient.detach() * adv * inp.logp
    # off the actions ρ = exp(0) = 1, strictly inside (1 − low, 1 + high): never counted, no mask pass
    return lossplug.GateOutput(
        objective=objective,
        metrics={
            "drop_frac_low": lambda: inp.token_fraction(ratio <= 1 - p.low, false_off_actions=True),
            "drop_frac_high": lambda: inp.token_fraction(ratio >= 1 + p.high, false_off_actions=True),
        },
        details=response_stats("ratio", ratio, inp.mask),
        active=lambda: keep,
    )
