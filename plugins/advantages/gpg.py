"""GPG: group-centred rewards rescaled by the fraction of responses with a non-zero reward (verl's ``gpg``)::

    α = B / max(#{i : R_i ≠ 0}, 1)            over the whole batch
    A_i = α · (R_i − mean_g(R))              a group of one: mean 0 (verl), A_i = α · R_i

No std normalisation; α compensates for the responses that carry no reward signal (with 0/1 rewards: the share of
correct responses). verl computes α in float32 (``bsz / m``, torch's default dtype); kept, so that float64 results
agree with verl's to the last bits. Token rewards ``[B, T]`` are summed over action positions first. A group of two
or more equal rewards gets exactly 0. Advantages are ``[B]`` and carry no gradient.

Paper: Chu et al., 2025, *GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning*,
arXiv:2504.02546.

Reference: verl 0.9.1 ``compute_gpg_outcome_advantage`` (``verl/trainer/ppo/core_algos.py``; its ``f_norm`` is
always 1 there: ``compute_advantage`` does not pass it).
"""

from __future__ import annotations

from typing import cast

import torch

import lossplug
from lossplug.ops import Groups

from ._verl_statistics import at_least_float32, constant_group, group_mean_or_zero
from .group_relative import sequence_scores

Tensor = torch.Tensor


@lossplug.advantage("gpg", requires=("reward", "group_id"))
def gpg(batch: lossplug.PolicyBatch, p: lossplug.NoParams) -> Tensor:
    """GPG: A_i = α · (R_i − mean_group(R)), α = B / #non-zero rewards; a group of one keeps α·R_i.

    Paper: Chu et al., 2025, *GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning*,
    arXiv:2504.02546.

    Reference: verl ``compute_gpg_outcome_advantage``.
    """
    score = at_least_float32(sequence_scores(batch))
    groups = Groups.from_ids(cast(Tensor, batch.group_id))  # required
    nonzero = torch.count_nonzero(score)
    alpha = (score.shape[0] / nonzero.clamp(min=1)).to(score.dtype)  # float32 division first, as verl's
    adv = alpha * (score - group_mean_or_zero(groups, score))
    return torch.where(constant_group(groups, score), torch.zeros_like(adv), adv)
