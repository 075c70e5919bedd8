"""GDPO: group reward-decoupled normalisation for several reward functions (verl's ``gdpo``)::

    A_k,i = (r_k,i − mean_g(r_k)) / (std_g(r_k) + ε)     each reward component k normalised in its group
    S_i   = Σ_k w_k · A_k,i                              weighted sum (weights default to 1)
    A_i   = whiten(S)                                    over every action token of the batch (verl's masked_whiten)

The components are ``PolicyBatch.reward_components`` ``[B, K]`` (one column per reward function; verl: the
``algorithm.gdpo_reward_keys`` entries of the batch's non-tensor data). ``std_g`` is the sample std. A group of one
gets ``r_k / (1 + ε)`` per component, as verl's GRPO gives it (``mean 0, std 1``; verl adds ε to a float32 1, kept
here); a group of two or more equal values of a component gets exactly 0 for that component. Normalising each
component separately keeps a reward with a large spread from drowning a weaker one. Advantages are ``[B]`` (one per
response, the token-weighted whitening included) and carry no gradient.

verl 0.9.1 computes GDPO in float32 (it casts the components with ``np.float32``) and always divides by the std
(``norm_adv_by_std_in_grpo`` is not passed to it); this plugin computes in the components' dtype (at least
float32).

Paper: GDPO: Group reward-Decoupled Normalization Policy Optimization, 2026, arXiv:2601.05242.

Reference: verl 0.9.1 ``compute_gdpo_outcome_advantage`` (``verl/trainer/ppo/core_algos.py``). TRL's
``multi_objective_aggregation="normalize_then_sum"`` has the same first two steps (with ε = 1e-4) but standardises the
sum per response (``(S − mean)/(std + 1e-4)``), not over action tokens.
"""

from __future__ import annotations

from typing import cast

import torch
from pydantic import Field

import lossplug
from lossplug.ops import Groups

from ._verl_statistics import at_least_float32, constant_group, group_mean_or_zero, whiten_rows
from .multi_reward import component_weights

Tensor = torch.Tensor


class GDPOParams(lossplug.Params):
    weights: tuple[float, ...] | None = Field(
        None, description="weight of each reward component (verl: algorithm.gdpo_reward_weights); default: all 1"
    )
    eps: float = Field(1e-6, ge=0, description="epsilon added to each component's group std (verl: 1e-6)")


def decoupled_group_normalisation(components: Tensor, groups: Groups, eps: float) -> Tensor:
    """``[B, K]``: each column normalised within its groups as verl's GRPO does (singletons: ``r / (1 + ε)``)."""
    mean = torch.stack([group_mean_or_zero(groups, c) for c in components.unbind(-1)], -1)
    std = torch.stack([groups.std(c, unbiased=True) for c in components.unbind(-1)], -1)[groups.inverse]
    singleton = (groups.counts == 1)[groups.inverse].unsqueeze(-1)
    # verl: torch.tensor(1.0) + eps, a float32 scalar, divides a singleton's score
    one_plus_eps = torch.tensor(1.0) + eps
    denom = torch.where(singleton, one_plus_eps.to(components.dtype), std + eps)
    normalised = (components - mean) / denom
    constant = torch.stack([constant_group(groups, c) for c in components.unbind(-1)], -1)
    return torch.where(constant, torch.zeros_like(normalised), normalised)


@lossplug.advantage("gdpo", params=GDPOParams, requires=("reward_components", "group_id"))
def gdpo(batch: lossplug.PolicyBatch, p: GDPOParams) -> Tensor:
    """GDPO: A = whiten(Σ_k w_k · (r_k − mean_group(r_k)) / (std_group(r_k) + eps)) over action tokens.

    Paper: GDPO: Group reward-Decoupled Normalization Policy Optimization, 2026, arXiv:2601.05242.

    Reference: verl ``compute_gdpo_outcome_advantage``.
    """
    components = at_least_float32(cast(Tensor, batch.reward_components))  # required
    K = components.shape[-1]
    weights = component_weights("gdpo", p.weights, K)
    groups = Groups.from_ids(cast(Tensor, batch.group_id))  # required
    normalised = decoupled_group_normalisation(components, groups, p.eps)
    total = weights[0] * normalised[:, 0]
    for k in range(1, K):  # in order, as verl accumulates them
        total = total + weights[k] * normalised[:, k]
    return whiten_rows(total, batch.action_mask)
