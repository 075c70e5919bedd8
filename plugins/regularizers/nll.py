"""Negative log-likelihood of the sampled tokens: ``term = −logp`` on the action tokens of the selected responses,
added to the loss as ``coef · reduce(term)`` — imitation of the policy's own good samples.

``responses`` selects the rows that get the term (0 elsewhere):

* ``positive_reward`` — responses whose sequence reward (``reward``, token rewards summed over the actions) is
  ``> threshold``: VAPO's positive-example LM loss (with 0/1 rewards, the correct answers);
* ``positive_advantage`` — responses whose advantage is ``> threshold`` (a ``[B, T]`` advantage: its mean over the
  response's actions);
* ``all`` — every response: plain cross-entropy / SFT on the samples (SkyRL's ``cross_entropy`` policy loss, a sum:
  ``reduction: token_sum``).

``denominator``: ``reduction`` — the term is reduced like any regularizer (e.g. ``token``: divided by every action
token of the step's population, selected or not); ``selected`` — VAPO's normalisation, the mean over the selected
responses' tokens only: the term is multiplied by ``tokens / selected tokens`` of the micro-batch, which with
``reduction: token, population: micro_batch`` gives exactly ``Σ_{selected} −logp / #selected tokens`` per micro-batch
(a micro-batch without a selected response adds 0). The gradient flows through ``logp``: ``∂term/∂logp = −1`` (times
the rescaling) on the selected actions. Correction weights never multiply it.

Paper: Yue et al., 2025, *VAPO: Efficient and Reliable Reinforcement Learning for Advanced Reasoning Tasks*,
arXiv:2504.05118 (positive example LM loss, ``L = L_PPO + μ · L_NLL``, μ = 0.1).

Reference: SkyRL 0.3.0 ``cross_entropy_loss`` (``skyrl/backends/skyrl_train/utils/ppo_utils.py``,
``PolicyLossRegistry`` "cross_entropy": ``(−log_probs · loss_mask).sum()``).
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from pydantic import Field

import lossplug

Tensor = torch.Tensor


class NLLParams(lossplug.RegularizerParams):
    coef: float = Field(
        0.1,
        allow_inf_nan=False,
        description="μ: the loss gains μ · reduce(−logp) over the selected responses (VAPO: 0.1)",
    )
    responses: Literal["positive_reward", "positive_advantage", "all"] = Field(
        "positive_reward",
        description="which responses get the term: reward > threshold (VAPO), advantage > threshold, or all "
        "(cross-entropy, SkyRL's cross_entropy)",
    )
    threshold: float = Field(
        0.0, allow_inf_nan=False, description="a response is positive when its reward (or advantage) is > threshold"
    )
    denominator: Literal["reduction", "selected"] = Field(
        "reduction",
        description="reduction: the recipe's (or this term's) reduction over all action tokens; selected: rescaled "
        "to the selected responses' tokens (VAPO's mean, exact with population micro_batch)",
    )


def _requires(p: NLLParams) -> tuple[str, ...]:
    return ("reward",) if p.responses == "positive_reward" else ()


def selected_rows(inp: lossplug.GateInput, p: NLLParams) -> Tensor | None:
    """``[B]`` bool: the responses that get the term (None: all of them)."""
    if p.responses == "all":
        return None
    if p.responses == "positive_reward":
        reward = cast(Tensor, inp.batch.reward).detach()  # declared in requires=
        if reward.ndim == 2:
            reward = torch.where(inp.mask, reward, 0).sum(-1)
        return reward > p.threshold
    advantage = inp.seq_advantage if inp.seq_advantage is not None else inp.sequence_mean(inp.advantage)
    return advantage > p.threshold


@lossplug.regularizer("nll", params=NLLParams, requires=_requires)
def nll(inp: lossplug.GateInput, p: NLLParams) -> lossplug.RegularizerOutput:
    """``μ · reduce(−logp)`` over the action tokens of the selected responses (VAPO's positive-example LM loss).

    Paper: Yue et al., 2025, *VAPO*, arXiv:2504.05118.

    Reference: SkyRL ``cross_entropy_loss`` (``responses: all``, ``reduction: token_sum``).
    """
    rows = selected_rows(inp, p)
    term = -inp.logp
    if rows is not None:
        term = torch.where(rows.unsqueeze(-1), term, 0)
    if p.denominator == "selected":
        lengths = inp.lengths if rows is None else torch.where(rows, inp.lengths, 0)
        selected = lengths.sum()
        scale = inp.lengths.sum().to(term.dtype) / selected.clamp(min=1).to(term.dtype)
        term = term * scale
    selected_fraction = (lambda: inp.response_fraction(rows)) if rows is not None else None
    metrics = {"token_mean": lambda: inp.masked_mean(term.detach())}
    if selected_fraction is not None:
        metrics["selected_fraction"] = selected_fraction
    return lossplug.RegularizerOutput(term=term, metrics=metrics)
