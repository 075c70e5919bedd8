"""Optimal token baseline (verl's ``optimal_token_baseline`` and ``tir_optimal_token_baseline``).

Per prompt group and per step ``t``, the baseline that minimises the gradient variance under a path-variance
proxy::

    G_t = Σ_{u ≥ t} r_u                                reward-to-go (action tokens' rewards, no discount)
    w_t = (1 − 2·π(a_t) + Σ_v π(v)²) · ρ̄_t²             ‖∇ log π(a_t)‖² proxy; ρ̄ = rollout IS weight (else 1)
    W_t = Σ_{j ≤ t} w_j                                  cumulated over the response's action tokens
    B_t = Σ_{i∈g} G_i,t · W_i,t / (Σ_{i∈g} W_i,t + ε)    over the group's responses that have a step t
    A_t = G_t − B_t                                       a group of one: B = 0

``align="position"`` (``optimal_token_baseline``) lines the group's responses up by token position, counted from
each response's first action token (verl counts from the response's first token: the same for responses that start
with a generated token, as verl's do; a prompt or padding in front never shifts it);
``align="action"`` (``tir_optimal_token_baseline``, for multi-turn responses with tool tokens) by the index of the
action token within its response. ``zero_tail`` (verl's ``handle_zero_tail``, default on): where one response of
the group is strictly the longest (in action tokens), its baseline is 0 from index ``L_second`` on (``L_second`` =
the second-longest length, used as a position with ``align="position"``, as verl does). ``returns`` are ``G`` (verl's
second output; zero off the actions in the plugins).

Inputs: ``reward`` (a ``[B]`` score sits on the last action token; ``[B, T]`` is read on action positions),
``group_id``, ``old_logp`` (π(a_t) of the sampling policy, verl's ``old_log_probs``) and ``sum_pi_squared``
(``Σ_v π(v)²`` per token, verl's actor computes it with ``actor.calculate_sum_pi_squared=True``). verl multiplies
``w_t`` by its rollout importance weights ``ρ̄_t²`` when rollout correction computes them (``rollout_is`` in decoupled
mode); a PolicyBatch does not carry those weights, so the plugins use ``ρ̄ = 1`` (the kernel
:func:`optimal_token_baseline_advantage` takes them). Advantages are ``[B, T]``, zero off the actions, and carry no
gradient.

Paper: verl's Optimal Token Baseline (``B_t* = E[G_t·W_t] / E[W_t]``), after the optimal-baseline analysis of Greensmith
et al., 2004, *Variance Reduction Techniques for Gradient Estimates in Reinforcement Learning*, JMLR 5.

Reference: verl 0.9.1 ``compute_optimal_token_baseline_advantage`` and
``compute_multi_turn_optimal_token_baseline_advantage`` (``verl/trainer/ppo/core_algos.py``).
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from pydantic import Field

import lossplug
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

    columns = torch.arange(T, device=mask.device)
    if align == "action":  # the k-th action token of every response at index k
        width = int(lengths.max())
        rows = torch.arange(B, device=mask.device).unsqueeze(-1).expand(B, T)[mask]
        rank = (mask.cumsum(-1) - 1)[mask]
        valid = columns[:width] < lengths.unsqueeze(-1)
        aligned_returns = torch.zeros(B, width, dtype=dtype, device=mask.device).index_put_((rows, rank), returns[mask])
        aligned_path = torch.zeros(B, width, dtype=dtype, device=mask.device).index_put_((rows, rank), path[mask])
    else:  # index t counted from the response's first action token (verl: from the response's first token)
        first = mask.long().argmax(-1, keepdim=True)
        source = columns + first
        inside = source < T
        source = source.clamp(max=T - 1)
        width = T
        valid = inside & mask.gather(1, source)
        aligned_returns = torch.where(inside, returns.gather(1, source), 0)
        aligned_path = torch.where(inside, path.gather(1, source), 0)

    numerator = _group_rows_sum(groups, torch.where(valid, aligned_returns * aligned_path, 0))
    denominator = _group_rows_sum(groups, torch.where(valid, aligned_path, 0)) + eps
    in_group = (groups.counts > 1)[groups.inverse].unsqueeze(-1)
    baseline = torch.where(in_group, (numerator / denominator)[groups.inverse], 0)
    if zero_tail:
        longest = groups.amax(lengths)[groups.inverse]
        is_longest = lengths == longest
        unique = groups.sum(is_longest.long())[groups.inverse] == 1
        second = groups.amax(torch.where(is_longest, -1, lengths))[groups.inverse]
        tail = (is_longest & unique).unsqueeze(-1) & (columns[:width] >= second.unsqueeze(-1))
        baseline = torch.where(tail, 0, baseline)
    aligned_advantage = aligned_returns - baseline
    if align == "action":
        advantage = torch.zeros(B, T, dtype=dtype, device=mask.device).masked_scatter_(mask, aligned_advantage[valid])
    else:  # back from the response's first action token
        back = (columns - first).clamp(min=0)
        advantage = torch.where(mask, aligned_advantage.gather(1, back), 0)
    return advantage, returns


class OptimalTokenBaselineParams(lossplug.Params):
    zero_tail: bool = Field(
        True,
        description="baseline 0 past the second-longest response on a group's strictly longest one (verl: "
        "handle_zero_tail, always on)",
    )
    eps: float = Field(1e-8, ge=0, description="epsilon added to the baseline's denominator Σ W (verl: 1e-8)")


_REQUIRES = ("reward", "group_id", "old_logp", "sum_pi_squared")


def _run(
    batch: lossplug.PolicyBatch, p: OptimalTokenBaselineParams, align: Literal["position", "action"]
) -> lossplug.AdvantageResult:
    mask = batch.action_mask
    reward = cast(Tensor, batch.reward)  # required, like the three below
    if reward.ndim == 1:  # the score on the last action token
        last = mask.shape[1] - 1 - mask.flip(-1).long().argmax(-1)
        reward = torch.zeros(mask.shape, dtype=reward.dtype, device=mask.device).scatter_(
            1, last.unsqueeze(-1), reward.unsqueeze(-1)
        )
    advantage, returns = optimal_token_baseline_advantage(
        reward,
        mask,
        cast(Tensor, batch.group_id),
        cast(Tensor, batch.old_logp),
        cast(Tensor, batch.sum_pi_squared),
        align=align,
        zero_tail=p.zero_tail,
        eps=p.eps,
    )
    return lossplug.AdvantageResult(advantage=advantage, returns=torch.where(mask, returns, 0))


@lossplug.advantage("optimal_token_baseline", params=OptimalTokenBaselineParams, requires=_REQUIRES)
def optimal_token_baseline(batch: lossplug.PolicyBatch, p: OptimalTokenBaselineParams) -> lossplug.AdvantageResult:
    """OTB: A_t = G_t − Σ_g G_t·W_t / (Σ_g W_t + eps), W_t = Σ_{j≤t} (1 − 2π(a_j) + Σπ²), by token position.

    Paper: Greensmith et al., 2004, *Variance Reduction Techniques for Gradient Estimates in Reinforcement
    Learning*, JMLR 5 (the optimal baseline); verl's Optimal Token Baseline.

    Reference: verl ``compute_optimal_token_baseline_advantage``.
    """
    return _run(batch, p, "position")


@lossplug.advantage("tir_optimal_token_baseline", params=OptimalTokenBaselineParams, requires=_REQUIRES)
def tir_optimal_token_baseline(batch: lossplug.PolicyBatch, p: OptimalTokenBaselineParams) -> lossplug.AdvantageResult:
    """OTB for multi-turn (tool-integrated) responses: the baseline by action-token index, tool tokens skipped.

    Paper: Greensmith et al., 2004, *Variance Reduction Techniques for Gradient Estimates in Reinforcement
    Learning*, JMLR 5 (the optimal baseline); verl's Optimal Token Baseline.

    Reference: verl ``compute_multi_turn_optimal_token_baseline_advantage``.
    """
    return _run(batch, p, "action")
