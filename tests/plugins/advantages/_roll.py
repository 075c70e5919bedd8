"""ROLL's agentic advantage code transcribed loop by loop for the ``step_reinforce`` and ``agentic_reinforce`` tests
(ROLL is on no package index; PyPI's ``roll`` is an unrelated web framework).

From alibaba/ROLL 8eb27cc2dc34c4d1310b169d9b86d339004d811a: ``roll/pipeline/agentic/utils.py``
(``compute_discounted_returns``, ``agentic_reward_norm``, ``compute_agentic_reinforce_return``,
``agentic_compute_advantage``) and ``roll/utils/functionals.py`` (``expand_to_token_level``, ``masked_mean``,
``masked_var``, ``masked_whiten``). Python floats (float64) where ROLL uses float32 tensors.
"""

from __future__ import annotations

import statistics

import torch

F64 = torch.float64


def discounted_returns(rewards, traj, step, gamma):
    """``compute_discounted_returns``: per trajectory, its rows sorted by ``step``, ``G = r + γ·G_next``."""
    out = [0.0] * len(rewards)
    for tr in dict.fromkeys(traj):
        rows = sorted((i for i in range(len(rewards)) if traj[i] == tr), key=lambda i: step[i])
        running = 0.0
        for i in reversed(rows):
            running = rewards[i] + gamma * running
            out[i] = running
    return out


def agentic_reward_norm(scores, keys, grouping, mean_type, std_type):
    """``agentic_reward_norm``: ``keys`` the grouping key of each row (ignored for grouping batch)."""
    batch_mean = statistics.fmean(scores)
    batch_std = statistics.stdev(scores) if len(scores) > 1 else float("nan")  # torch.std of one value: nan
    members = {"default": list(range(len(scores)))}
    if grouping != "batch":
        members = {}
        for i, k in enumerate(keys):
            members.setdefault(k, []).append(i)
    out = [0.0] * len(scores)
    for rows in members.values():
        values = [scores[i] for i in rows]
        if mean_type == "batch":
            mean = batch_mean
        elif mean_type == "group":
            mean = statistics.fmean(values)
        else:
            mean = 0.0
        if std_type == "batch":
            std = batch_std
        elif std_type == "group":
            std = statistics.stdev(values) if len(values) > 1 else float("nan")
        else:
            std = None
        for i, v in zip(rows, values):
            if std is not None:
                # "处理单个元素或标准差为0的情况": one element, or |std| ≤ 1e-6 → 0
                out[i] = (v - mean) / (std + 1e-6) if len(values) > 1 and abs(std) > 1e-6 else 0.0
            else:
                out[i] = v - mean
    return out


def agentic_reinforce_return(token_rewards, mask, gamma):
    """``compute_agentic_reinforce_return``: segments are the runs of 1 in the mask; walking them backwards each
    gets the reward on its last token plus γ times the next one's value, on all its positions."""
    B, T = len(token_rewards), len(token_rewards[0])
    returns = [[0.0] * T for _ in range(B)]
    for b in range(B):
        segments, start = [], None
        for t in range(T):
            if mask[b][t] and start is None:
                start = t
            if not mask[b][t] and start is not None:
                segments.append((start, t))
                start = None
        if start is not None:
            segments.append((start, T))
        cumulative = 0.0
        for s, e in reversed(segments):
            cumulative = token_rewards[b][e - 1] + gamma * cumulative
            for t in range(s, e):
                returns[b][t] = cumulative
    return returns


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``masked_whiten`` with ROLL's ``masked_mean`` (``/ (mask.sum() + 1e-8)``) and ``masked_var`` (Bessel factor
    ``mask_sum / (mask_sum − 1)`` of an integer mask, as ROLL's int64 response mask gives it)."""
    mask = mask.long()
    mean = (values * mask).sum() / (mask.sum() + 1e-8)
    centered = values - mean
    variance = (centered**2 * mask).sum() / (mask.sum() + 1e-8)
    mask_sum = mask.sum()
    variance = variance * (mask_sum / (mask_sum - 1))
    return (values - mean) * torch.rsqrt(variance + 1e-8)
