"""TRL #4525 and #7298: "how do I change the advantage computation in GRPOTrainer?" — TRL's answer is to subclass
it and override ``_generate_and_score_completions``; #7298 adds a hook and finds that the completions table then logs
stale advantages. With lossplug an advantage is a plugin selected by name: here a user's own estimator, registered
the way a third-party package registers one, runs inside two real ``GRPOTrainer`` steps without a subclass written
by the user; the advantages the loss reads are the plugin's, and TRL's completions table shows those same values."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

import lossplug

from ._field_trainers import train_two_tiny_steps


class RankParams(lossplug.Params):
    scale: float = 1.0


@lossplug.advantage("user_rank_centred", params=RankParams, requires=("reward", "group_id"))
def user_rank_centred(batch: lossplug.PolicyBatch, p: RankParams) -> torch.Tensor:
    """A user's estimator: each response's reward rank within its group (ties share their mean rank), centred on
    the group's mean rank and scaled — an advantage TRL does not ship."""
    reward, group = batch.reward, batch.group_id
    reward = reward.sum(-1) if reward.dim() == 2 else reward  # a token reward: the response's total
    assert group is not None
    out = torch.zeros_like(reward)
    for g in group.unique():
        rows = (group == g).nonzero().squeeze(1)
        r = reward[rows]
        below = (r[None, :] < r[:, None]).sum(1).to(r.dtype)
        ties = (r[None, :] == r[:, None]).sum(1).to(r.dtype)
        rank = below + (ties - 1) / 2
        out[rows] = p.scale * (rank - rank.mean())
    return out


class UserPackage:
    @lossplug.hookimpl
    def lossplug_register_advantages(self, register):
        register(user_rank_centred)


@pytest.fixture
def user_plugin():
    plugin = UserPackage()
    lossplug.register_plugin(plugin, "user-package")
    yield
    lossplug.unregister_plugin(plugin)


def rank_in(x: float, same: list[float]) -> float:
    return sum(y < x for y in same) + (sum(y == x for y in same) - 1) / 2


def by_hand(reward: torch.Tensor, group: torch.Tensor, scale: float) -> torch.Tensor:
    reward, group = reward.tolist(), group.tolist()
    out = []
    for i, r in enumerate(reward):
        same = [reward[j] for j in range(len(reward)) if group[j] == group[i]]
        out.append(scale * (rank_in(r, same) - sum(rank_in(y, same) for y in same) / len(same)))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.slow
def test_a_users_own_advantage_runs_in_grpo_trainer_and_trl_logs_the_values_the_loss_used(tmp_path, user_plugin):
    recipe = {"advantage": {"name": "user_rank_centred", "scale": 0.5}, "gates": ["ppo_clip"], "reduction": "token"}
    trainer, _ = train_two_tiny_steps(recipe, tmp_path)
    from trl import GRPOTrainer

    assert isinstance(trainer, GRPOTrainer)  # lossplug's trainer: the user wrote no subclass and no override
    # the advantages of one more generation round, as the loss reads them
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    expected = by_hand(inputs["lossplug_reward"], inputs["lossplug_group_id"], 0.5)
    assert not bool((expected == 0).all())
    torch.testing.assert_close(inputs["advantages"].to(torch.float64), expected, atol=1e-6, rtol=0)
    # TRL #7298: the completions table holds the advantages the loss used, not TRL's own group-normalised ones
    # (one generation round here: the table is in generation order, the loss's rows were shuffled after it)
    logged = torch.tensor(list(trainer._logs["advantages"])[-len(expected) :], dtype=torch.float64)
    torch.testing.assert_close(logged.sort().values, expected.sort().values, atol=1e-6, rtol=0)
