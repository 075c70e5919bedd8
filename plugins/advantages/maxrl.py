"""MaxRL: group-relative rewards normalised by the group's mean reward instead of its std::

    A_i = (R_i − mean_g(R)) / (mean_g(R) + ε)

With 0/1 rewards the group mean is the empirical pass rate p̂ of the prompt, so a correct response of a hard prompt
weighs ~1/p̂: the policy gradient estimates the gradient of the (group-size-truncated) log-likelihood of success,
log p, rather than of p itself (GRPO/REINFORCE). Rewards are meant to be non-negative (canonically binary).

Conventions that differ between the implementations are parameters (defaults: SkyRL's):

* ``eps`` — added to the mean (SkyRL: 1e-6; prime-rl: 0);
* ``nonpositive_mean`` — a group whose mean reward is ≤ 0: ``divide`` (SkyRL divides by ``mean + ε`` whatever its
  sign) or ``zero`` (prime-rl: no signal). A division by exactly 0 gives 0, never ±inf;
* ``singleton`` — a group of one response: ``score`` (SkyRL, verl's convention: mean 0, ``A = R``) or ``zero``
  (prime-rl: ``(R − R)/R``).

A group of two or more exactly equal rewards gets exactly 0 (floating-point rounding of the mean never becomes a
signal). Token rewards ``[B, T]`` are summed over action positions first; advantages are ``[B]`` (computed in the
rewards' dtype, at least float32) and carry no gradient.

Paper: Tajwar et al., 2026, *Maximum Likelihood Reinforcement Learning*, arXiv:2602.02710.

Reference: SkyRL 0.3.0 ``compute_maxrl_advantage`` (``skyrl/backends/skyrl_train/utils/ppo_utils.py``,
``AdvantageEstimatorRegistry`` "maxrl"); prime-rl ``MaxRLAlgorithm.score_group``
(``src/prime_rl/orchestrator/algo/max_rl.py``, PrimeIntellect-ai/prime-rl 0d6738ff).
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from pydantic import Field

import lossplug
from lossplug.ops import Groups

from ._verl_statistics import at_least_float32, constant_group
from .group_relative import sequence_scores

Tensor = torch.Tensor


class MaxRLParams(lossplug.Params):
    eps: float = Field(1e-6, ge=0, description="epsilon added to the group mean (SkyRL: 1e-6; prime-rl: 0)")
    nonpositive_mean: Literal["divide", "zero"] = Field(
        "divide",
        description="a group whose mean reward is <= 0: divide by mean + eps anyway (SkyRL) or give it 0 (prime-rl)",
    )
    singleton: Literal["score", "zero"] = Field(
        "score", description="a group of one response: A = R (SkyRL, mean taken as 0) or A = 0 (prime-rl)"
    )


@lossplug.advantage("maxrl", params=MaxRLParams, requires=("reward", "group_id"))
def maxrl(batch: lossplug.PolicyBatch, p: MaxRLParams) -> Tensor:
    """MaxRL: A = (R − mean_group(R)) / (mean_group(R) + eps); exactly 0 for groups of equal rewards.

    Paper: Tajwar et al., 2026, *Maximum Likelihood Reinforcement Learning*, arXiv:2602.02710.

    Reference: SkyRL ``compute_maxrl_advantage``; prime-rl ``MaxRLAlgorithm``.
    """
    reward = at_least_float32(sequence_scores(batch))
    groups = Groups.from_ids(cast(Tensor, batch.group_id))  # required
    mean = groups.mean(reward)[groups.inverse]
    denom = mean + p.eps
    divided = torch.where(denom != 0, (reward - mean) / torch.where(denom != 0, denom, 1), 0)
    if p.nonpositive_mean == "zero":
        divided = torch.where(mean > 0, divided, 0)
    singleton = (groups.counts == 1)[groups.inverse]
    adv = torch.where(singleton, reward if p.singleton == "score" else torch.zeros_like(reward), divided)
    return torch.where(constant_group(groups, reward), torch.zeros_like(adv), adv)
