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


#: the verl seam tests' step: B responses of up to T tokens, DP ranks, MICRO responses a micro-batch
B, T, DP, MICRO = 8, 12, 2, 2


def verl_inputs(seed: int, update_noise: float = 0.4, rollout_noise: float | None = 0.3) -> dict[str, torch.Tensor]:
    """A step's batch in verl's field names, with garbage off the response mask (as verl holds there): the current
    log-probs ``update_noise`` from the old ones, the rollout's ``rollout_noise`` (None: the old ones)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    mask[:, 1:] &= torch.rand(B, T - 1, generator=g) > 0.15  # observation tokens inside the response
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    logp = (old + update_noise * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    rollout = (
        old
        if rollout_noise is None
        else (old + rollout_noise * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    )
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    garbage = 50 * torch.rand(B, T, generator=g, dtype=torch.float64)
    return {
        "old_log_prob": torch.where(mask, old, -garbage),
        "log_prob": torch.where(mask, logp, garbage),
        "rollout_log_probs": torch.where(mask, rollout, -garbage),
        "advantages": torch.where(mask, adv, garbage),
        "response_mask": mask,
        "lengths": lengths,
    }


def verl_seam_over_step(recipe: dict, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """``recipe`` through verl's policy-loss seam on ``x`` split over DP ranks × micro-batches (each padded to its own
    longest response): the step's loss and gradient as verl combines them, and each micro-batch's metrics."""
    mask = x["response_mask"]
    config = verl_actor_config(recipe, MICRO)
    config.global_batch_info.update(
        {"dp_size": DP, "batch_num_tokens": int(mask.sum()), "global_batch_size": B, "loss_scale_factor": None}
    )
    total, grad = torch.zeros((), dtype=torch.float64), torch.zeros_like(x["log_prob"])
    all_metrics = []
    for start in range(0, B, MICRO):
        rows, width = slice(start, start + MICRO), int(x["lengths"][start : start + MICRO].max())
        mb = {k: v[rows, :width] for k, v in x.items() if k != "lengths"}
        log_prob = mb["log_prob"].clone().requires_grad_()
        loss, metrics = verl_policy_loss(config, mb, log_prob)
        loss.backward()
        total = total + loss.detach() / DP  # verl multiplies each share by dp_size and averages the ranks' gradients
        grad[rows, :width] = log_prob.grad / DP
        all_metrics.append(metrics)
    return total, grad, all_metrics


def train_two_tiny_steps(recipe: dict, tmp_path: Any, *, rollout: bool = True) -> tuple[Any, list[torch.Tensor]]:
    """Two real TRL ``train()`` steps of the tiny model under ``recipe`` (``rollout``: the tiny rollout engine
    supplies ``behavior_logp``), checked to have trained and saved the recipe; returns the trainer and the
    parameters before training."""
    import pytest

    pytest.importorskip("trl")
    import lossplug
    from lossplug.adapters.trl import LossplugGRPOTrainer
    from lossplug.testing import tiny

    tok = tiny.tiny_tokenizer()
    trainer = LossplugGRPOTrainer(
        model=tiny.tiny_model(tok),
        reward_funcs=[tiny.length_reward],
        args=tiny.tiny_grpo_config(tmp_path / "out", max_steps=2),
        train_dataset=tiny.tiny_dataset(),
        processing_class=tok,
        recipe=recipe,
        **({"rollout_func": tiny.TinyRollout(tok)} if rollout else {}),
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 2
    losses = [e["lossplug/loss"] for e in trainer.state.log_history if "lossplug/loss" in e]
    assert losses and all(torch.isfinite(torch.tensor(v)) for v in losses)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert lossplug.Recipe.from_file(tmp_path / "out" / "recipe.yaml").gates == lossplug.Recipe.load(recipe).gates
    return trainer, before
