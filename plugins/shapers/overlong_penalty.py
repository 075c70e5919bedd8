"""DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, §3.4): a response that runs into the last
``buffer`` tokens before the length limit loses reward linearly, up to ``factor`` at the limit::

    expected = max_response_length − buffer
    reward  += min(−(L − expected) / buffer · factor, 0)

with ``L`` the response's length in tokens (its action tokens: in a single-turn batch, verl's
``valid_response_length``). A per-token reward gains the penalty on the response's last action token, where the
score sits. Computed in the reward's dtype (at least float32) in verl's order (``−exceed / buffer · factor``).

Reference: verl 0.9.1 ``verl.workers.reward_manager.dapo.DAPORewardManager.__call__``
(``reward_model.overlong_buffer.{enable, len, penalty_factor}``, ``max_resp_len`` =
``data.max_response_length``); AReaL 1.0.4 ``areal.utils.functional.functional.reward_overlong_penalty``
(``overlong_reward_penalty``, ``overlong_tokens``, ``overlong_penalty_factor``: the same formula, the length the
loss-mask count).
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.ops import last_true

Tensor = torch.Tensor


class OverlongParams(lossplug.Params):
    max_response_length: int = Field(
        4096, gt=0, description="the generation length limit (verl's data.max_response_length)"
    )
    buffer: int = Field(
        512, gt=0, description="the last tokens before the limit over which the penalty grows (overlong_buffer.len)"
    )
    factor: float = Field(
        1.0, ge=0, allow_inf_nan=False, description="the penalty at the limit (overlong_buffer.penalty_factor)"
    )

    @model_validator(mode="after")
    def _buffer_within_the_limit(self) -> OverlongParams:
        if self.buffer > self.max_response_length:
            raise ValueError(f"buffer ({self.buffer}) must be <= max_response_length ({self.max_response_length})")
        return self


@lossplug.shaper("overlong_penalty", params=OverlongParams)
def overlong_penalty(inp: lossplug.RolloutInput, p: OverlongParams) -> lossplug.ShaperOutput:
    """reward += min(−(L − (max_response_length − buffer)) / buffer · factor, 0) (DAPO's soft overlong punishment)."""
    batch = inp.batch
    reward = batch.reward
    assert reward is not None
    mask = batch.action_mask
    lengths = mask.sum(-1)
    # in the reward's dtype (at least float32): integer lengths divided in torch's default float32 would put a
    # float32 rounding (~1e-8) on a float64 reward, which verl and AReaL compute in Python floats
    dtype = torch.promote_types(reward.dtype, torch.float32)
    exceed = (lengths - (p.max_response_length - p.buffer)).to(dtype)
    penalty = (-exceed / p.buffer * p.factor).clamp(max=0).to(reward.dtype)
    if reward.ndim == 1:
        shaped = reward + penalty
    else:  # on the last action token, beside the score
        shaped = reward.scatter_add(-1, last_true(mask).unsqueeze(-1), penalty.unsqueeze(-1))
    return lossplug.ShaperOutput(
        reward=shaped,
        metrics={
            "penalty": lambda: penalty.mean(),
            "overlong_fraction": lambda: (penalty < 0).float().mean(),
        },
    )
