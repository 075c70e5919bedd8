"""The advantage seam: the recipe's advantage stage on the rewards TRL gathered over all processes, where every
prompt group is still complete (:func:`group_advantages`), and the per-row tensors that travel with TRL's batch
(:func:`add_recipe_advantages`)."""

from __future__ import annotations

import warnings
from collections.abc import MutableSequence
from typing import TYPE_CHECKING, Any, cast

import torch

import lossplug
from lossplug.adapters.trl.metrics import log_metrics
from lossplug.adapters.trl.state import AdapterState, adapter_state
from lossplug.contracts import LossplugError, PolicyBatch
from lossplug.needs import required_fields

if TYPE_CHECKING:
    from trl import GRPOTrainer

__all__ = ["add_recipe_advantages", "advantage_batch", "group_advantages"]


def group_advantages(
    trainer: GRPOTrainer, rewards_per_func: torch.Tensor, num_generations: int
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(advantages, rewards, group_ids, metrics)`` for the rows TRL gathered over all processes.

    ``rewards``: TRL's weighted sum of the reward functions (NaN where every function returned ``None``); groups are
    consecutive runs of ``num_generations`` rows (TRL's sampler). Unscorable rows are left out of the advantage
    batch (TRL's nan-mean/nan-std ignore them) and get advantage 0. Without a recipe advantage stage ``advantages``
    is ``None``.
    """
    st = adapter_state(trainer)
    device = rewards_per_func.device
    weights = trainer.reward_weights.to(device).unsqueeze(0)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights).nansum(dim=1)
    rewards = torch.where(unscorable, torch.full_like(rewards, float("nan")), rewards)
    n = rewards.shape[0]
    groups_per_round = (n + num_generations - 1) // num_generations
    group_ids = st.rounds * groups_per_round + torch.arange(n, device=device) // num_generations
    st.rounds += 1
    metrics: dict[str, torch.Tensor] = {}
    if st.compiled.advantage is None:
        return None, rewards, group_ids, metrics
    min_size = st.compiled.advantage.plugin.min_group_size
    some_unscorable = bool(unscorable.any())
    valid, too_small = _estimable_rows(st, group_ids, unscorable, some_unscorable)
    everything = not some_unscorable and not bool(too_small.any())  # the usual case: no row left out
    advantages = torch.zeros_like(rewards)
    if everything or bool(valid.any()):
        rows = None if everything else valid
        batch = advantage_batch(trainer, st, rewards, group_ids, rewards_per_func, rows)
        result = lossplug.estimate_advantages(batch, st.recipe, validate=st.validate)
        adv = result.advantage
        if adv.ndim == 2:  # a token-level estimator over the single placeholder position
            adv = adv[:, 0]
        if everything:
            advantages = adv.to(advantages.dtype)
        else:
            advantages[valid] = adv.to(advantages.dtype)
        metrics.update({f"advantage/{k}": v for k, v in result.metric_tensors.items()})
    with torch.no_grad():
        metrics["advantage/mean"] = advantages.mean()
        metrics["advantage/std"] = advantages.std() if n > 1 else torch.zeros((), device=device)
        metrics["advantage/zero_frac"] = (advantages == 0).float().mean()
        metrics["reward/unscorable_frac"] = unscorable.float().mean()
        if min_size > 1:
            metrics["reward/too_small_group_frac"] = too_small.float().mean()
    return advantages, rewards, group_ids, metrics


def _estimable_rows(
    st: AdapterState, group_ids: torch.Tensor, unscorable: torch.Tensor, some_unscorable: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid, too_small)``: the rows the estimator sees, and the scorable rows left out because leaving the
    unscorable ones out shrank their group below what the estimator needs (RLOO: 2). Those get advantage 0 like the
    unscorable ones — with a metric and a warning, never silently and never a crash in the middle of a run."""
    assert st.compiled.advantage is not None
    valid = ~unscorable
    min_size = st.compiled.advantage.plugin.min_group_size
    too_small = torch.zeros_like(valid)
    if min_size > 1 and some_unscorable:
        _, inverse, counts = torch.unique(group_ids[valid], return_inverse=True, return_counts=True)
        small = torch.zeros_like(valid)
        small[valid] = counts[inverse] < min_size
        too_small = small
        valid = valid & ~small
        if bool(small.any()):
            warnings.warn(
                f"lossplug: {int(small.sum())} completions are in groups with fewer than {min_size} "
                f"scorable completions, which recipe.advantage ({st.compiled.advantage.plugin.name}) "
                "needs; they get advantage 0 (metric lossplug/reward/too_small_group_frac)",
                stacklevel=3,
            )
    return valid, too_small


def advantage_batch(
    trainer: GRPOTrainer,
    st: AdapterState,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    rewards_per_func: torch.Tensor,
    rows: torch.Tensor | None,
) -> PolicyBatch:
    """The :class:`~lossplug.PolicyBatch` the advantage stage sees: one placeholder position per completion, its
    reward, prompt group and (when the plugin reads them) per-function rewards — of the ``rows`` (a boolean mask;
    ``None``: every row). The one place a new advantage-stage field gets filled from TRL's rewards."""
    assert st.compiled.advantage is not None
    r, ids = (rewards, group_ids) if rows is None else (rewards[rows], group_ids[rows])
    components = None
    if "reward_components" in required_fields(st.compiled.advantage.plugin, st.compiled.advantage.params):
        components = rewards_per_func if rows is None else rewards_per_func[rows]
        unscored = torch.isnan(components)
        if bool(unscored.any()):
            bad = unscored.any(-1).nonzero().squeeze(-1).tolist()[:8]
            funcs = sorted({trainer.reward_func_names[k] for k in unscored.nonzero()[:, 1].tolist()})
            raise LossplugError(
                f"recipe.advantage ({st.compiled.advantage.plugin.name}) reads reward_components, but reward "
                f"function(s) {funcs} returned None for some completions (rows {bad} of the scorable ones): "
                "lossplug's per-function rewards must all be scored (TRL's NaN-aware per-function means are not "
                "reproduced); return a number from every reward function or use sum_then_normalize"
            )
    return PolicyBatch.unchecked(
        logp=torch.zeros(r.shape[0], 1, dtype=r.dtype, device=r.device),
        action_mask=torch.ones(r.shape[0], 1, dtype=torch.bool, device=r.device),
        reward=r,
        group_id=ids,
        reward_components=components,
    )


def add_recipe_advantages(trainer: GRPOTrainer, output: dict[str, Any], rewards_per_func: torch.Tensor) -> None:
    """After TRL's ``_generate_and_score_completions``: replace TRL's advantages of this process's rows with the
    recipe's (when it has an advantage stage) and add the per-row tensors that must survive TRL's shuffle and split
    into micro-batches — ``lossplug_group_id``, ``lossplug_reward`` and ``lossplug_reward_components``."""
    mode = "train" if trainer.model.training else "eval"  # type: ignore[union-attr]  # (TRL: Optional)
    # (num_generations_eval: Optional in GRPOConfig, set to num_generations by GRPOTrainer when None)
    num_generations = cast(int, trainer.num_generations if mode == "train" else trainer.num_generations_eval)
    advantages, rewards, group_ids, metrics = group_advantages(trainer, rewards_per_func, num_generations)
    n_local = output["completion_ids"].shape[0]
    local = slice(trainer.accelerator.process_index * n_local, (trainer.accelerator.process_index + 1) * n_local)
    if advantages is not None:
        trl_adv = output["advantages"]
        output["advantages"] = advantages[local].to(device=trl_adv.device, dtype=trl_adv.dtype)
        # TRL's completions table (a deque): show the advantages actually used
        logged = cast("MutableSequence[Any]", trainer._logs["advantages"])
        values = advantages.tolist()[-len(logged) :] if len(logged) else []
        for i, v in enumerate(values):
            logged[len(logged) - len(values) + i] = v
    output["lossplug_group_id"] = group_ids[local]
    output["lossplug_reward"] = rewards[local]
    # one column per reward function, unweighted (NaN where a function returned None): TRL's rewards_per_func
    output["lossplug_reward_components"] = rewards_per_func[local]
    log_metrics(trainer, mode, metrics)
