"""Reductions: how the per-token objective becomes one scalar — the choice that sets each token's implicit weight.

With ``L`` the per-token objective (zero off actions), ``|o_i|`` the action tokens of response ``i``, and the
population of the whole optimizer step (``N`` action tokens, ``S`` responses; a micro-batch without a
:class:`~lossplug.Normalizer` is its own population)::

    response      Σ_i (Σ_t L_it / |o_i|) / S        every response weighs the same (GRPO)
    token         Σ_i Σ_t L_it / N                  every action token weighs the same (DAPO)
    fixed         Σ_i Σ_t L_it / (budget · S)       per-response sums over a fixed budget (Dr. GRPO)
    sequence_sum  Σ_i Σ_t L_it / S                  mean of per-response sums
    token_sum     Σ_i Σ_t L_it                      unnormalised sum (verl's token-sum)
    prompt_mean   Σ_g (Σ_{i∈g} Σ_t L_it / N_g) / G  mean over prompt groups of their token means (SkyRL)

Each is additive over micro-batches: the sum over all micro-batches and ranks of their values equals the value of
the whole step — which is why the denominators come from the step's population and never from the micro-batch.
``token_sum`` has no denominator, so it is additive under any split by construction and reads no population: a
:class:`~lossplug.Normalizer` changes nothing (an adapter's own scaling, e.g. verl's ``× dp_size``, still applies).

``population: micro_batch`` (a parameter of every reduction here, default ``step``): the micro-batch is its own
population — ``N``, ``S`` are its own counts — and its value is weighted by ``1 / Normalizer.micro_batches`` (else
its share of the step's responses, rows / ``S_step``): a mean of per-micro-batch values, which depends on how the
step is split (TRL's ``bnpo``; verl's ``geo_mean``, whose engine adds each micro-batch's own mean — the verl adapter
hands such a reduction no step population, see docs/verl.md). Not additive by design.

``S`` counts the responses that have at least one action token (``lossplug.pipeline.population_of``); a
``Normalizer`` gives the trainer's own count instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pydantic import Field
from torch import Tensor

import lossplug
from lossplug.contracts import LossplugError


@lossplug.reduction("response")
def response_mean(
    objective: Tensor, mask: Tensor, lengths: Tensor, population: lossplug.Population, p: lossplug.ReductionParams
) -> Tensor:
    """Mean over responses of each response's token mean (every response weighs the same).

    Paper: GRPO's per-response mean, Shao et al., 2024, arXiv:2402.03300.

    Reference: verl, ``verl.trainer.ppo.core_algos.agg_loss`` with ``loss_agg_mode="seq-mean-token-mean"``; TRL
    ``GRPOTrainer`` with ``loss_type="grpo"`` (and ``"sapo"``).
    """
    per_response = objective.sum(-1) / lengths.clamp(min=1).to(objective.dtype)
    return per_response.sum() / population.sequences


@lossplug.reduction("token")
def token_mean(
    objective: Tensor, mask: Tensor, lengths: Tensor, population: lossplug.Population, p: lossplug.ReductionParams
) -> Tensor:
    """Global action-token mean (every action token weighs the same; DAPO).

    Paper: DAPO's token-level policy-gradient loss, Yu et al., 2025, arXiv:2503.14476.

    Reference: verl, ``verl.trainer.ppo.core_algos.agg_loss`` with ``loss_agg_mode="token-mean"``; TRL
    ``GRPOTrainer`` with ``loss_type="dapo"`` (``"bnpo"`` is the same reduction over each micro-batch alone).
    """
    return objective.sum() / population.action_tokens


class FixedParams(lossplug.ReductionParams):
    budget: float | None = Field(None, gt=0, description="tokens per response; default: the Normalizer's budget")


@lossplug.reduction("fixed", params=FixedParams)
def fixed_budget(
    objective: Tensor, mask: Tensor, lengths: Tensor, population: lossplug.Population, p: FixedParams
) -> Tensor:
    """Per-response sums divided by a fixed token budget, averaged over responses (Dr. GRPO).

    Paper: Dr. GRPO, Liu et al., 2025, *Understanding R1-Zero-Like Training: A Critical Perspective*,
    arXiv:2503.20783.

    Reference: verl, ``verl.trainer.ppo.core_algos.agg_loss`` with ``loss_agg_mode="seq-mean-token-sum-norm"``; TRL
    ``GRPOTrainer`` with ``loss_type="dr_grpo"`` (budget ``max_completion_length``).
    """
    budget = p.budget if p.budget is not None else population.budget
    if budget is None:
        raise LossplugError(
            "reduction 'fixed' needs a positive budget: set it in the recipe "
            "({name: fixed, budget: 1024}) or pass Normalizer(budget=...)"
        )
    return objective.sum() / (budget * population.sequences)


@lossplug.reduction("sequence_sum")
def sequence_sum(
    objective: Tensor, mask: Tensor, lengths: Tensor, population: lossplug.Population, p: lossplug.ReductionParams
) -> Tensor:
    """Mean over responses of each response's token sum.

    Reference: verl, ``verl.trainer.ppo.core_algos.agg_loss`` with ``loss_agg_mode="seq-mean-token-sum"``; TRL
    ``GRPOTrainer`` with ``loss_type="luspo"``.
    """
    return objective.sum() / population.sequences


@lossplug.reduction("token_sum")
def token_sum(
    objective: Tensor, mask: Tensor, lengths: Tensor, population: lossplug.Population, p: lossplug.ReductionParams
) -> Tensor:
    """Sum over every action token, no denominator (verl's ``token-sum``): the population is not read.

    Reference: verl, ``verl.trainer.ppo.core_algos.agg_loss`` with ``loss_agg_mode="token-sum"``.
    """
    return objective.sum()


@lossplug.reduction("prompt_mean", requires=("group_id",))
def prompt_mean(
    objective: Tensor, mask: Tensor, lengths: Tensor, population: lossplug.Population, p: lossplug.ReductionParams
) -> Tensor:
    """Mean over prompts of each prompt group's token mean: Σ_g (Σ_{i∈g} Σ_t L_it / N_g) / G.

    ``N_g`` is the action tokens of prompt group ``g`` (at least 1), ``G`` the number of groups, both over the
    population: the Normalizer's ``groups`` and ``group_tokens`` (``Normalizer.for_masks(..., group_ids=...)``
    counts them) — so a group whose responses lie in several micro-batches or ranks is still divided by its whole
    token count, and the micro-batch shares add up to the full step's value; without a Normalizer the micro-batch's
    own groups. Every prompt weighs the same, whatever the number or length of its responses; within a prompt every
    action token does. Needs the batch's ``group_id``.

    Reference: SkyRL 0.3.0, ``skyrl/backends/skyrl_train/utils/ppo_utils.py``
    ``apply_loss_reduction_to_advantages_minibatch`` (``loss_reduction="prompt_mean"``: token ``[i, t]`` of prompt
    ``p`` scaled by ``1 / (num_prompts · tokens_in_prompt_p)``, ``tokens_in_prompt_p`` clamped at 1, over the
    mini-batch, then summed).
    """
    group_id = population.group_id
    if group_id is None:
        raise LossplugError(
            "reduction 'prompt_mean' needs the batch's group_id (the prompt group of each response): set "
            "PolicyBatch.group_id (lossplug.reduce: group_id=...)"
        )
    per_row = objective.sum(-1)
    if not population.of_step:  # the micro-batch is its own population
        same = group_id.unsqueeze(-1) == group_id.unsqueeze(0)  # [B, B]: no unique(), no host synchronisation
        group_tokens = (same * lengths.unsqueeze(0)).sum(-1).to(objective.dtype)
        groups = (1.0 / same.sum(-1).to(objective.dtype)).sum()
        return (per_row / group_tokens.clamp(min=1)).sum() / groups
    if population.group_tokens is None or population.groups is None:
        raise LossplugError(
            "reduction 'prompt_mean' needs the step's prompt groups and their action tokens in the Normalizer: "
            "build it with Normalizer.for_masks(masks, group_ids=[...]) (it counts groups and group_tokens)"
        )
    ids, counts = (torch.tensor(column, device=group_id.device) for column in zip(*population.group_tokens))
    where = torch.searchsorted(ids, group_id).clamp(max=ids.numel() - 1)
    # a group the Normalizer did not count is refused on the CPU; on an accelerator the check would stall the stream
    if group_id.device.type == "cpu" and not bool((ids[where] == group_id).all()):
        missing = sorted(set(group_id.tolist()) - set(ids.tolist()))[:8]
        raise LossplugError(
            f"reduction 'prompt_mean': group_id {missing} of this micro-batch are not in the Normalizer's "
            "group_tokens — it must count every prompt group of the step"
        )
    group_tokens = counts[where].to(objective.dtype)
    return (per_row / group_tokens.clamp(min=1)).sum() / population.groups


@lossplug.hookimpl
def lossplug_register_reductions(register: Callable[[lossplug.ReductionPlugin], None]) -> None:
    for plugin in (response_mean, token_mean, fixed_budget, sequence_sum, token_sum, prompt_mean):
        register(plugin)
