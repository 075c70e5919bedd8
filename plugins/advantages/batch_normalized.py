"""The reward scaled by its spread over the whole batch, one value per response::

    C_i = R_i − b_i        b_i = mean_B R (center: batch), mean_g R of the response's group (group), or 0 (none)
    A_i = C_i / (std_B C + eps)   with scale, else C_i

``mean_B``/``std_B`` are over the batch's responses (each response counts once, whatever its length); the std is the
spread of the *centred* values — for ``center: batch`` that of the rewards — the population one (``ddof=0``,
numpy's default) or the Bessel-corrected sample std. A batch (or group) whose rewards are all equal gets exactly 0
when centred (an epsilon never turns rounding noise into a signal). The frameworks' uses:

* rLLM ``prpo``: centre on the batch and scale, population std, ``eps`` 1e-6 (the defaults);
* rLLM ``reinforce_plus_plus_baseline``: ``center: group`` — the group mean, then the batch's population std of the
  centred rewards;
* rLLM ``reinforce`` and NeMo-RL ``raw_reward`` (without ``normalize_advantages``): ``center: none, scale: false``,
  the raw reward;
* OpenRLHF ``flash_reinforce``: ``scale: false``, the batch-mean baseline of the single-rollout regime;
* ROLL ``reinforce`` with ``norm_mean_type: batch, norm_std_type: batch``: ``std: sample`` (torch's), ``eps`` 1e-6.

Token rewards ``[B, T]`` are summed over action positions first. Advantages are ``[B]``, at least float32, and carry
no gradient. The batch is the one the advantage stage is given: the whole rollout batch in a trainer.

Paper: Williams, 1992, *Simple Statistical Gradient-Following Algorithms for Connectionist Reinforcement Learning*
(REINFORCE with a constant baseline).

Reference: rLLM (rllm-org/rllm, commit 9beb6e0f) ``rllm/trainer/algorithms/advantage.py``
(``calculate_prpo_advantages``: ``(r − mean) / (np.std(r) + 1e-6)`` over the flattened batch;
``calculate_reinforce_plus_plus_baseline_advantages``: group-centred, then ``/ (np.std(centred) + 1e-6)``;
``calculate_reinforce_advantages``); OpenRLHF 0.11.2 ``openrlhf/trainer/ppo_utils/experience_maker.py``
(``flash_reinforce``: ``rewards − rewards.mean()``); ROLL (alibaba/ROLL, commit 8eb27cc2) ``roll/utils/functionals.py``
``reward_norm`` (``norm_mean_type``/``norm_std_type: batch``: ``(r − r.mean()) / (r.std() + 1e-6)``).
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


class BatchNormalizedParams(lossplug.Params):
    center: Literal["batch", "group", "none"] = Field(
        "batch",
        description="subtract the batch's mean reward (rLLM prpo), the group's (rLLM REINFORCE++-baseline), or 0",
    )
    scale: bool = Field(True, description="divide by the batch's reward std + eps (rLLM prpo)")
    std: Literal["population", "sample"] = Field(
        "population", description="population std, ddof=0 (rLLM, numpy) or the Bessel-corrected one (ROLL, torch)"
    )
    eps: float = Field(1e-6, ge=0, description="epsilon added to the std (rLLM, ROLL: 1e-6)")


def _requires(p: BatchNormalizedParams) -> tuple[str, ...]:
    return ("reward", "group_id") if p.center == "group" else ("reward",)


@lossplug.advantage("batch_normalized", params=BatchNormalizedParams, requires=_requires)
def batch_normalized(batch: lossplug.PolicyBatch, p: BatchNormalizedParams) -> Tensor:
    """Batch-normalised reward: A_i = (R_i − b_i) / (std_B(R − b) + eps), b the batch's or group's mean reward or 0."""
    score = at_least_float32(sequence_scores(batch))
    equal = torch.zeros_like(score, dtype=torch.bool)
    adv = score
    if p.center == "batch":
        adv = score - score.mean()
        equal = (score == score[0]).all().expand_as(score)
    elif p.center == "group":
        groups = Groups.from_ids(cast(Tensor, batch.group_id))  # required with center: group
        adv = score - groups.mean(score)[groups.inverse]
        equal = groups.constant(score)[groups.inverse]
    if p.scale:
        unbiased = p.std == "sample"
        std = adv.std(unbiased=unbiased) if adv.numel() > int(unbiased) else adv.new_zeros(())
        denom = std + p.eps
        adv = torch.where(denom > 0, adv / denom, torch.zeros_like(adv))  # eps 0 and a constant batch
    return torch.where(equal, torch.zeros_like(adv), adv)
