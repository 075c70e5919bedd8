"""The reward normalised over the whole batch — no groups, one value per response::

    A_i = (R_i − c·mean_B R) / d          c = 1 with center (else 0)      d = std_B R + eps with scale (else 1)

``mean_B``/``std_B`` are over the batch's responses (each response counts once, whatever its length); ``std`` is
the population (``ddof=0``, numpy's default) or the Bessel-corrected sample std. A batch whose rewards are all equal
gets exactly 0 when centred (an epsilon never turns rounding noise into a signal). The frameworks' uses:

* rLLM ``prpo``: centre and scale, population std, ``eps`` 1e-6 (the defaults);
* rLLM ``reinforce`` and NeMo-RL ``raw_reward`` (without ``normalize_advantages``): ``center: false, scale: false``,
  the raw reward;
* OpenRLHF ``flash_reinforce``: ``scale: false``, the batch-mean baseline of the single-rollout regime;
* ROLL ``reinforce`` with ``norm_mean_type: batch, norm_std_type: batch``: ``std: sample`` (torch's), ``eps`` 1e-6.

Token rewards ``[B, T]`` are summed over action positions first. Advantages are ``[B]``, at least float32, and carry
no gradient. The batch is the one the advantage stage is given: the whole rollout batch in a trainer.

Paper: Williams, 1992, *Simple Statistical Gradient-Following Algorithms for Connectionist Reinforcement Learning*
(REINFORCE with a constant baseline).

Reference: rLLM (rllm-org/rllm, commit 9beb6e0f) ``rllm/trainer/algorithms/advantage.py``
(``calculate_prpo_advantages``: ``(r − mean) / (np.std(r) + 1e-6)`` over the flattened batch;
``calculate_reinforce_advantages``); OpenRLHF 0.11.2 ``openrlhf/trainer/ppo_utils/experience_maker.py``
(``flash_reinforce``: ``rewards − rewards.mean()``); ROLL (alibaba/ROLL, commit 8eb27cc2) ``roll/utils/functionals.py``
``reward_norm`` (``norm_mean_type``/``norm_std_type: batch``: ``(r − r.mean()) / (r.std() + 1e-6)``).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

import lossplug

from ._verl_statistics import at_least_float32
from .group_relative import sequence_scores

Tensor = torch.Tensor


class BatchNormalizedParams(lossplug.Params):
    center: bool = Field(True, description="subtract the batch's mean reward (rLLM prpo, OpenRLHF flash_reinforce)")
    scale: bool = Field(True, description="divide by the batch's reward std + eps (rLLM prpo)")
    std: Literal["population", "sample"] = Field(
        "population", description="population std, ddof=0 (rLLM, numpy) or the Bessel-corrected one (ROLL, torch)"
    )
    eps: float = Field(1e-6, ge=0, description="epsilon added to the std (rLLM, ROLL: 1e-6)")


@lossplug.advantage("batch_normalized", params=BatchNormalizedParams, requires=("reward",))
def batch_normalized(batch: lossplug.PolicyBatch, p: BatchNormalizedParams) -> Tensor:
    """Batch-normalised reward: A_i = (R_i − mean_B R) / (std_B R + eps), centring and scaling each optional."""
    score = at_least_float32(sequence_scores(batch))
    adv = score - score.mean() if p.center else score
    if p.scale:
        unbiased = p.std == "sample"
        std = score.std(unbiased=unbiased) if score.numel() > int(unbiased) else score.new_zeros(())
        denom = std + p.eps
        adv = torch.where(denom > 0, adv / denom, torch.zeros_like(adv))  # eps 0 and a constant batch
    if p.center:
        adv = torch.where((score == score[0]).all(), torch.zeros_like(adv), adv)
    return adv
