"""Reward clipping and scaling, elementwise on the reward (per response ``[B]`` or per token ``[B, T]``)::

    reward_clip    r ← clamp(r, low, high)
    reward_scale   r ← (r + bias) · scale

A per-token reward is rewritten on the action tokens only (elsewhere it stays 0, the contract's rule). AReaL's
reward shaping is the two in a row: ``shapers: [{name: reward_scale, bias: b, scale: s}, {name: reward_clip, low:
-c, high: c}]``.

Reference: OpenRLHF ``compute_reward`` (OpenRLHF/OpenRLHF 473f61b, ``openrlhf/models/utils.py``:
``r.clamp(min=reward_clip_range[0], max=reward_clip_range[1])`` before the KL is added; ``--reward_clip_range``
defaults to (−10, 10)); ROLL ``reward_postprocess`` (alibaba/ROLL 4142237, ``roll/utils/functionals.py``: the
response-level rewards clamped to ±``reward_clip`` after their normalisation); AReaL ``PPOActor.compute_advantages``
(inclusionAI/AReaL 5ac9adf, ``areal/engine/ppo/actor.py``: ``(reward + reward_bias) * reward_scaling``, then clipped
to ±``reward_clip``).
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator

import lossplug

Tensor = torch.Tensor


def _on_actions(inp: lossplug.RolloutInput, values: Tensor) -> Tensor:
    reward = inp.batch.reward
    assert reward is not None
    return torch.where(inp.batch.action_mask, values, reward) if reward.ndim == 2 else values


class ClipParams(lossplug.Params):
    low: float | None = Field(
        -10.0, allow_inf_nan=False, description="the lower bound, None for none (OpenRLHF's default range: -10, 10)"
    )
    high: float | None = Field(10.0, allow_inf_nan=False, description="the upper bound, None for none")

    @model_validator(mode="after")
    def _a_bound_and_in_order(self) -> ClipParams:
        if self.low is None and self.high is None:
            raise ValueError("give low, high or both")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"low ({self.low}) must be <= high ({self.high})")
        return self


@lossplug.shaper("reward_clip", params=ClipParams)
def reward_clip(inp: lossplug.RolloutInput, p: ClipParams) -> lossplug.ShaperOutput:
    """r ← clamp(r, low, high) (OpenRLHF reward_clip_range, ROLL and AReaL reward_clip)."""
    reward = inp.batch.reward
    assert reward is not None
    clipped = _on_actions(inp, reward.clamp(min=p.low, max=p.high))
    return lossplug.ShaperOutput(
        reward=clipped, metrics={"clipped_fraction": lambda: (clipped != reward).float().mean()}
    )


class ScaleParams(lossplug.Params):
    scale: float = Field(1.0, allow_inf_nan=False, description="the factor (AReaL's reward_scaling)")
    bias: float = Field(0.0, allow_inf_nan=False, description="added before scaling (AReaL's reward_bias)")


@lossplug.shaper("reward_scale", params=ScaleParams)
def reward_scale(inp: lossplug.RolloutInput, p: ScaleParams) -> Tensor:
    """r ← (r + bias) · scale (AReaL reward_bias, reward_scaling)."""
    reward = inp.batch.reward
    assert reward is not None
    return _on_actions(inp, (reward + p.bias) * p.scale)
