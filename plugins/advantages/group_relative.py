"""Group-relative advantages: GRPO and RLOO, computed from ``group_id`` (groups may be scattered and unequal).

GRPO::

    A_i = (R_i − mean_g(R)) / scale_g

``scale``: ``group`` — the group's std; ``batch`` — the std of all rewards of the batch (mean still per group);
``none`` — no division (Dr. GRPO). The std convention is a parameter because implementations differ: TRL uses
the sample std with ``/(std + 1e-4)``, verl the sample std with ``/(std + 1e-6)``; ``std=population,
eps_mode=threshold`` is the population std with a threshold (``where(std > eps, c / std, 0)``), which keeps the
epsilon out of the scale. Whatever the convention, a group whose rewards are all exactly equal gets
advantage exactly 0: an epsilon may avoid a division by zero, it must never manufacture a signal out of rounding
noise in the mean.

RLOO::

    A_i = R_i − (Σ_g R − R_i) / (n_g − 1)

needs at least two rollouts per group (checked before it runs).

Token rewards ``[B, T]`` are summed over action positions into the sequence score first. Advantages are ``[B]`` and
carry no gradient.
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from pydantic import Field

import lossplug
from lossplug.ops import Groups


def sequence_scores(batch: lossplug.PolicyBatch) -> torch.Tensor:
    reward = cast(torch.Tensor, batch.reward)  # set: the estimators that call this require it
    if reward.ndim == 2:
        reward = torch.where(batch.action_mask, reward, 0).sum(-1)
    return reward


class GRPOParams(lossplug.Params):
    scale: Literal["group", "batch", "none"] = Field("group", description="what the centred reward is divided by")
    std: Literal["sample", "population"] = Field("sample", description="Bessel-corrected (TRL, verl) or not (ddof=0)")
    eps: float = Field(1e-6, ge=0, description="epsilon of the division (TRL: 1e-4, verl: 1e-6)")
    eps_mode: Literal["add", "threshold"] = Field(
        "add", description="add: c / (std + eps) (TRL, verl); threshold: c / std where std > eps, else 0"
    )


@lossplug.advantage("grpo", params=GRPOParams, requires=("reward", "group_id"))
def grpo(batch: lossplug.PolicyBatch, p: GRPOParams) -> torch.Tensor:
    """GRPO: (R − mean_group) / std (group, batch or none); exactly 0 for groups of equal rewards.

    Paper: Shao et al., 2024, *DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models*,
    arXiv:2402.03300 (GRPO); ``scale: none`` is Dr. GRPO (Liu et al., 2025, *Understanding R1-Zero-Like Training: A
    Critical Perspective*, arXiv:2503.20783).

    Reference: verl ``compute_grpo_outcome_advantage``; TRL ``GRPOTrainer`` (``scale_rewards``).
    """
    reward = sequence_scores(batch)
    groups = Groups.from_ids(cast(torch.Tensor, batch.group_id))  # set: required
    centered = reward - groups.mean(reward)[groups.inverse]
    constant = groups.constant(reward)[groups.inverse]
    if p.scale == "none":
        adv = centered
    else:
        unbiased = p.std == "sample"
        if p.scale == "group":
            std = groups.std(reward, unbiased=unbiased)[groups.inverse]
        else:
            std = (
                reward.std(unbiased=unbiased).expand_as(reward)
                if reward.numel() > int(unbiased)
                else torch.zeros_like(reward)
            )
        if p.eps_mode == "add":
            denom = std + p.eps  # eps may be 0: a std that underflowed to 0 must not turn into ±inf
            adv = torch.where(denom > 0, centered / denom, torch.zeros_like(centered))
        else:
            adv = torch.where(std > p.eps, centered / std, torch.zeros_like(centered))
    return torch.where(constant, torch.zeros_like(adv), adv)


@lossplug.advantage("rloo", requires=("reward", "group_id"), min_group_size=2)
def rloo(batch: lossplug.PolicyBatch, p: lossplug.NoParams) -> torch.Tensor:
    """RLOO: R_i − mean of the other rollouts of the group (leave-one-out baseline); ≥ 2 rollouts per group.

    Paper: Ahmadian et al., 2024, *Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
    Feedback in LLMs*, arXiv:2402.14740; the leave-one-out baseline from Kool et al., 2019, *Buy 4 REINFORCE
    Samples, Get a Baseline for Free!* (ICLR 2019 workshop).

    Reference: verl ``compute_rloo_outcome_advantage``.
    """
    reward = sequence_scores(batch)
    groups = Groups.from_ids(cast(torch.Tensor, batch.group_id))  # set: required
    n = groups.counts.to(reward.dtype)[groups.inverse]
    others = (groups.sum(reward)[groups.inverse] - reward) / (n - 1)
    adv = reward - others
    return torch.where(groups.constant(reward)[groups.inverse], torch.zeros_like(adv), adv)
