"""Pass@k GRPO: only the best response of each group is credited, by its margin over the runner-up (verl's
``grpo_passk``)::

    A_i = (R_(1) − R_(2)) / (std_g(R) + ε)    for one response i with the group's highest reward R_(1)
    A_j = 0                                    for every other response of the group

``R_(2)`` is the second-highest reward of the group (equal to ``R_(1)`` on a tie, so a tied best gets 0);
``std_g`` is the sample (Bessel-corrected) std; ``scale_by_std: false`` drops the division. Needs at least two
responses per group (checked before it runs; verl raises too). Token rewards ``[B, T]`` are summed over action
positions first. Advantages are ``[B]``, non-negative, and carry no gradient.

Paper: Tang et al., 2025, *Optimizing Language Models for Inference Time Objectives using Reinforcement Learning*,
arXiv:2503.19595.

Reference: verl 0.9.1 ``compute_grpo_passk_outcome_advantage`` (``verl/trainer/ppo/core_algos.py``).
"""

from __future__ import annotations

from typing import cast

import torch
from pydantic import Field

import lossplug
from lossplug.ops import Groups

from ._verl_statistics import at_least_float32
from .group_relative import sequence_scores

Tensor = torch.Tensor


class PassKParams(lossplug.Params):
    scale_by_std: bool = Field(
        True, description="divide the margin by the group's sample std + eps (verl: algorithm.norm_adv_by_std_in_grpo)"
    )
    eps: float = Field(1e-6, ge=0, description="epsilon added to the std (verl: 1e-6)")


@lossplug.advantage("grpo_passk", params=PassKParams, requires=("reward", "group_id"), min_group_size=2)
def grpo_passk(batch: lossplug.PolicyBatch, p: PassKParams) -> Tensor:
    """Pass@k: A = (R_max − R_second) / (std_group + eps) for the group's best response, 0 for the others.

    Paper: Tang et al., 2025, *Optimizing Language Models for Inference Time Objectives using Reinforcement
    Learning*, arXiv:2503.19595.

    Reference: verl ``compute_grpo_passk_outcome_advantage``.
    """
    score = at_least_float32(sequence_scores(batch))
    groups = Groups.from_ids(cast(Tensor, batch.group_id))  # required
    rows = torch.arange(score.shape[0], device=score.device)
    best = groups.amax(score)
    # one best row per group (the first: on a tie the margin is 0 whichever row gets it)
    candidate = torch.where(score == best[groups.inverse], rows, score.shape[0])
    winner = torch.full_like(best, 0, dtype=torch.long).scatter_reduce(
        0, groups.inverse, candidate, reduce="amin", include_self=False
    )
    is_winner = rows == winner[groups.inverse]
    runner_up = groups.amax(torch.where(is_winner, torch.full_like(score, -torch.inf), score))
    margin = best - runner_up
    if p.scale_by_std:
        margin = margin / (groups.std(score, unbiased=True) + p.eps)
    return torch.where(is_winner, margin[groups.inverse], torch.zeros_like(score))
