"""Group (or batch) normalisation with every action token counted once — AReaL's ``adv_norm`` on outcome rewards::

    m = Σ_i l_i·R_i / Σ_i l_i                        (over the group's responses, or the batch's; l_i = action tokens)
    s = sqrt(Σ_i l_i·(R_i − m)² / (Σ_i l_i − 1))     (Bessel-corrected over tokens; ÷ Σ l_i with ``unbiased: false``)
    A_i = (R_i − m) / (s + eps)

AReaL normalises the ``[B, T]`` advantage over the action tokens of the group, so a response weighs by its length
in both statistics — unlike ``grpo``, where each response counts once. ``mean: none`` skips the centring and
``std: none`` the division (then no ``eps``); ``mean: group, std: none`` is the length-weighted baseline of ``opo``.
``leave_one_out`` takes, for each response, the mean over the *other tokens* of its group, ``(Σ l·R − R_i)/(Σ l − 1)``
(AReaL's ``mean_leave1out``, which leaves one token out, not one response), and centres the std on it. The
conventions kept from AReaL: a population of at most one token, or a group of one row, has std 1 (Bessel) and, for
the leave-one-out mean, 0; a group of two or more rows whose rewards are all equal gets exactly 0 when centred.

With AReaL's critic-free GRPO setting (``discount: 1``, ``gae_lambda: 1``, no KL reward) the GAE advantage is the
outcome reward on every action token, so this is AReaL's advantage exactly; with a discount, a KL reward or a critic
the token advantages differ within a response and only AReaL's own ``[B, T]`` normalisation reproduces them. AReaL
forms groups from consecutive rows (``group_size``); here ``group_id`` names them. Token rewards ``[B, T]`` are summed
over action positions first. Advantages are ``[B]``, at least float32, and carry no gradient.

Paper: Fu et al., 2025, *AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning*,
arXiv:2505.24298.

Reference: AReaL 1.0.4 (``pip download --no-deps areal==1.0.4``), ``areal/utils/data.py`` ``Normalization``
(``_compute_mean``, ``_compute_std``) configured by ``areal/api/cli_args.py`` ``NormConfig`` (``mean_level``,
``std_level``: batch, group or None; ``mean_leave1out``; ``std_unbiased``, default true; ``eps``, default 1e-5), applied
in ``areal/trainer/ppo/actor.py`` ``_compute_advantages`` (``adv_norm``).
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from pydantic import Field

import lossplug
from lossplug.ops import Groups

from ._verl_statistics import at_least_float32
from .group_relative import sequence_scores

Tensor = torch.Tensor


class LengthWeightedParams(lossplug.Params):
    mean: Literal["group", "batch", "none"] = Field("group", description="where the token-weighted mean is taken")
    std: Literal["group", "batch", "none"] = Field("group", description="where the token-weighted std is taken")
    unbiased: bool = Field(True, description="Bessel-correct the std over the tokens (AReaL's std_unbiased)")
    leave_one_out: bool = Field(False, description="mean over the group's other tokens (AReaL's mean_leave1out)")
    eps: float = Field(1e-5, ge=0, description="epsilon added to the std (AReaL: 1e-5)")


def _requires(p: LengthWeightedParams) -> tuple[str, ...]:
    return ("reward", "group_id") if "group" in (p.mean, p.std) else ("reward",)


def _populations(level: str, group_id: Tensor | None, rows: int, device: torch.device) -> Groups:
    """The rows' populations: their groups (``level: group``), or the whole batch as one."""
    if level == "group":
        return Groups.from_ids(cast(Tensor, group_id))  # required for a group level
    return Groups(torch.zeros(rows, dtype=torch.long, device=device), torch.tensor([rows], device=device), 1)


def _token_mean(pop: Groups, score: Tensor, length: Tensor, leave_one_out: bool) -> Tensor:
    """The token-weighted mean of each row's population, or of its population's other tokens (0 for a row alone)."""
    tokens = pop.sum(length)[pop.inverse]
    total = pop.sum(length * score)[pop.inverse]
    if not leave_one_out:
        return torch.where(tokens > 0, total / tokens.clamp(min=1), torch.zeros_like(score))
    alone = pop.counts[pop.inverse] == 1  # AReaL: a group of one row has mean 0
    others = torch.where(tokens > 1, (total - score) / (tokens - 1).clamp(min=1), torch.zeros_like(score))
    return torch.where(alone, torch.zeros_like(score), others)


def _token_std(pop: Groups, centred: Tensor, length: Tensor, unbiased: bool) -> Tensor:
    """The token-weighted std of each row's population about the rows' means (1 where it is undefined)."""
    tokens = pop.sum(length)[pop.inverse]
    squares = pop.sum(length * centred * centred)[pop.inverse]
    dof = tokens - 1 if unbiased else tokens
    std = torch.where(dof > 0, (squares / dof.clamp(min=1)).sqrt(), torch.ones_like(centred))
    alone = pop.counts[pop.inverse] == 1
    return torch.where(alone & unbiased, torch.ones_like(std), std)  # AReaL: a group of one row has std 1


@lossplug.advantage("length_weighted_grpo", params=LengthWeightedParams, requires=_requires)
def length_weighted_grpo(batch: lossplug.PolicyBatch, p: LengthWeightedParams) -> Tensor:
    """Length-weighted GRPO: A_i = (R_i − Σ l·R/Σ l) / (sqrt(Σ l·(R − m)²/(Σ l − 1)) + eps), l = action tokens."""
    score = at_least_float32(sequence_scores(batch))
    length = batch.action_mask.sum(-1).to(score.dtype)
    rows, device = score.shape[0], score.device
    centred = score
    if p.mean != "none":
        mean_pop = _populations(p.mean, batch.group_id, rows, device)
        centred = score - _token_mean(mean_pop, score, length, p.leave_one_out)
    adv = centred
    if p.std != "none":
        std = _token_std(_populations(p.std, batch.group_id, rows, device), centred, length, p.unbiased)
        adv = centred / (std + p.eps)
    if p.mean != "none":  # equal rewards carry no signal (a row alone keeps AReaL's R / (1 + eps) under leave_one_out)
        equal = mean_pop.constant(score)[mean_pop.inverse] & (mean_pop.counts[mean_pop.inverse] > 1)
        adv = torch.where(equal, torch.zeros_like(adv), adv)
    return adv
