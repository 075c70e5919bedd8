"""The advantage seam: verl's advantage estimator ``lossplug`` (:func:`compute_lossplug_advantage`, what
``ray_trainer.compute_advantage`` calls) and :func:`compute_advantage` on a ``DataProto`` for custom trainers; the
batch the advantage stage sees is built in :func:`advantage_batch`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import lossplug
from lossplug.adapters.common import ActionRows, warn_once
from lossplug.adapters.unfed import Unfed
from lossplug.adapters.verl.recipes import ADVANTAGE_RECIPE_KEY, keyed, load_recipe
from lossplug.adapters.verl.registration import MARK, NAME, check_once
from lossplug.adapters.verl.rollout_stages import (
    CallingBatch,
    calling_batch,
    check_counted_once,
    check_reaches_the_actor,
    missing_reference_hint,
    write_back,
)
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
    "token_ids": "responses",
}
#: the DataProto keys ``ray_trainer.compute_advantage`` hands a registered estimator (besides rewards, mask, uid)
_PASSED_BY_VERL = frozenset({"reward_baselines"})


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
    compiled = lossplug.compile_recipe(recipe)
    calling: CallingBatch | None = None
    if compiled.has_rollout_stages:
        # the shapers and filters read and write verl's DataProto (rollout_stages says how and why)
        check_counted_once(compiled, config, ADVANTAGE_RECIPE_KEY)
        calling = calling_batch(token_level_rewards)
        check_reaches_the_actor(compiled, calling, ADVANTAGE_RECIPE_KEY)
        if calling is not None:
            extra = {**_held(calling.data.batch), **extra}
    outcome = _estimate(
        recipe, ADVANTAGE_RECIPE_KEY, token_level_rewards, response_mask, index, extra, from_verl=calling is None
    )
    if calling is not None:
        write_back(calling.data, outcome.rows, outcome.reward, outcome.action_mask)
    return outcome.advantages, outcome.returns


def _held(batch: Any) -> dict[str, Tensor]:
    """The tensors of ``batch`` (verl's ``data.batch``) under the keys :data:`_EXTRA_FIELDS` reads."""
    keys = set(batch.keys())
    return {key: batch[key] for key in _EXTRA_FIELDS.values() if key in keys}


def compute_advantage(
    data: Any, recipe: Any, *, reward_keys: Sequence[str] | None = None, algorithm: Any = None
) -> Any:
    """The recipe's advantage stage on a verl ``DataProto``, for custom trainers: the explicit path for plugins that
    read more than verl hands a registered estimator (``gae`` reads the critic's ``values``).

    Reads ``token_level_rewards``, ``response_mask`` and ``non_tensor_batch["uid"]``, plus whatever the plugin
    requires of ``values``, ``old_log_probs``, ``ref_log_prob``, ``rollout_log_probs``, ``reward_baselines``,
    ``sum_pi_squared`` and ``responses`` (the sampled token ids) from ``data.batch``; ``reward_keys`` (verl's ``algorithm.gdpo_reward_keys``) name the
    per-response reward components, read from ``data.non_tensor_batch`` (or ``data.batch``) as the columns of
    ``PolicyBatch.reward_components`` for multi-reward plugins (``gdpo``). Writes ``data.batch["advantages"]`` and ``data.batch["returns"]`` (``[B, T]``, zero off the
    response mask) and returns ``data`` — what ``verl.trainer.ppo.ray_trainer.compute_advantage`` does with verl's
    own estimators. ``recipe``: a :class:`~lossplug.Recipe`, preset name, YAML/JSON path or mapping.

    A recipe with shapers or filters reads the reward from ``token_level_rewards`` (or ``token_level_scores``, the
    reward manager's, when the trainer has not copied them over yet) and writes back what they change: the shaped
    reward into ``token_level_rewards`` and the filters' narrowed mask into ``response_mask``, which verl's actor
    update turns into its ``loss_mask`` — a filtered token leaves the loss and verl's global token count.
    ``algorithm``: verl's ``algorithm`` config, when the trainer has one: a shaper that puts the reference KL in the
    reward is refused under its ``use_kl_in_reward``.
    """
    batch = data.batch
    where = "compute_advantage(recipe)"
    recipe = load_recipe(recipe, where)
    _advantage_stage(recipe, where)
    compiled = lossplug.compile_recipe(recipe)
    keys = set(batch.keys())
    if compiled.has_rollout_stages:
        check_counted_once(compiled, algorithm, where)
        if "token_level_rewards" not in keys and "token_level_scores" in keys:
            batch["token_level_rewards"] = batch["token_level_scores"]
            keys.add("token_level_rewards")
    for needed in ("token_level_rewards", "response_mask"):
        if needed not in keys:
            raise LossplugError(f"compute_advantage: data.batch has no '{needed}' (keys: {', '.join(sorted(keys))})")
    extra = _held(batch)
    if reward_keys:
        extra[_REWARD_COMPONENTS] = _reward_components(data, list(reward_keys), batch["token_level_rewards"])
    uid = data.non_tensor_batch.get("uid") if getattr(data, "non_tensor_batch", None) is not None else None
    outcome = _estimate(
        recipe, where, batch["token_level_rewards"], batch["response_mask"], uid, extra, from_verl=False
    )
    write_back(data, outcome.rows, outcome.reward, outcome.action_mask)
    batch["advantages"] = outcome.advantages
    batch["returns"] = outcome.returns
    return data


#: the pseudo DataProto key under which compute_advantage hands the stacked reward components to _estimate
_REWARD_COMPONENTS = "reward_components"
#: PolicyBatch field → where the adapter reads it: the DataProto keys of :data:`_EXTRA_FIELDS`, and the per-function
#: rewards it assembles from ``reward_keys``
FIELDS_BY_KEY = {**_EXTRA_FIELDS, "reward_components": _REWARD_COMPONENTS}


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


@dataclass(frozen=True)
class _Estimate:
    """What the advantage seam hands back: ``advantages`` and ``returns`` ``[B, T]`` (zero off the response mask and
    on the rows without an action token); with shapers or filters, the ``reward`` and ``action_mask`` they left, of
    the ``rows`` with an action token (None: unchanged)."""

    advantages: Tensor
    returns: Tensor
    rows: ActionRows
    reward: Tensor | None = None
    action_mask: Tensor | None = None


def _estimate(
    recipe: Recipe,
    key: str,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Any,
    extra_by_verl_key: Mapping[str, Tensor],
    *,
    from_verl: bool,
) -> _Estimate:
    """The recipe's shapers, filters and advantage on verl's tensors (see :class:`_Estimate`)."""
    _advantage_stage(recipe, key)
    mask = response_mask.bool()
    T = mask.shape[1]
    dtype = token_level_rewards.dtype if token_level_rewards.is_floating_point() else torch.float32
    advantages = torch.zeros(*mask.shape, dtype=dtype, device=token_level_rewards.device)
    returns = torch.zeros_like(advantages)
    extra = _needed_fields(recipe, key, extra_by_verl_key, from_verl=from_verl)
    rows = ActionRows(mask)
    if rows.none:
        return _Estimate(advantages, returns, rows)
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
    kept_mask = batch.action_mask if result.action_mask is None else result.action_mask
    adv = torch.where(kept_mask, adv.to(dtype), 0)
    ret = torch.where(kept_mask, ret.to(dtype), 0)
    return _Estimate(rows.scatter(adv, advantages), rows.scatter(ret, returns), rows, result.reward, result.action_mask)


def _needed_fields(
    recipe: Recipe, key: str, extra_by_verl_key: Mapping[str, Tensor], *, from_verl: bool
) -> dict[str, Tensor]:
    """The batch fields beyond rewards that the recipe's shapers, filters and advantage plugin require, by
    :class:`~lossplug.PolicyBatch` name, from what the caller holds (verl's keys); refused, with the way out, when
    one is missing."""
    compiled = lossplug.compile_recipe(recipe)
    extra: dict[str, Tensor] = {}
    for stage in (*compiled.shapers, *compiled.filters, _advantage_stage(recipe, key)):
        extra.update(_stage_fields(stage, key, FIELDS_BY_KEY, extra_by_verl_key, from_verl=from_verl))
    return extra


def _stage_fields(
    stage: Any,
    key: str,
    fields_by_key: Mapping[str, str],
    extra_by_verl_key: Mapping[str, Tensor],
    *,
    from_verl: bool,
) -> dict[str, Tensor]:
    """The batch fields beyond rewards that a stage (a shaper, a filter or the advantage plugin) requires, by
    :class:`~lossplug.PolicyBatch` name, from what the caller holds (verl's keys); every missing one refused at once,
    each with its next step (for the advantage stage, the rows of :data:`~lossplug.adapters.verl.unfed.ADVANTAGE_UNFED`
    where verl cannot hand it over)."""
    plugin = stage.plugin
    # "advantage plugin 'gae'", "shaper plugin 'kl_in_reward'", "filter plugin 'zero_variance'"
    label = f"{stage.where.removeprefix('recipe.').split('[')[0].removesuffix('s')} plugin '{plugin.name}'"
    rollout_stage = stage.where != "recipe.advantage"
    extra: dict[str, Tensor] = {}
    problems = []
    for name in plugin.required_fields(stage.params):
        if name in ADVANTAGE_PROVIDED:
            continue
        verl_key = fields_by_key.get(name)
        value = extra_by_verl_key.get(verl_key) if verl_key is not None else None
        if value is not None:
            extra[name] = value
        elif rollout_stage and verl_key is not None and from_verl and verl_key not in _PASSED_BY_VERL:
            problems.append(
                f"{label} needs '{verl_key}', which verl's ray_trainer.compute_advantage holds in its DataProto, and "
                "this estimator was not called by it. Next step: run it through verl's compute_advantage, or call "
                "lossplug.adapters.verl.compute_advantage(data, recipe) on the DataProto"
            )
        elif verl_key is None or from_verl:  # not a DataProto key the adapter reads, or verl does not pass it
            row = ADVANTAGE_UNFED.get(name)
            if row is not None:
                problems.append(f"{label} needs '{verl_key or name}': {row.why}. {_next(row)}")
            else:
                problems.append(
                    f"{label} needs '{name}', which verl's batch does not carry. Next step: drop the stage, or call "
                    "lossplug.estimate_advantages on a PolicyBatch you build with it"
                )
        else:
            step = {
                "values": "set critic.enable=True (a critic-based recipe needs the critic's values)",
                _REWARD_COMPONENTS: "pass reward_keys= (verl's algorithm.gdpo_reward_keys)",
                "sum_pi_squared": "set actor.calculate_sum_pi_squared=True (verl then computes it)",
            }.get(verl_key)
            hint = (
                f" Next step: {step}"
                if step
                else missing_reference_hint(verl_key) or (f" Next step: put '{verl_key}' in data.batch")
            )
            problems.append(f"{label} needs '{verl_key}', which the batch does not hold.{hint}")
    if len(problems) == 1:
        raise LossplugError(f"{key}: {problems[0]}")
    if problems:
        raise LossplugError(f"{key}: the {label} cannot run:\n  - " + "\n  - ".join(problems))
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
