"""ReMax: the reward minus the reward of the greedy response to the same prompt (verl's ``remax``)::

    G_t = Σ_{u ≥ t} r_u              reward-to-go over the response's action tokens (no discount)
    A_t = G_t − b                     b = ``reward_baseline``: the reward of the greedy (argmax) decoding

With a ``[B]`` score (outcome reward) every action token's reward-to-go is the score, so the advantage is ``[B]``:
``A = R − b`` (returns ``R``). With a ``[B, T]`` token reward (read on action positions only) the advantages and
returns are ``[B, T]``, zero off the actions. ``returns`` are ``G`` (verl's second output). No gradient flows.

The baseline needs one extra greedy generation per prompt, done by the trainer (verl: ``reward_baselines``, computed
when ``algorithm.adv_estimator=remax``); lossplug reads it from ``PolicyBatch.reward_baseline``.

Paper: Li et al., 2024, *ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning Large
Language Models*, arXiv:2310.10505.

Reference: verl 0.9.1 ``compute_remax_outcome_advantage`` (``verl/trainer/ppo/core_algos.py``).
"""

from __future__ import annotations

from typing import cast

import torch

import lossplug

Tensor = torch.Tensor


@lossplug.advantage("remax", requires=("reward", "reward_baseline"))
def remax(batch: lossplug.PolicyBatch, p: lossplug.NoParams) -> lossplug.AdvantageResult:
    """ReMax: A_t = Σ_{u≥t} r_u − b, b = reward_baseline (the greedy response's reward); returns the reward-to-go.

    Paper: Li et al., 2024, *ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning
    Large Language Models*, arXiv:2310.10505.

    Reference: verl ``compute_remax_outcome_advantage``.
    """
    reward = cast(Tensor, batch.reward)  # required
    baseline = cast(Tensor, batch.reward_baseline)  # required
    dtype = torch.promote_types(torch.promote_types(reward.dtype, baseline.dtype), torch.float32)  # ≥ float32
    baseline = baseline.to(dtype)
    if reward.ndim == 1:
        score = reward.to(dtype)
        return lossplug.AdvantageResult(advantage=score - baseline, returns=score)
    mask = batch.action_mask
    on_actions = torch.where(mask, reward.to(dtype), 0)
    to_go = on_actions.flip(-1).cumsum(-1).flip(-1)  # verl's reverse cumulative sum, same order
    returns = torch.where(mask, to_go, 0)
    advantage = torch.where(mask, to_go - baseline.unsqueeze(-1), 0)
    return lossplug.AdvantageResult(advantage=advantage, returns=returns)
