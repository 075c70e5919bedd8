"""What the field-inventory tests share inside verl: lossplug's policy loss configured as verl's actor does, and
called as a trainer that passes ``rollout_log_probs`` calls it. verl is imported lazily (the tests skip without it)."""

from __future__ import annotations

from typing import Any

import torch


def verl_actor_config(recipe: dict, micro_batch: int) -> Any:
    """verl's ``ActorConfig`` (fsdp, ``token-mean``) with lossplug's policy loss running ``recipe``."""
    from verl.workers.config import ActorConfig

    from lossplug.adapters.verl import LossplugPolicyLossConfig

    return ActorConfig(
        strategy="fsdp",
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=micro_batch,
        loss_agg_mode="token-mean",
        policy_loss=LossplugPolicyLossConfig(loss_mode="lossplug", recipe=recipe),
    )


def verl_policy_loss(
    config: Any, batch: dict[str, torch.Tensor], log_prob: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict]:
    """``get_policy_loss_fn("lossplug")`` on ``batch`` (verl's field names; ``log_prob``: the leaf to differentiate,
    default ``batch["log_prob"]``), returning verl's ``(loss, metrics)``."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    return get_policy_loss_fn("lossplug")(
        old_log_prob=batch["old_log_prob"],
        log_prob=batch["log_prob"] if log_prob is None else log_prob,
        advantages=batch["advantages"],
        response_mask=batch["response_mask"],
        loss_agg_mode="token-mean",
        config=config,
        rollout_log_probs=batch["rollout_log_probs"],
    )
