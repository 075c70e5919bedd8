"""Prompts that are too easy or too hard leave the batch: a prompt group is kept when the mean reward of its
responses lies strictly inside ``(low, high)`` — with a 0/1 verifier, its pass rate — so that the update is spent on
prompts the policy sometimes solves::

    keep group g  ⇔  low < mean_{i ∈ g}(score_i) < high

with ``score_i`` the response's reward (a per-token reward summed over the response). Only the responses still in
play count. The defaults are ROLL's ``difficulty_low_threshold`` / ``difficulty_high_threshold``.

Reference: ROLL ``difficulty_mask`` (alibaba/ROLL 4142237, ``roll/utils/functionals.py``: ``(reshape_score_mean >
low_threshold) * (reshape_score_mean < high_threshold)`` over each prompt's ``num_return_sequences`` responses,
applied to the response mask by ``get_sample_level_mask``).
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.ops import Groups

Tensor = torch.Tensor


class AccuracyBandParams(lossplug.Params):
    low: float = Field(0.1, allow_inf_nan=False, description="a group's mean reward must be above this")
    high: float = Field(0.95, allow_inf_nan=False, description="and below this")

    @model_validator(mode="after")
    def _ordered(self) -> AccuracyBandParams:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be < high ({self.high})")
        return self


@lossplug.filter("accuracy_band", params=AccuracyBandParams, requires=("group_id",))
def accuracy_band(inp: lossplug.RolloutInput, p: AccuracyBandParams) -> lossplug.FilterOutput:
    """Keep the prompt groups whose mean reward is strictly between low and high (ROLL's difficulty_mask)."""
    batch = inp.batch
    assert batch.reward is not None and batch.group_id is not None
    score = inp.response_reward.to(torch.float64)
    rows = inp.rows
    keep = torch.zeros_like(rows)
    if bool(rows.any()):
        groups = Groups.from_ids(batch.group_id[rows])
        mean = groups.mean(score[rows])
        inside = (mean > p.low) & (mean < p.high)
        keep[rows] = inside[groups.inverse]
    return lossplug.FilterOutput(keep=keep)
