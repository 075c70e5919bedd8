"""``mix`` (A = Σ_j w_j · A_j) inside the trainers, through public import paths only: two real TRL ``GRPOTrainer``
steps (TRL #7291's λ-mix of GRPO and RLOO, and each of two reward functions through its own estimator), the
advantages TRL's batch carries checked against the formula written here; verl's advantage seam — the adapter's
``compute_advantage`` on a ``DataProto`` (per-reward columns from ``reward_keys``, a critic's returns from the
component named) and verl's own ``compute_advantage`` with the registered estimator — against the same formula.
"""

from __future__ import annotations

import math

import pytest
import torch

import lossplug
from lossplug import LossplugError

from ._field_trainers import train_two_tiny_steps, verl_outcome_rewards

F64 = torch.float64
LAMBDA = 0.3
TRL_EPS = 1e-6  # grpo's default ε


def by_hand(reward, group, parts):
    """Σ_j w_j · A_j with A_j one of grpo (sample std, ε added), rloo or Dr. GRPO (centred), each on its own
    reward column, written with loops: ``parts`` is ``[(estimator, weight, column)]``, ``reward`` ``[B, K]``."""
    reward, group = reward.to(F64).tolist(), group.tolist()
    out = []
    for i in range(len(group)):
        rows = [j for j in range(len(group)) if group[j] == group[i]]
        n, total = len(rows), 0.0
        for estimator, weight, k in parts:
            same = [reward[j][k] for j in rows]
            mean = sum(same) / n
            if max(same) == min(same):
                a = 0.0
            elif estimator == "grpo":
                a = (reward[i][k] - mean) / (math.sqrt(sum((x - mean) ** 2 for x in same) / (n - 1)) + TRL_EPS)
            elif estimator == "rloo":
                a = reward[i][k] - (sum(same) - reward[i][k]) / (n - 1)
            else:
                a = reward[i][k] - mean
            total += weight * a
        out.append(total)
    return torch.tensor(out, dtype=F64)


# ---------------------------------------------------------------------------------------------------------------------
# TRL


def advantages_trl_carries(trainer):
    """One generation round's micro-batches as the loss sees them (the policy's own samples)."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


LAMBDA_MIX = {
    "preset": "dapo",
    "advantage": {
        "name": "mix",
        "components": [{"name": "grpo", "weight": LAMBDA}, {"name": "rloo", "weight": 1 - LAMBDA}],
    },
}


@pytest.mark.slow
def test_trl_7291s_lambda_mix_of_grpo_and_rloo_trains_in_a_trl_grpo_trainer(tmp_path):
    trainer, _ = train_two_tiny_steps(LAMBDA_MIX, tmp_path)
    logged = {k for e in trainer.state.log_history for k in e}
    assert {"lossplug/advantage/mix/grpo/mean", "lossplug/advantage/mix/rloo/std"} <= logged, sorted(logged)
    inputs = advantages_trl_carries(trainer)
    reward, group = inputs["lossplug_reward"], inputs["lossplug_group_id"]
    expected = by_hand(reward.unsqueeze(-1), group, [("grpo", LAMBDA, 0), ("rloo", 1 - LAMBDA, 0)])
    assert not bool((expected == 0).all())  # the lengths vary within a group: a signal to mix
    torch.testing.assert_close(inputs["advantages"].to(F64), expected, atol=1e-6, rtol=1e-6)
    saved = lossplug.Recipe.from_file(tmp_path / "out" / "recipe.yaml")
    assert [c["name"] for c in saved.advantage.params["components"]] == ["grpo", "rloo"]


def words(completions, **kwargs):
    """A second reward function: the number of words (a wide range, which would drown length_reward in a sum)."""
    return [float(len(str(c).split())) for c in completions]


@pytest.mark.slow
def test_each_reward_function_through_its_own_estimator_in_a_trl_grpo_trainer(tmp_path):
    """length_reward through GRPO, the word count through RLOO, weighted: TRL's per-function rewards are the
    columns of reward_components (TRL's reward_weights are not applied to them: the mix's weights are)."""
    from lossplug.testing import tiny

    recipe = {
        "preset": "dapo",
        "advantage": {
            "name": "mix",
            "components": [
                {"name": "grpo", "weight": 1.0, "reward_column": 0},
                {"name": "rloo", "weight": 0.05, "reward_column": 1},
            ],
        },
    }
    trainer = tiny.tiny_grpo_trainer(recipe, tmp_path / "out", reward_funcs=[tiny.length_reward, words], max_steps=2)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 2
    losses = [e["lossplug/loss"] for e in trainer.state.log_history if "lossplug/loss" in e]
    assert losses and all(math.isfinite(v) for v in losses)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    inputs = advantages_trl_carries(trainer)
    components, group = inputs["lossplug_reward_components"], inputs["lossplug_group_id"]
    assert components.shape[1] == 2
    expected = by_hand(components, group, [("grpo", 1.0, 0), ("rloo", 0.05, 1)])
    torch.testing.assert_close(inputs["advantages"].to(F64), expected, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# verl


@pytest.fixture
def verl_proto():
    pytest.importorskip("verl")
    from verl import DataProto

    return DataProto


def outcome_proto(DataProto, seed=0, sizes=(4, 3, 5, 2), T=6, values=False):
    """verl's batch after rewarding: scores on the last response token, a uid per prompt, two per-response reward
    components in ``non_tensor_batch`` (as verl's reward manager leaves its extra scores)."""
    np = pytest.importorskip("numpy")
    g = torch.Generator().manual_seed(seed)
    group, mask, score, rewards = verl_outcome_rewards(g, sizes, T)
    B = group.numel()
    extra = torch.randn(B, 2, dtype=F64, generator=g)
    tensors = {"token_level_rewards": rewards, "response_mask": mask.long()}
    if values:
        tensors["values"] = torch.randn(B, T, generator=g, dtype=F64)
    non_tensors = {
        "uid": np.array([f"prompt-{int(k)}" for k in group], dtype=object),
        "acc": extra[:, 0].numpy(),
        "format": extra[:, 1].numpy(),
    }
    proto = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
    return proto, score, extra, group, mask


def test_the_lambda_mix_through_the_verl_adapters_compute_advantage(verl_proto):
    from lossplug.adapters.verl import compute_advantage

    data, score, _, group, mask = outcome_proto(verl_proto)
    out = compute_advantage(data, {"advantage": LAMBDA_MIX["advantage"], "gates": ["ppo_clip"], "reduction": "token"})
    expected = by_hand(score.unsqueeze(-1), group, [("grpo", LAMBDA, 0), ("rloo", 1 - LAMBDA, 0)])
    torch.testing.assert_close(
        out.batch["advantages"], torch.where(mask, expected.unsqueeze(-1), 0), atol=1e-12, rtol=0
    )


def test_each_reward_key_through_its_own_estimator_in_verls_adapter(verl_proto):
    """verl's gdpo_reward_keys as reward_components columns: acc through GRPO, format through Dr. GRPO."""
    from lossplug.adapters.verl import compute_advantage

    data, _, extra, group, mask = outcome_proto(verl_proto, seed=1)
    recipe = {
        "advantage": {
            "name": "mix",
            "components": [
                {"name": "grpo", "weight": 0.7, "reward_column": 0},
                {"name": "grpo", "weight": 0.3, "reward_column": 1, "scale": "none"},
            ],
        },
        "gates": ["ppo_clip"],
        "reduction": "token",
    }
    out = compute_advantage(data, recipe, reward_keys=["acc", "format"])
    expected = by_hand(extra, group, [("grpo", 0.7, 0), ("dr_grpo", 0.3, 1)])
    torch.testing.assert_close(
        out.batch["advantages"], torch.where(mask, expected.unsqueeze(-1), 0), atol=1e-12, rtol=0
    )


def test_a_critics_returns_reach_verl_from_the_component_named(verl_proto):
    from lossplug.adapters.verl import compute_advantage

    gae = {"name": "gae", "lam": 1.0, "whiten": False}
    mixed = {
        "advantage": {"name": "mix", "components": [{**gae, "weight": 0.5}, {"name": "grpo", "weight": 0.5}]},
        "gates": ["ppo_clip"],
        "reduction": "token",
    }
    data, *_ = outcome_proto(verl_proto, seed=2, values=True)
    alone = compute_advantage(data, {"advantage": gae, "gates": ["ppo_clip"], "reduction": "token"})
    gae_adv, gae_returns = alone.batch["advantages"].clone(), alone.batch["returns"].clone()
    data, score, _, group, mask = outcome_proto(verl_proto, seed=2, values=True)
    with pytest.raises(LossplugError, match=r"components\[0\] \(gae\) returns critic targets.*returns_from: 0"):
        compute_advantage(data, mixed)
    mixed["advantage"]["returns_from"] = 0
    out = compute_advantage(data, mixed)
    assert torch.equal(out.batch["returns"], gae_returns)
    grpo = by_hand(score.unsqueeze(-1), group, [("grpo", 0.5, 0)])
    torch.testing.assert_close(
        out.batch["advantages"], torch.where(mask, 0.5 * gae_adv + grpo.unsqueeze(-1), 0), atol=1e-12, rtol=0
    )


def test_the_lambda_mix_as_verls_registered_estimator(verl_proto):
    pytest.importorskip("lossplug.adapters.verl")  # registers the estimator 'lossplug'
    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import compute_advantage

    data, score, _, group, mask = outcome_proto(verl_proto, seed=3)
    recipe = {"advantage": LAMBDA_MIX["advantage"], "gates": ["ppo_clip"], "reduction": "token"}
    config = OmegaConf.create({"adv_estimator": "lossplug", "lossplug": recipe, "norm_adv_by_std_in_grpo": True})
    out = compute_advantage(data, adv_estimator="lossplug", gamma=1.0, lam=1.0, config=config)
    expected = by_hand(score.unsqueeze(-1), group, [("grpo", LAMBDA, 0), ("rloo", 1 - LAMBDA, 0)])
    torch.testing.assert_close(
        out.batch["advantages"].to(F64), torch.where(mask, expected.unsqueeze(-1), 0), atol=1e-6, rtol=1e-6
    )


# ---------------------------------------------------------------------------------------------------------------------
# TRL #7291's own example, λ·A_GRPO + (1 − λ)·A_SDPO: the self-distillation half reads teacher log-probs, which
# neither trainer's advantage seam feeds yet — refused, naming the field

SDPO_MIX = {
    "advantage": {
        "name": "mix",
        "components": [{"name": "grpo", "weight": LAMBDA}, {"name": "opd", "weight": 1 - LAMBDA}],
    },
    "gates": ["ppo_clip"],
    "reduction": "token",
}


def test_trl_cannot_supply_the_teacher_of_a_grpo_sdpo_mix_and_says_so(tmp_path):
    from lossplug.testing import tiny

    pytest.importorskip("trl")
    with pytest.raises((LossplugError, lossplug.BatchValidationError), match="teacher_logp"):
        trainer = tiny.tiny_grpo_trainer(SDPO_MIX, tmp_path / "out")
        advantages_trl_carries(trainer)


def test_verl_without_a_teacher_in_the_batch_refuses_a_grpo_sdpo_mix_and_says_how_to_get_one(verl_proto):
    from lossplug.adapters.verl import compute_advantage

    data, *_ = outcome_proto(verl_proto)
    with pytest.raises(LossplugError, match="needs 'teacher_logprobs', which the batch does not hold") as err:
        compute_advantage(data, SDPO_MIX)
    assert "Next step: turn on verl's teacher loop" in str(err.value)


def test_verls_registered_estimator_cannot_read_reward_columns_and_names_the_adapters_path(verl_proto):
    """verl's ray_trainer.compute_advantage hands a registered estimator no per-reward scores: a mix with a
    reward_column is refused there, pointing at the adapter's compute_advantage(..., reward_keys=...)."""
    pytest.importorskip("lossplug.adapters.verl")
    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import compute_advantage

    data, *_ = outcome_proto(verl_proto, seed=4)
    recipe = {
        "advantage": {"name": "mix", "components": [{"name": "grpo", "weight": 1.0, "reward_column": 0}]},
        "gates": ["ppo_clip"],
        "reduction": "token",
    }
    config = OmegaConf.create({"adv_estimator": "lossplug", "lossplug": recipe, "norm_adv_by_std_in_grpo": True})
    with pytest.raises(LossplugError, match=r"advantage plugin 'mix' needs 'reward_components'.*reward_keys"):
        compute_advantage(data, adv_estimator="lossplug", gamma=1.0, lam=1.0, config=config)
