"""The advantage seam: verl's advantage estimator ``lossplug`` (:func:`compute_lossplug_advantage`, what
``ray_trainer.compute_advantage`` calls) and :func:`compute_advantage` on a ``DataProto`` for custom trainers; the
batch the advantage stage sees is built in :func:`advantage_batch`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

import lossplug
from lossplug.adapters.common import ActionRows, warn_once
from lossplug.adapters.unfed import Unfed
from lossplug.adapters.verl.recipes import ADVANTAGE_RECIPE_KEY, keyed, load_recipe
from lossplug.adapters.verl.registration import MARK, NAME, check_once
from lossplug.adapters.verl.unfed import ADVANTAGE_PROVIDED, ADVANTAGE_UNFED
from lossplug.contracts import LossplugError, PolicyBatch, Recipe, RecipeError
from lossplug.contracts.batch_rules import rewards_off_actions

__all__ = ["advantage_batch", "compute_advantage", "compute_lossplug_advantage", "group_ids"]

Tensor = torch.Tensor


def group_ids(index: Any) -> Tensor:
    """verl's ``uid`` (numpy object array of strings, or any sequence of hashables) → ``[B]`` int64 group ids,
    numbered in order of first appearance."""
    ids: dict[Any, int] = {}
    out = [ids.setdefault(u, len(ids)) for u in np.asarray(index, dtype=object).reshape(-1).tolist()]
    return torch.tensor(out, dtype=torch.long)


#: PolicyBatch field → the DataProto key it is read from, for plugins that need more than rewards
_EXTRA_FIELDS = {
    "value": "values",
    "old_logp": "old_log_probs",
    "ref_logp": "ref_log_prob",
    "behavior_logp": "rollout_log_probs",
    "reward_baseline": "reward_baselines",
    "sum_pi_squared": "sum_pi_squared",
}


def _algorithm_value(config: Any, key: str) -> Any:
    if config is None:
        return None
    if hasattr(config, "get"):
        try:
            return config.get(key)
        except Exception:  # pragma: no cover
            return None
    return getattr(config, key, None)


def _advantage_stage(recipe: Recipe, key: str) -> Any:
    stage = lossplug.compile_recipe(recipe).advantage
    if stage is None:
        raise LossplugError(f"{key}: the recipe has no advantage stage; add one, e.g. advantage: {{name: grpo}}")
    return stage


def compute_lossplug_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Any = None,
    config: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """verl advantage estimator ``lossplug``: the advantage stage of ``algorithm.lossplug``.

    Returns ``(advantages, returns)``, both ``[B, T]`` and zero off the response mask; ``returns`` are the critic
    targets where the plugin has a critic (GAE: ``A + V_old``), otherwise the advantages (verl's convention).
    ``algorithm.gamma``, ``lam`` and ``norm_adv_by_std_in_grpo`` are not read: the recipe's parameters are.

    verl's ``ray_trainer.compute_advantage`` passes a registered estimator only ``token_level_rewards``,
    ``response_mask``, ``index`` (uid) and ``reward_baselines``: a plugin that needs anything else (critic
    ``values`` for ``gae``, log-probs) is refused here with the way out — :func:`compute_advantage` on the
    ``DataProto`` in a custom trainer, or verl's own estimator.
    """
    check_once("estimator")
    source = _algorithm_value(config, "lossplug")
    if source is None:
        raise LossplugError(
            f"algorithm.adv_estimator={NAME} needs a recipe: +{ADVANTAGE_RECIPE_KEY}=<preset | "
            f"/abs/path/recipe.yaml | {{…}}> (its advantage stage is used)"
        )
    recipe = load_recipe(source, ADVANTAGE_RECIPE_KEY)
    stage = _advantage_stage(recipe, ADVANTAGE_RECIPE_KEY)
    for name in ("gamma", "lam"):
        if name in type(stage.params).model_fields:
            ours, theirs = getattr(stage.params, name), _algorithm_value(config, name)
            if theirs is not None and float(theirs) != float(ours):
                warn_once(
                    f"{name}:{ours}:{theirs}",
                    (
                        f"lossplug: {ADVANTAGE_RECIPE_KEY} uses {stage.plugin.name} {name}={ours}; algorithm.{name}="
                        f"{theirs} is not read under adv_estimator={NAME}"
                    ),
                )
    extra = {key: value for key, value in kwargs.items() if key in _EXTRA_FIELDS.values() and value is not None}
    return _estimate(recipe, ADVANTAGE_RECIPE_KEY, token_level_rewards, response_mask, index, extra, from_verl=True)


def compute_advantage(data: Any, recipe: Any, *, reward_keys: Sequence[str] | None = None) -> Any:
    """The recipe's advantage stage on a verl ``DataProto``, for custom trainers: the explicit path for plugins that
    read more than verl hands a registered estimator (``gae`` reads the critic's ``values``).

    Reads ``token_level_rewards``, ``response_mask`` and ``non_tensor_batch["uid"]``, plus whatever the plugin
    requires of ``values``, ``old_log_probs``, ``ref_log_prob``, ``rollout_log_probs``, ``reward_baselines`` and
    ``sum_pi_squared`` from ``data.batch``; ``reward_keys`` (verl's ``algorithm.gdpo_reward_keys``) name the
    per-response reward components, read from ``data.non_tensor_batch`` (or ``data.batch``) as the columns of
    ``PolicyBatch.reward_components`` for multi-reward plugins (``gdpo``). Writes ``data.batch["advantages"]`` and ``data.batch["returns"]`` (``[B, T]``, zero off the
    response mask) and returns ``data`` — what ``verl.trainer.ppo.ray_trainer.compute_advantage`` does with verl's
    own estimators. ``recipe``: a :class:`~lossplug.Recipe`, preset name, YAML/JSON path or mapping.
    """
    batch = data.batch
    where = "compute_advantage(recipe)"
    recipe = load_recipe(recipe, where)
    _advantage_stage(recipe, where)
    keys = set(batch.keys())
    for needed in ("token_level_rewards", "response_mask"):
        if needed not in keys:
            raise LossplugError(f"compute_advantage: data.batch has no '{needed}' (keys: {', '.join(sorted(keys))})")
    extra = {key: batch[key] for key in _EXTRA_FIELDS.values() if key in keys}
    if reward_keys:
        extra[_REWARD_COMPONENTS] = _reward_components(data, list(reward_keys), batch["token_level_rewards"])
    uid = data.non_tensor_batch.get("uid") if getattr(data, "non_tensor_batch", None) is not None else None
    adv, ret = _estimate(
        recipe, where, batch["token_level_rewards"], batch["response_mask"], uid, extra, from_verl=False
    )
    batch["advantages"] = adv
    batch["returns"] = ret
    return data


#: the pseudo DataProto key under which compute_advantage hands the stacked reward components to _estimate
_REWARD_COMPONENTS = "reward_components"


def _reward_components(data: Any, reward_keys: list[str], rewards: Tensor) -> Tensor:
    """``[B, K]`` float64: one column per key, from ``non_tensor_batch`` (verl's reward manager's per-response scores)
    or ``batch``."""
    non_tensor = getattr(data, "non_tensor_batch", None) or {}
    columns = []
    for key in reward_keys:
        if key in non_tensor:
            column = torch.as_tensor(np.asarray(non_tensor[key], dtype=np.float64))
        elif key in data.batch.keys():
            column = data.batch[key].to(torch.float64)
        else:
            raise LossplugError(
                f"compute_advantage: reward_keys names '{key}', which is in neither data.non_tensor_batch "
                f"({', '.join(sorted(non_tensor)) or 'empty'}) nor data.batch"
            )
        if column.ndim != 1 or column.shape[0] != rewards.shape[0]:
            raise LossplugError(
                f"compute_advantage: reward component '{key}' must hold one value per response "
                f"([{rewards.shape[0]}]), got shape {list(column.shape)}"
            )
        columns.append(column.to(rewards.device))
    return torch.stack(columns, -1)


def _estimate(
    recipe: Recipe,
    key: str,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Any,
    extra_by_verl_key: Mapping[str, Tensor],
    *,
    from_verl: bool,
) -> tuple[Tensor, Tensor]:
    """``(advantages, returns)``, ``[B, T]`` and zero off the response mask (and on the rows without an action
    token, which the advantage stage never sees)."""
    stage = _advantage_stage(recipe, key)
    mask = response_mask.bool()
    T = mask.shape[1]
    dtype = token_level_rewards.dtype if token_level_rewards.is_floating_point() else torch.float32
    advantages = torch.zeros(*mask.shape, dtype=dtype, device=token_level_rewards.device)
    returns = torch.zeros_like(advantages)
    extra = _needed_fields(stage, key, extra_by_verl_key, from_verl=from_verl)
    rows = ActionRows(mask)
    if rows.none:
        return advantages, returns
    # the contract's rule, asked here on verl's own tensors: its positions are verl's rows (the rows without an
    # action token are dropped below), and the message names verl's fields
    off_actions = rewards_off_actions(token_level_rewards, mask)
    if off_actions is not None:
        raise LossplugError(
            f"token_level_rewards (PolicyBatch.reward): {off_actions.rule}; here outside response_mask at "
            f"{off_actions.where} (verl's outcome estimators sum every position, lossplug's only the actions)"
        )
    batch = advantage_batch(rows, mask, token_level_rewards.to(dtype), index, extra)
    try:
        result = lossplug.estimate_advantages(batch, recipe)
    except RecipeError as err:
        raise keyed(err, key) from None
    adv = result.advantage
    if adv.ndim == 1:
        adv = adv.unsqueeze(-1).expand(-1, T)
    ret = result.returns if result.returns is not None else adv
    kept_mask = batch.action_mask
    adv = torch.where(kept_mask, adv.to(dtype), 0)
    ret = torch.where(kept_mask, ret.to(dtype), 0)
    return rows.scatter(adv, advantages), rows.scatter(ret, returns)


def _needed_fields(
    stage: Any, key: str, extra_by_verl_key: Mapping[str, Tensor], *, from_verl: bool
) -> dict[str, Tensor]:
    """The batch fields beyond rewards that the advantage plugin requires, by :class:`~lossplug.PolicyBatch` name,
    from what the caller holds (verl's keys); every missing one refused at once, each with its next step (the rows
    of :data:`~lossplug.adapters.verl.unfed.ADVANTAGE_UNFED` where verl cannot hand it over)."""
    plugin = stage.plugin
    extra: dict[str, Tensor] = {}
    fields_by_key = {**_EXTRA_FIELDS, "reward_components": _REWARD_COMPONENTS}
    problems = []
    for name in plugin.required_fields(stage.params):
        if name in ADVANTAGE_PROVIDED:
            continue
        verl_key = fields_by_key.get(name)
        value = extra_by_verl_key.get(verl_key) if verl_key is not None else None
        if value is not None:
            extra[name] = value
        elif verl_key is None or from_verl:  # not a DataProto key the adapter reads, or verl does not pass it
            row = ADVANTAGE_UNFED[name]
            problems.append(f"advantage plugin '{plugin.name}' needs '{verl_key or name}': {row.why}. {_next(row)}")
        else:
            step = {
                "values": "set critic.enable=True (a critic-based recipe needs the critic's values)",
                _REWARD_COMPONENTS: "pass reward_keys= (verl's algorithm.gdpo_reward_keys)",
                "sum_pi_squared": "set actor.calculate_sum_pi_squared=True (verl then computes it)",
            }.get(verl_key, f"put '{verl_key}' in data.batch")
            problems.append(
                f"advantage plugin '{plugin.name}' needs '{verl_key}', which the batch does not hold. Next step: {step}"
            )
    if len(problems) == 1:
        raise LossplugError(f"{key}: {problems[0]}")
    if problems:
        raise LossplugError(f"{key}: the advantage stage cannot run:\n  - " + "\n  - ".join(problems))
    return extra


def _next(row: Unfed) -> str:
    return f"Next step: {row.next_step}"


def advantage_batch(
    rows: ActionRows, mask: Tensor, rewards: Tensor, index: Any, extra: Mapping[str, Tensor]
) -> PolicyBatch:
    """The :class:`~lossplug.PolicyBatch` the advantage stage sees, of the rows with an action token:
    ``token_level_rewards`` → ``reward`` (``[B, T]``), ``uid`` → integer ``group_id``, the ``extra`` fields (by
    their batch names), and ``old_logp`` (or zeros) as ``logp``: the one place a new advantage-stage field gets
    filled from verl's batch."""
    take = rows.take
    fields: dict[str, Any] = {name: take(value) for name, value in extra.items()}
    logp = fields.get("old_logp")
    fields["logp"] = logp if logp is not None else torch.zeros_like(take(mask), dtype=rewards.dtype)
    fields["action_mask"] = take(mask)
    fields["reward"] = take(rewards)
    if index is not None:
        fields["group_id"] = take(group_ids(index).to(mask.device))
    return PolicyBatch.unchecked(**fields)


setattr(compute_lossplug_advantage, MARK, True)
