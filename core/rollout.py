"""The rollout side of a recipe: its shapers and filters, once per rollout batch, in the recipe's order, before the
advantage.

* A **shaper** rewrites the reward: ``reward ← shaper(batch with the reward so far)``. A ``[B]`` reward may become
  ``[B, T]`` (KL in the reward puts ``-β·KL`` on every action token and the score on the last one); never the
  other way round.
* A **filter** narrows the action mask: ``action_mask ← action_mask & keep`` with ``keep`` ``[B]`` (responses) or
  ``[B, T]`` (tokens). A response with no action token left is *out of play*: it keeps its row (the trainer's
  tensors keep their shape) but takes no part in anything after — the advantage's group statistics are computed
  without it and give it 0, and the mask the adapters hand back to the trainer leaves it out of every denominator
  (the token mean, the global token and sequence counts under data parallelism and gradient accumulation).

Stateful stages (an adaptive KL coefficient, running statistics) keep their state in the stage's controller
(:mod:`lossplug.control`): the pipeline feeds it the shaper's ``observation`` and steps it once per rollout batch,
with ``peers``' sum as the all-reduce, so that it is the same on every rank (a shaper that needs the updated state
for its own output — running statistics that include the batch — steps it itself, with ``inp.all_reduce``); ``lossplug.controller_state(recipe)``
includes it, so it is saved with the trainer's checkpoint and restored on resume like a regularizer's.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lossplug.contracts import LossplugError, PluginError, PolicyBatch, RolloutResult
from lossplug.contracts.errors import describe_positions

from .peers import LOCAL, Peers
from .plugin import Lazy, evaluate
from .rollout_plugin import FilterOutput, FilterPlugin, RolloutInput, ShaperOutput, ShaperPlugin
from .stages import CompiledRecipe, RolloutStage, run_stage

Tensor = torch.Tensor

__all__ = ["apply_rollout_stages", "select_rows"]


def apply_rollout_stages(
    batch: PolicyBatch, compiled: CompiledRecipe, *, validate: str = "full", peers: Peers | None = None
) -> RolloutResult:
    """Run ``compiled``'s shapers, then its filters, on ``batch`` (already checked by the caller); see the module
    docstring. Returns the reward and action mask they leave, the responses still in play and their metrics."""
    peers = LOCAL if peers is None else peers
    reward = batch.reward
    if reward is None:
        raise LossplugError(
            "recipe.shapers / recipe.filters: the batch has no reward (the rollout stages rewrite and filter the "
            "rewards before the advantage; give PolicyBatch(reward=...))"
        )
    metrics: dict[str, Tensor] = {}
    current = batch
    for stage in compiled.shapers:
        reward = _shape(stage, current, validate, peers, metrics)
        current = PolicyBatch.unchecked(**{**current.fields(), "reward": reward})
    mask = current.action_mask
    for filter_stage in compiled.filters:
        mask = _filter(filter_stage, current, validate, peers, metrics)
        current = PolicyBatch.unchecked(**{**current.fields(), "action_mask": mask})
    rows = mask.any(-1) if compiled.filters else torch.ones_like(mask[:, 0])
    with torch.no_grad():
        metrics["rollout/kept_responses"] = rows.float().mean()
        if compiled.filters:
            metrics["rollout/kept_tokens"] = mask.sum() / batch.action_mask.sum().clamp(min=1)
    return RolloutResult(reward=reward, action_mask=mask, rows=rows, metric_tensors=metrics)


def _shape(
    stage: RolloutStage[ShaperPlugin],
    batch: PolicyBatch,
    validate: str,
    peers: Peers,
    metrics: dict[str, Tensor],
) -> Tensor:
    before = batch.reward
    assert before is not None
    label = f"{stage.where} ({stage.plugin.name})"
    layout = "token" if before.ndim == 2 else "response"
    if layout not in stage.plugin.rewards:
        raise LossplugError(
            f"{label} takes {' or '.join(stage.plugin.rewards)} rewards, and the reward "
            f"reaching it is per {layout} ({list(before.shape)}): give the batch a per-{stage.plugin.rewards[0]} "
            "reward, or put this shaper before the shapers that make a per-token one (kl_in_reward)"
        )
    with torch.no_grad():
        out: ShaperOutput = run_stage(stage, validate, RolloutInput(batch, stage.controller, peers))
    if not isinstance(out, ShaperOutput):
        raise PluginError(f"{label} must return the reward as a tensor (or a ShaperOutput), got {type(out).__name__}")
    reward = out.reward
    if validate == "full":
        _check_reward(reward, before, batch, label)
    _record(metrics, f"shaper/{stage.metric_name}", out.metrics)
    if stage.controller is not None:
        # the coefficient the batch was shaped with (verl's reward_kl_penalty_coeff), then the step: after the batch
        # is shaped with the state in force (verl's KL controller); a shaper whose output needs the updated state
        # (running statistics that include this batch) steps its controller itself and returns no observation
        used = stage.controller.coefficient
        metrics[f"shaper/{stage.metric_name}/coef"] = torch.tensor(used, dtype=torch.float64)
        if out.observation is not None:
            stage.controller.observe(out.observation.detach())
            stage.controller.step(None if peers.local else peers.sum)
    return reward.detach()


def _check_reward(reward: object, before: Tensor, batch: PolicyBatch, label: str) -> None:
    if not isinstance(reward, Tensor):
        raise PluginError(
            f"{label} must return the reward as a tensor (or a ShaperOutput), got {type(reward).__name__}"
        )
    shapes = [tuple(before.shape)] + ([tuple(batch.logp.shape)] if before.ndim == 1 else [])
    if tuple(reward.shape) not in shapes:
        allowed = " or ".join(str(list(s)) for s in shapes)
        raise PluginError(f"{label} returned a reward of shape {list(reward.shape)}; the batch's is {allowed}")
    if not reward.is_floating_point():
        raise PluginError(f"{label} returned a reward of dtype {reward.dtype}; a reward is a float tensor")
    mask = batch.action_mask
    if reward.ndim == 2:  # finite on the actions, and 0 elsewhere (the contract's rule for a per-token reward)
        # a sum over every position: finite when each term is (0 off the actions, tested next) — unless it overflows,
        # which the full test below then rules out
        if bool(torch.isfinite(reward.sum())) and not bool(reward.masked_fill(mask, 0).any()):
            return
        off = reward.masked_fill(mask, 0) != 0
        if bool(off.any()):
            raise PluginError(
                f"{label} returned a per-token reward that is not 0 off the action tokens: {describe_positions(off, noun='positions')}"
            )
    elif bool(torch.isfinite(reward).all()):
        return
    bad = ~torch.isfinite(reward) & (mask if reward.ndim == 2 else mask.any(-1))
    if bool(bad.any()):
        where = describe_positions(bad, noun="positions" if reward.ndim == 2 else "rows")
        raise PluginError(f"{label} returned a reward that is not finite: {where}")


def _filter(
    stage: RolloutStage[FilterPlugin], batch: PolicyBatch, validate: str, peers: Peers, metrics: dict[str, Tensor]
) -> Tensor:
    mask = batch.action_mask
    with torch.no_grad():
        out: FilterOutput = run_stage(stage, validate, RolloutInput(batch, None, peers))
    label = f"{stage.where} ({stage.plugin.name})"
    if not isinstance(out, FilterOutput):
        raise PluginError(
            f"{label} must return a bool keep mask ([B] or [B, T]) or a FilterOutput, got {type(out).__name__}"
        )
    keep = out.keep
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
        got = f"dtype {keep.dtype}" if isinstance(keep, Tensor) else type(keep).__name__
        raise PluginError(f"{label} must return a bool keep mask ([B] or [B, T]), got {got}")
    if tuple(keep.shape) not in ((mask.shape[0],), tuple(mask.shape)):
        raise PluginError(
            f"{label} returned a keep mask of shape {list(keep.shape)}; it must be [B] {[mask.shape[0]]} (responses) "
            f"or [B, T] {list(mask.shape)} (tokens)"
        )
    name = stage.metric_name
    _record(metrics, f"filter/{name}", out.metrics)
    with torch.no_grad():
        lengths = mask.sum(-1)
        rows_before = lengths > 0
        if keep.ndim == 1:  # whole responses: counted from the lengths, the mask is read once
            narrowed = mask & keep.unsqueeze(-1)
            left = torch.where(keep, lengths, 0)
        else:
            narrowed = mask & keep
            left = narrowed.sum(-1)
        dropped_rows = rows_before & (left == 0)
        metrics[f"filter/{name}/dropped_responses"] = dropped_rows.sum() / rows_before.sum().clamp(min=1)
        metrics[f"filter/{name}/dropped_tokens"] = 1 - left.sum() / lengths.sum().clamp(min=1)
    return narrowed


def _record(metrics: dict[str, Tensor], prefix: str, declared: Mapping[str, Lazy]) -> None:
    with torch.no_grad():
        for key, value in declared.items():
            metrics[f"{prefix}/{key}"] = evaluate(value).detach()


def select_rows(batch: PolicyBatch, rows: Tensor, fields: tuple[str, ...] | None = None) -> PolicyBatch:
    """The responses ``rows`` (a ``[B]`` bool mask) of ``batch`` (each field's first dimension is the response),
    unchecked — they are rows of a batch that was checked. ``fields``: only these besides ``logp`` and
    ``action_mask`` (what the stage that reads the result needs), so that nothing else is copied."""
    present = batch.fields()
    names = present if fields is None else ("logp", "action_mask", *(f for f in fields if f in present))
    return PolicyBatch.unchecked(**{name: present[name][rows] for name in dict.fromkeys(names)})
