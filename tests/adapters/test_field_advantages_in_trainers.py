"""The field's advantages (maxrl, gigpo, opd) and the nll regularizer inside the trainers, through public import paths
only: a real TRL ``GRPOTrainer`` on the tiny model, and verl's advantage seam (``lossplug.adapters.verl.
compute_advantage`` on a ``DataProto``, and verl's own ``compute_advantage`` with the registered estimator) and policy
loss.

What the adapters cannot supply yet is pinned as a refusal that names the missing field: TRL's advantage seam sees
one reward per completion (no per-token log-probs, no trajectory or anchor ids), verl's ``compute_advantage`` reads
no teacher log-probs, trajectory or anchor ids. verl's policy loss runs nll (it reads only the log-probs).
"""

from __future__ import annotations

import math

import pytest
import torch

from lossplug import BatchValidationError, LossplugError

from ._field_trainers import verl_outcome_rewards

F64 = torch.float64


def maxrl_formula(reward, group):
    out = torch.zeros_like(reward)
    for g in group.unique():
        rows = group == g
        r = reward[rows]
        mean = r.mean()
        out[rows] = 0.0 if bool((r == r[0]).all()) else (r - mean) / (mean + 1e-6)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# TRL


@pytest.fixture
def trl_tiny():
    pytest.importorskip("trl")
    from lossplug.testing import tiny

    return tiny


def constant_reward(completions, **kwargs):
    """Every completion scores 1: the group-relative advantage is exactly 0, the policy term vanishes."""
    return [1.0 for _ in completions]


def one_micro_batch(trainer):
    """The first micro-batch of one generation round (the policy's own samples), as the loss sees it."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


@pytest.mark.slow
def test_maxrl_trains_in_a_trl_grpo_trainer(trl_tiny, tmp_path):
    trainer = trl_tiny.tiny_grpo_trainer({"preset": "dapo", "advantage": "maxrl"}, tmp_path / "out", max_steps=2)
    trainer.train()
    assert trainer.state.global_step == 2
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses and all(math.isfinite(loss) for loss in losses)
    inputs = one_micro_batch(trainer)  # the advantages TRL's batch carries are maxrl's, per prompt group
    reward, group = inputs["lossplug_reward"].to(F64), inputs["lossplug_group_id"]
    torch.testing.assert_close(inputs["advantages"].to(F64), maxrl_formula(reward, group), atol=1e-6, rtol=1e-6)


def per_token_logps(trainer, inputs):
    prompt, completion = inputs["prompt_ids"], inputs["completion_ids"]
    ids = torch.cat([prompt, completion], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, completion.size(1))
    return logps


@pytest.mark.parametrize("threshold", [0.5, 2.0], ids=["all_positive", "none_positive"])
def test_nll_is_the_loss_of_a_trl_grpo_trainer_when_the_advantage_vanishes(trl_tiny, tmp_path, threshold):
    """Constant rewards: grpo's advantage is 0 and reinforce's term with it, so the loss TRL back-propagates is
    μ · token-mean(−logp) over the positive responses (reward 1 > 0.5: all; > 2: none) — loss and gradient against
    the same quantity computed from the model's own log-probs."""
    coef = 0.5
    recipe = {
        "advantage": "grpo",
        "gates": ["reinforce"],
        "reduction": "token",
        "regularizers": [{"name": "nll", "coef": coef, "threshold": threshold}],
    }
    trainer = trl_tiny.tiny_grpo_trainer(recipe, tmp_path / "out", reward_funcs=[constant_reward])
    inputs = one_micro_batch(trainer)
    assert bool((inputs["advantages"] == 0).all())
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    loss = trainer.compute_loss(trainer.model, inputs)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    mask = inputs["completion_mask"].bool()
    if "tool_mask" in inputs:
        mask = mask & inputs["tool_mask"].bool()
    logps = per_token_logps(trainer, inputs)
    selected = 1.0 if threshold < 1.0 else 0.0
    expected = coef * selected * -(torch.where(mask, logps, 0)).sum() / mask.sum()
    if selected:
        expected_grads = torch.autograd.grad(expected, params, allow_unused=True)
    else:
        expected_grads = [None] * len(params)
    torch.testing.assert_close(loss.detach(), expected.detach(), atol=1e-6, rtol=1e-5)
    for got, want in zip(grads, expected_grads):
        if want is None:
            assert got is None or bool((got == 0).all())
        else:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "advantage, field",
    [({"name": "opd"}, "teacher_logp"), ({"name": "gigpo"}, "trajectory_id")],
    ids=["opd", "gigpo"],
)
def test_trl_cannot_supply_the_fields_of_opd_and_gigpo_and_says_which(trl_tiny, tmp_path, advantage, field):
    with pytest.raises((LossplugError, BatchValidationError), match=field):
        trainer = trl_tiny.tiny_grpo_trainer({"preset": "dapo", "advantage": advantage}, tmp_path / "out")
        one_micro_batch(trainer)


# ---------------------------------------------------------------------------------------------------------------------
# verl


@pytest.fixture
def verl_proto():
    pytest.importorskip("verl")
    from verl import DataProto

    return DataProto


def outcome_proto(DataProto, seed=0, sizes=(4, 3, 5, 2), T=6):
    g = torch.Generator().manual_seed(seed)
    group, mask, score, rewards = verl_outcome_rewards(g, sizes, T)
    B = group.numel()
    np = pytest.importorskip("numpy")  # verl's uid arrays; verl brings numpy
    uid = np.array([f"prompt-{int(k)}" for k in group], dtype=object)
    tensors = {
        "token_level_rewards": rewards,
        "response_mask": mask.long(),
        "old_log_probs": -2 * torch.rand(B, T, generator=g, dtype=F64),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid}), score, group, mask


def test_maxrl_through_the_verl_adapters_compute_advantage(verl_proto):
    from lossplug.adapters.verl import compute_advantage

    data, score, group, mask = outcome_proto(verl_proto)
    out = compute_advantage(data, {"advantage": "maxrl", "gates": ["ppo_clip"], "reduction": "token"})
    expected = torch.where(mask, maxrl_formula(score, group).unsqueeze(-1), 0)
    torch.testing.assert_close(out.batch["advantages"], expected, atol=1e-12, rtol=1e-12)


def test_maxrl_as_verls_registered_estimator(verl_proto):
    pytest.importorskip("lossplug.adapters.verl")  # registers the estimator 'lossplug'
    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import compute_advantage

    data, score, group, mask = outcome_proto(verl_proto, seed=1)
    recipe = {"advantage": "maxrl", "gates": ["ppo_clip"], "reduction": "token"}
    config = OmegaConf.create({"adv_estimator": "lossplug", "lossplug": recipe, "norm_adv_by_std_in_grpo": True})
    out = compute_advantage(data, adv_estimator="lossplug", gamma=1.0, lam=1.0, config=config)
    expected = torch.where(mask, maxrl_formula(score, group).unsqueeze(-1), 0)
    torch.testing.assert_close(out.batch["advantages"].to(F64), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "advantage, keys",
    [("opd", ["teacher_logprobs"]), ("gigpo", ["traj_uid", "anchor_obs"])],
)
def test_verls_compute_advantage_reads_the_teacher_and_turns_from_the_dataproto_and_names_what_it_lacks(
    verl_proto, advantage, keys
):
    """The adapter reads a teacher's log-probs and the turn ids from verl's DataProto (tests/adapters/
    test_verl_teachers_and_turns.py runs them); a batch without them is refused by the adapter, naming verl's key
    and how to fill it, before the batch contract would say only what is missing."""
    from lossplug.adapters.verl import compute_advantage

    data, *_ = outcome_proto(verl_proto)
    with pytest.raises(LossplugError) as err:
        compute_advantage(data, {"advantage": advantage, "gates": ["ppo_clip"], "reduction": "token"})
    for key in keys:
        assert f"advantage plugin '{advantage}' needs '{key}', which the batch does not hold" in str(err.value)
    assert "Next step: " in str(err.value)


def test_the_nll_regularizer_runs_in_verls_policy_loss(verl_proto):
    """nll on every response reads only the log-probs: verl's policy loss adds it (tests/adapters/
    test_verl_regularizers.py proves it over a whole step at dp 2, beside verl's own entropy and KL)."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import ActorConfig

    from lossplug.adapters.verl import LossplugPolicyLossConfig

    recipe = {"gates": ["ppo_clip"], "reduction": "token", "regularizers": [{"name": "nll", "responses": "all"}]}
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=2,
        loss_agg_mode="token-mean",
        policy_loss=LossplugPolicyLossConfig(loss_mode="lossplug", recipe=recipe),
    )
    B, T = 2, 3
    old = -torch.rand(B, T, dtype=F64)
    logp = old.clone().requires_grad_()
    loss, _ = get_policy_loss_fn("lossplug")(
        old_log_prob=old,
        log_prob=logp,
        advantages=torch.zeros(B, T, dtype=F64),
        response_mask=torch.ones(B, T, dtype=torch.bool),
        loss_agg_mode="token-mean",
        config=config,
    )
    loss.backward()
    # zero advantages: the policy term is 0 and the loss is nll's 0.1 · mean(−logp), its gradient −0.1 / tokens
    torch.testing.assert_close(loss, 0.1 * (-old).mean(), rtol=1e-12, atol=0)
    torch.testing.assert_close(logp.grad, torch.full((B, T), -0.1 / (B * T), dtype=F64), rtol=1e-12, atol=0)
