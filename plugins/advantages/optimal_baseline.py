"""Optimal token baseline (verl's ``optimal_token_baseline`` and ``tir_optimal_token_baseline``) — the kernel.

Per prompt group and per step ``t``, the baseline that minimises the gradient variance under a path-variance
proxy::

    G_t = Σ_{u ≥ t} r_u                                reward-to-go (action tokens' rewards, no discount)
    w_t = (1 − 2·π(a_t) + Σ_v π(v)²) · ρ̄_t²             ‖∇ log π(a_t)‖² proxy; ρ̄ = rollout IS weight (else 1)
    W_t = Σ_{j ≤ t} w_j                                  cumulated over the response's action tokens
    B_t = Σ_{i∈g} G_i,t · W_i,t / (Σ_{i∈g} W_i,t + ε)    over the group's responses that have a step t
    A_t = G_t − B_t                                       a group of one: B = 0

``align="position"`` (``optimal_token_baseline``) lines the group's responses up by token position;
``align="action"`` (``tir_optimal_token_baseline``, for multi-turn responses with tool tokens) by the index of the
action token within its response. ``zero_tail`` (verl's ``handle_zero_tail``, default on): where one response of
the group is strictly the longest (in action tokens), its baseline is 0 from index ``L_second`` on (``L_second`` =
the second-longest length, used as a position with ``align="position"``, as verl does). ``returns`` are ``G`` (verl's
second output).

**Not registered as a plugin**: it needs ``Σ_v π(v)²`` per token (verl's ``sum_pi_squared``, computed by the actor
with ``actor.calculate_sum_pi_squared=True``), which :class:`~lossplug.PolicyBatch` does not carry, and optionally
verl's ``rollout_is_weights``. With a contract field ``sum_pi_squared`` (``[B, T]`` float, finite and in ``[0, 1]``
on action tokens) the plugin is :func:`optimal_token_baseline_advantage` on the batch's ``reward``, ``action_mask``,
``group_id``, ``old_logp`` and that field. The kernel is checked against verl in
``tests/plugins/advantages/test_verl_estimators.py``.

Paper: verl's Optimal Token Baseline (``B_t* = E[G_t·W_t] / E[W_t]``), after the optimal-baseline analysis of Greensmith
et al., 2004, *Variance Reduction Techniques for Gradient Estimates in Reinforcement Learning*, JMLR 5.

Reference: verl 0.9.1 ``compute_optimal_token_baseline_advantage`` and
``compute_multi_turn_optimal_token_baseline_advantage`` (``verl/trainer/ppo/core_algos.py``).
"""

from __future__ import annotations

from typing import Literal

import torch

from lossplug.ops import Groups

Tensor = torch.Tensor


def _group_rows_sum(groups: Groups, x: Tensor) -> Tensor:
    """``[G, L]``: the sum of each group's rows of ``x`` ``[B, L]``."""
    out = torch.zeros((groups.num_groups, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out.index_add_(0, groups.inverse, x)


def optimal_token_baseline_advantage(
    token_reward: Tensor,
    mask: Tensor,
    group_id: Tensor,
    old_logp: Tensor,
    sum_pi_squared: Tensor,
    is_weight: Tensor | None = None,
    *,
    align: Literal["position", "action"] = "position",
    zero_tail: bool = True,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """``(advantage, returns)``, both ``[B, T]``: the advantage zero off ``mask``, the returns ``G`` (reward-to-go
    over action tokens, carried over non-action positions as verl's are). Inputs off ``mask`` are never read."""
    dtype = torch.promote_types(torch.promote_types(token_reward.dtype, old_logp.dtype), sum_pi_squared.dtype)
    B, T = mask.shape
    returns = torch.where(mask, token_reward.to(dtype), 0).flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * torch.exp(old_logp.to(dtype)) + sum_pi_squared.to(dtype)
    if is_weight is not None:
        w = w * is_weight.to(dtype) ** 2
    path = torch.where(mask, w, 0).cumsum(-1)
    lengths = mask.sum(-1)
    groups = Groups.from_ids(group_id)

    if align == "action":  # the k-th action token of every response at index k
        width = int(lengths.max())
        rows = torch.arange(B, device=mask.device).unsqueeze(-1).expand(B, T)[mask]
        rank = (mask.cumsum(-1) - 1)[mask]
        valid = torch.arange(width, device=mask.device) < lengths.unsqueeze(-1)
        aligned_returns = torch.zeros(B, width, dtype=dtype, device=mask.device).index_put_((rows, rank), returns[mask])
        aligned_path = torch.zeros(B, width, dtype=dtype, device=mask.device).index_put_((rows, rank), path[mask])
    else:
        width, valid, aligned_returns, aligned_path = T, mask, returns, path

    numerator = _group_rows_sum(groups, torch.where(valid, aligned_returns * aligned_path, 0))
    denominator = _group_rows_sum(groups, torch.where(valid, aligned_path, 0)) + eps
    in_group = (groups.counts > 1)[groups.inverse].unsqueeze(-1)
    baseline = torch.where(in_group, (numerator / denominator)[groups.inverse], 0)
    if zero_tail:
        longest = groups.amax(lengths)[groups.inverse]
        is_longest = lengths == longest
        unique = groups.sum(is_longest.long())[groups.inverse] == 1
        second = groups.amax(torch.where(is_longest, -1, lengths))[groups.inverse]
        tail = (is_longest & unique).unsqueeze(-1) & (torch.arange(width, device=mask.device) >= second.unsqueeze(-1))
        baseline = torch.where(tail, 0, baseline)
    aligned_advantage = aligned_returns - baseline
    if align == "action":
        advantage = torch.zeros(B, T, dtype=dtype, device=mask.device).masked_scatter_(mask, aligned_advantage[valid])
    else:
        advantage = torch.where(mask, aligned_advantage, 0)
    return advantage, returns
