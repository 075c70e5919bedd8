"""tanh_clip — PPO's clipped surrogate with a smooth knee instead of a hard cut.

Per action token, with ``r = exp(logp − old_logp)`` (log-ratio clamped to ± log_ratio_clamp) and advantage ``A``::

    A ≥ 0:  J = A · min(r, 1 + ε_high · tanh((r − 1) / ε_high))
    A < 0:  J = A · max(r, 1 − ε_low  · tanh((1 − r) / ε_low))

On the side PPO leaves alone the objective is the raw ``r·A``; on the side PPO clips, the objective saturates
smoothly at ``(1 ± ε)·A`` instead of being cut. Its gradient, ``∂J/∂logp = r · sech²((r − 1)/ε) · A`` there, is
``A`` at ``r = 1`` and decays smoothly with the ratio: no token's gradient drops to zero at a cliff.
``old_logp`` and the advantage are constants (detached); gradient flows through ``logp`` only.
"""

from collections.abc import Callable

import torch
from pydantic import Field

import lossplug


class TanhClipParams(lossplug.Params):
    eps_low: float = Field(0.2, gt=0, lt=1, description="saturation below 1 − eps_low, for A < 0")
    eps_high: float = Field(0.28, gt=0, description="saturation above 1 + eps_high, for A > 0")
    log_ratio_clamp: float = Field(20.0, gt=0, le=80, description="the log-ratio is clamped to ± this before exp")


@lossplug.gate("tanh_clip", params=TanhClipParams, requires=("old_logp",))
def tanh_clip(inp: lossplug.GateInput, p: TanhClipParams) -> lossplug.GateOutput:
    """tanh_clip: A·min(r, 1+ε·tanh((r−1)/ε)) for A ≥ 0, A·max(r, 1−ε·tanh((1−r)/ε)) for A < 0."""
    adv = inp.advantage
    ratio = inp.update_log_ratio().clamp(-p.log_ratio_clamp, p.log_ratio_clamp).exp()
    high = 1 + p.eps_high * torch.tanh((ratio - 1) / p.eps_high)
    low = 1 - p.eps_low * torch.tanh((1 - ratio) / p.eps_low)
    objective = adv * torch.where(adv >= 0, torch.minimum(ratio, high), torch.maximum(ratio, low))

    def saturated_frac() -> torch.Tensor:  # declared: the pipeline calls it only when metrics are asked for
        return inp.token_fraction(torch.where(adv >= 0, ratio > 1 + p.eps_high, ratio < 1 - p.eps_low))

    return lossplug.GateOutput(objective=objective, metrics={"saturated_frac": saturated_frac}, active=lambda: inp.mask)


@lossplug.hookimpl
def lossplug_register_gates(register: Callable[[lossplug.GatePlugin], None]) -> None:
    register(tanh_clip)
