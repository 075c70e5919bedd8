"""What the field-inventory tests share inside the trainers: lossplug's policy loss configured as verl's actor does,
and called as a trainer that passes ``rollout_log_probs`` calls it; verl's batch after rewarding as a ``DataProto``;
TRL's first micro-batch with the model's own forward pass; two TRL steps; the refusals of the gates that need whole
prompt groups; the turn-level advantages' checks (verl's advantage and policy-loss seam on responses of several turns,
TRL's one-turn case and its refusal of several). verl and TRL are imported lazily (the tests skip without them)."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch

from lossplug import LossplugError


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


def assert_trl_refuses_split_groups(recipe: dict, gate: str, tmp_path: Any) -> None:
    """``gate`` (it needs each prompt group of 4 whole in a micro-batch) refuses, naming the group and its size, a
    TRL run of 2 accumulation steps of 2 completions: TRL splits each generation's group of 4 over two
    micro-batches."""
    pytest.importorskip("trl")
    from lossplug.testing import tiny

    trainer = tiny.tiny_grpo_trainer(
        recipe, tmp_path / "out", per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1
    )
    with pytest.raises(LossplugError, match=rf"gate '{gate}': group_id \d+ has 2 row\(s\).*exactly group_size=4"):
        trainer.train()


def assert_verl_policy_loss_refuses_for_want_of_prompt_ids(recipe: dict, gate: str) -> None:
    """verl's ``ppo_loss`` hands a policy loss no prompt ids: under it ``gate`` (it reads ``group_id``) is refused,
    naming the field and the reason."""
    pytest.importorskip("verl")
    x = verl_inputs(0)
    with pytest.raises(LossplugError, match=rf"{gate}.*group_id.*verl's ppo_loss passes a policy loss no prompt ids"):
        verl_policy_loss(verl_actor_config(recipe, 2), {k: v for k, v in x.items() if k != "lengths"})


def verl_outcome_rewards(
    g: torch.Generator, sizes: tuple[int, ...], width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An outcome-rewarded step drawn from ``g``: prompt groups of ``sizes`` rows in shuffled order, responses of 1 to
    ``width`` tokens, a score per response (0 or 1, plus 0.25·U[0, 1); group 0's all 1: equal rewards) on its last
    token. Returns ``(group, mask, score, token_level_rewards)``."""
    group = torch.cat([torch.full((n,), k) for k, n in enumerate(sizes)])
    group = group[torch.randperm(group.numel(), generator=g)]
    rows = group.numel()
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = torch.arange(width) < lengths[:, None]
    score = (torch.rand(rows, generator=g) < 0.5).to(torch.float64) + 0.25 * torch.rand(
        rows, generator=g, dtype=torch.float64
    )
    score[group == 0] = 1.0  # equal rewards
    rewards = torch.zeros(rows, width, dtype=torch.float64)
    rewards[torch.arange(rows), lengths - 1] = score
    return group, mask, score, rewards


def verl_step_as_proto(
    x: dict[str, torch.Tensor], rewards: torch.Tensor, group: torch.Tensor, non_tensors: dict | None = None
) -> Any:
    """verl_inputs' step ``x`` as the ``DataProto`` verl's advantage sees after rewarding: ``rewards`` as its
    ``token_level_rewards``, ``x``'s response mask and old log-probs, ``group`` as each row's ``uid``
    (``prompt-<k>``), and any further ``non_tensors`` (per-function rewards)."""
    DataProto = pytest.importorskip("verl").DataProto
    np = pytest.importorskip("numpy")
    uid = np.array([f"prompt-{int(k)}" for k in group], dtype=object)
    tensors = {
        "token_level_rewards": rewards,
        "response_mask": x["response_mask"].long(),
        "old_log_probs": x["old_log_prob"],
    }
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid, **(non_tensors or {})})


class TrlMicroBatch(NamedTuple):
    inputs: dict
    params: list[torch.Tensor]
    loss: torch.Tensor
    grads: tuple[torch.Tensor | None, ...]
    logps: torch.Tensor
    entropies: torch.Tensor


def trl_first_micro_batch(trainer: Any) -> TrlMicroBatch:
    """TRL's first micro-batch through the trainer's ``compute_loss`` (train mode, no gradient accumulation): the
    inputs as ``_compute_loss`` sees them, the trainable parameters, the loss and its gradients with respect to them,
    and the model's own per-token log-probs and entropies on the micro-batch from TRL's forward pass (differentiable:
    a loss written out on them gives the gradients to compare)."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    loss = trainer.compute_loss(trainer.model, inputs)
    grads = torch.autograd.grad(loss, params, allow_unused=True)

    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, ids, attention, inputs["completion_ids"].size(1), compute_entropy=True
    )
    return TrlMicroBatch(inputs, params, loss, grads, logps, entropies)


# -- turn-level advantages (igpo, mt_grpo) -----------------------------------------------------------------------------


def turn_runs(mask_row: list) -> list[tuple[int, int]]:
    """The turns of a response: [start, end) of each run of action tokens."""
    runs, t, T = [], 0, len(mask_row)
    while t < T:
        if mask_row[t]:
            s = t
            while t < T and mask_row[t]:
                t += 1
            runs.append((s, t))
        else:
            t += 1
    return runs


def ppo_clip_over_the_step(x: dict[str, torch.Tensor], adv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clip (0.2) over the step's action tokens, token mean: loss and gradient."""
    mask = x["response_mask"]
    old = torch.where(mask, x["old_log_prob"], 0)
    logp = torch.where(mask, x["log_prob"], 0).clone().requires_grad_()
    ratio = (logp - old).exp()
    a = torch.where(mask, adv, 0)
    expected = -(torch.where(mask, torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a), 0).sum() / mask.sum())
    expected.backward()
    return expected.detach(), torch.where(mask, logp.grad, 0)


def verl_turn_step(
    seed: int,
) -> tuple[dict[str, torch.Tensor], list[list[tuple[int, int]]], torch.Generator, torch.Tensor, torch.Tensor]:
    """verl_inputs' step from ``seed`` and what per-turn rewards are drawn onto: each row's turns (``turn_runs``), a
    generator seeded alike (apart from verl_inputs') for the rewards, groups of 4 (row // 4), and
    ``token_level_rewards`` of zeros (float64) to fill."""
    x = verl_inputs(seed=seed)
    mask = x["response_mask"]
    rows, width = mask.shape
    turns = [turn_runs(mask[i].tolist()) for i in range(rows)]
    g = torch.Generator().manual_seed(seed)
    return x, turns, g, torch.arange(rows) // 4, torch.zeros(rows, width, dtype=torch.float64)


def verl_advantage(data: Any, recipe: dict, registered: bool) -> Any:
    """``recipe``'s advantage on verl's ``data``: through verl's ``compute_advantage`` with the registered estimator
    (``adv_estimator=lossplug``) when ``registered``, else through ``lossplug.adapters.verl.compute_advantage``."""
    if registered:
        pytest.importorskip("lossplug.adapters.verl")  # registers the estimator 'lossplug'
        from omegaconf import OmegaConf
        from verl.trainer.ppo.ray_trainer import compute_advantage

        config = OmegaConf.create({"adv_estimator": "lossplug", "lossplug": recipe, "norm_adv_by_std_in_grpo": True})
        return compute_advantage(data, adv_estimator="lossplug", gamma=1.0, lam=1.0, config=config)
    from lossplug.adapters.verl import compute_advantage as lossplug_compute_advantage

    return lossplug_compute_advantage(data, recipe)


def assert_turn_advantages_through_verl_seam(
    recipe: dict, x: dict[str, torch.Tensor], adv: torch.Tensor, expected: torch.Tensor
) -> None:
    """verl's advantages ``adv`` on verl_inputs' step ``x`` (responses of several turns and of one) equal the formula
    written out (``expected``, 1e-12), differ between the first and last turn of some multi-turn response (the
    per-turn part acts), and through verl's policy-loss seam at DP ranks × micro-batches give PPO's clip over the
    step: loss and gradient (float64)."""
    mask = x["response_mask"]
    turns = [len(turn_runs(mask[i].tolist())) for i in range(mask.shape[0])]
    assert max(turns) >= 3 and min(turns) == 1  # several turns and one-turn responses
    torch.testing.assert_close(adv, expected, atol=1e-12, rtol=0)
    assert any(
        abs(float(adv[i, turn_runs(mask[i].tolist())[0][0]] - adv[i, turn_runs(mask[i].tolist())[-1][0]])) > 1e-3
        for i in range(mask.shape[0])
        if turns[i] > 1
    )
    x = {**x, "advantages": torch.where(mask, adv, x["advantages"])}  # verl's garbage off the mask stays
    loss, grad, _ = verl_seam_over_step(recipe, x)
    expected_loss, expected_grad = ppo_clip_over_the_step(x, adv)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.where(mask, grad, 0), expected_grad, rtol=1e-12, atol=1e-14)


def assert_trl_one_turn_case(recipe: dict, tmp_path: Any, expected_of: Any) -> None:
    """Two real TRL steps under ``recipe``, then TRL's advantages on its batch (one position per completion: one turn)
    equal ``expected_of(reward, group)`` (float64, 1e-5) and are not all 0."""
    from .test_field_roll_nemo_advantages_in_trainers import one_micro_batch, trained

    trainer = trained(recipe, tmp_path, None)
    inputs = one_micro_batch(trainer)
    reward, group = inputs["lossplug_reward"].to(torch.float64), inputs["lossplug_group_id"]
    torch.testing.assert_close(inputs["advantages"].to(torch.float64), expected_of(reward, group), atol=1e-5, rtol=1e-5)
    assert bool((inputs["advantages"] != 0).any())


def assert_trl_refuses_several_turns(recipe: dict, name: str, tmp_path: Any) -> None:
    """A TRL trainer whose completions can hold several turns (a ``rollout_func``) under ``recipe`` is refused, naming
    ``name`` and the reason: TRL's advantage seam has one position per completion."""
    pytest.importorskip("trl")
    from lossplug.testing import tiny

    tok = tiny.tiny_tokenizer()
    with pytest.raises(LossplugError, match=rf"{name}.*one position per completion"):
        tiny.tiny_grpo_trainer(
            recipe, tmp_path / "out", tokenizer=tok, trainer_kwargs={"rollout_func": tiny.TinyRollout(tok)}
        )
