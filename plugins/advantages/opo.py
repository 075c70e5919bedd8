"""OPO: on-policy RL with the optimal (length-weighted) group baseline (verl's ``opo``)::

    b_g = Σ_{j∈g} l_j · R_j / Σ_{j∈g} l_j          l_j = the response's number of action tokens
    A_i = R_i − b_g                                  a group of one: b = 0 (verl), A_i = R_i

Under a token-mean loss with exact on-policy sampling this baseline minimises the variance of the gradient. The
length is counted in action tokens (``action_mask``: prompt, observation/tool tokens and padding do not count),
verl's ``response_mask.sum(-1)``. Token rewards ``[B, T]`` are summed over action positions first. A group of two or
more equal rewards gets exactly 0. Advantages are ``[B]`` and carry no gradient.

Paper: Hao et al., 2025, *On-Policy RL with Optimal Reward Baseline*, arXiv:2505.23585.

Reference: verl 0.9.1 ``compute_opo_outcome_advantage`` (``verl/trainer/ppo/core_algos.py``).
"""

from __future__ import annotations

from typing import cast

import torch

import lossplug
from lossplug.ops import Groups

from ._verl_statistics import at_least_float32, constant_group
from .group_relative import sequence_scores

Tensor = torch.Tensor


@lossplug.advantage("opo", requires=("reward", "group_id"))
def opo(batch: lossplug.PolicyBatch, p: lossplug.NoParams) -> Tensor:
    """OPO: A_i = R_i − Σ_g l·R / Σ_g l (l = action tokens); a group of one keeps R_i.

    Paper: Hao et al., 2025, *On-Policy RL with Optimal Reward Baseline*, arXiv:2505.23585.

    Reference: verl ``compute_opo_outcome_advantage``.
    """
    score = at_least_float32(sequence_scores(batch))
    groups = Groups.from_ids(cast(Tensor, batch.group_id))  # required
    length = batch.action_mask.sum(-1).to(score.dtype)
    baseline = groups.sum(length * score) / groups.sum(length)
    baseline = torch.where(groups.counts > 1, baseline, torch.zeros_like(baseline))[groups.inverse]
    adv = score - baseline
    return torch.where(constant_group(groups, score), torch.zeros_like(adv), adv)
