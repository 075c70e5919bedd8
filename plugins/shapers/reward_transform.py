"""Reward clipping and scaling, the same for a per-response reward ``[B]`` and a per-token one ``[B, T]``::

    reward_clip    R ← clamp(R, low, high)
    reward_scale   R ← (R + bias) · scale

with ``R`` a response's reward: its ``[B]`` score, or the sum of its ``[B, T]`` reward over its action tokens. A
per-token reward is rewritten so that a score on the response's last action token (where TRL's and verl's reward
managers put it: verl hands lossplug its ``token_level_rewards``) comes out exactly as the ``[B]`` score would — the
same recipe gives the same reward in TRL (``[B]``) and verl (``[B, T]``):

* ``reward_scale`` multiplies every action token's reward by ``scale`` and adds ``bias · scale`` once, on the last
  action token (the bias is the response's, not each token's);
* ``reward_clip`` clips the response's sum and puts the change on its last action token (``r_last ← clamp(R) −
  Σ_{t≠last} r_t``); with ``per_token: true`` it clips each action token's reward instead (dense per-token rewards,
  e.g. a process reward model's).

Off the action tokens a per-token reward stays 0 (the contract's rule). AReaL's reward shaping is the two in a row:
``shapers: [{name: reward_scale, bias: b, scale: s}, {name: reward_clip, low: -c, high: c}]``.

Reference: OpenRLHF ``compute_reward`` (OpenRLHF/OpenRLHF 473f61b, ``openrlhf/models/utils.py``; the same in the
openrlhf 0.11.2 wheel: ``r.clamp(min=reward_clip_range[0], max=reward_clip_range[1])`` on the ``[B]`` score before the
KL is added; ``--reward_clip_range`` defaults to (−10, 10)); ROLL ``reward_postprocess`` (alibaba/ROLL 4142237,
``roll/utils/functionals.py``: the response-level rewards clamped to ±``reward_clip`` after their normalisation);
AReaL ``PPOActor.compute_advantages`` (inclusionAI/AReaL 5ac9adf, ``areal/engine/ppo/actor.py``; in the areal 1.0.4
wheel ``areal/trainer/ppo/actor.py``: ``(reward + reward_bias) * reward_scaling`` on the ``[B]`` score, then clipped to
±``reward_clip``).
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.ops import last_true

Tensor = torch.Tensor


def _last_action(mask: Tensor) -> Tensor:
    """``[B, T]`` bool: each response's last action token."""
    return torch.arange(mask.shape[-1], device=mask.device) == last_true(mask).unsqueeze(-1)


class ClipParams(lossplug.Params):
    low: float | None = Field(
        -10.0, allow_inf_nan=False, description="the lower bound, None for none (OpenRLHF's default range: -10, 10)"
    )
    high: float | None = Field(10.0, allow_inf_nan=False, description="the upper bound, None for none")
    per_token: bool = Field(
        False,
        description="a [B, T] reward: clip each action token's reward, instead of each response's sum (the change on "
        "its last action token)",
    )

    @model_validator(mode="after")
    def _a_bound_and_in_order(self) -> ClipParams:
        if self.low is None and self.high is None:
            raise ValueError("give low, high or both")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"low ({self.low}) must be <= high ({self.high})")
        return self


@lossplug.shaper("reward_clip", params=ClipParams)
def reward_clip(inp: lossplug.RolloutInput, p: ClipParams) -> lossplug.ShaperOutput:
    """R ← clamp(R, low, high), R a response's reward (OpenRLHF reward_clip_range, ROLL and AReaL reward_clip)."""
    reward = inp.batch.reward
    assert reward is not None
    mask = inp.batch.action_mask
    if reward.ndim == 1:
        clipped = reward.clamp(min=p.low, max=p.high)
        changed = clipped != reward
    elif p.per_token:
        clipped = torch.where(mask, reward.clamp(min=p.low, max=p.high), reward)
        changed = (clipped != reward)[mask]
    else:
        last = _last_action(mask)
        # the others first, then the last token's: a score alone on the last token is clipped exactly as a [B] one
        others = torch.where(mask & ~last, reward, 0).sum(-1)
        total = others + torch.where(last, reward, 0).sum(-1)
        bounded = total.clamp(min=p.low, max=p.high)
        clipped = torch.where(last, (bounded - others).unsqueeze(-1), reward)
        changed = bounded != total
    return lossplug.ShaperOutput(reward=clipped, metrics={"clipped_fraction": lambda: changed.float().mean()})


class ScaleParams(lossplug.Params):
    scale: float = Field(1.0, allow_inf_nan=False, description="the factor (AReaL's reward_scaling)")
    bias: float = Field(
        0.0,
        allow_inf_nan=False,
        description="added to each response's reward before scaling (AReaL's reward_bias; a [B, T] reward: on its "
        "last action token)",
    )


@lossplug.shaper("reward_scale", params=ScaleParams)
def reward_scale(inp: lossplug.RolloutInput, p: ScaleParams) -> Tensor:
    """R ← (R + bias) · scale, R a response's reward (AReaL reward_bias, reward_scaling)."""
    reward = inp.batch.reward
    assert reward is not None
    if reward.ndim == 1:
        return (reward + p.bias) * p.scale
    mask = inp.batch.action_mask
    scaled = torch.where(mask, reward * p.scale, reward)
    return torch.where(_last_action(mask), (reward + p.bias) * p.scale, scaled)
