"""IGPO's turn advantage (``igpo``, arXiv:2510.14967) inside the trainers, through public import paths only.

* verl: per-turn rewards in ``token_level_rewards`` — an information gain on the last action token of every turn but
  the last, the outcome on the response's last action token, as IGPO's rollout places them — and a
  ``response_mask`` with observation holes (several turns per response), through
  ``lossplug.adapters.verl.compute_advantage(data, recipe)`` and through verl's registered estimator
  (``adv_estimator=lossplug``); the advantages are IGPO's formula written out here turn by turn (independently of
  the plugin and of the unit tests' transcription), then go through verl's policy-loss seam at 2 ranks ×
  micro-batches, loss and gradient against PPO's clip over the step (float64).
* TRL: two real ``GRPOTrainer`` steps; TRL's advantage seam has one position per completion (one turn: its score is
  the outcome), so what runs there is IGPO's one-turn case, ``(R − mean) / (sqrt(pop. var + 1e-8) + 1e-6)``, checked
  on TRL's batch. Where a completion can hold several turns (tools, a ``rollout_func``) the turns are not seen there
  and the adapter refuses.
"""

from __future__ import annotations

import pytest
import torch

from ._field_trainers import (
    assert_trl_one_turn_case,
    assert_trl_refuses_several_turns,
    assert_turn_advantages_through_verl_seam,
    turn_runs,
    verl_advantage,
    verl_step_as_proto,
    verl_turn_step,
)

F64 = torch.float64
GAMMA = 0.9
IGPO = {"advantage": {"name": "igpo", "gamma": GAMMA}, "gates": ["ppo_clip"], "reduction": "token"}


# -- IGPO written out -------------------------------------------------------------------------------------------------


def igpo_written_out(turn_rewards, mask, group, gamma=GAMMA):
    """``turn_rewards[i]``: row i's reward per turn (gains, then the outcome). Every turn reward of the group (the
    outcomes, and the gains that are not 0) z-normalised together with the population std (``sqrt(var + 1e-8)``) +
    1e-6; each turn gets its own and the later turns' normalised rewards, discounted by γ per turn."""
    B, T = mask.shape
    group = group.tolist()
    population = {}
    for i, rs in enumerate(turn_rewards):
        for k, r in enumerate(rs):
            if k == len(rs) - 1 or r != 0:
                population.setdefault(group[i], []).append(r)
    out = torch.zeros(B, T, dtype=F64)
    for i, rs in enumerate(turn_rewards):
        pop = population[group[i]]
        mean = sum(pop) / len(pop)
        std = (sum((r - mean) ** 2 for r in pop) / len(pop) + 1e-8) ** 0.5 if len(pop) > 1 else 1.0
        hat = [(r - mean) / (std + 1e-6) if (k == len(rs) - 1 or r != 0) else 0.0 for k, r in enumerate(rs)]
        runs = turn_runs(mask[i].tolist())
        assert len(runs) == len(rs)
        for k, (s, e) in enumerate(runs):
            value = sum(gamma ** (j - k) * hat[j] for j in range(k, len(rs)))
            for t in range(s, e):
                out[i, t] = value
    return out


# -- verl -------------------------------------------------------------------------------------------------------------


def per_turn_proto(seed=3):
    """verl_inputs' step as a DataProto whose token_level_rewards carry IGPO's per-turn rewards: a gain U(−0.3, 0.3)
    on the last token of every turn but the last, an F1 in {0, 0.5, 1} on the response's last action token; groups
    of 4 in ``uid``."""
    x, turns, g, group, rewards = verl_turn_step(seed)
    turn_rewards = []
    for i, runs in enumerate(turns):
        rs = [0.6 * float(torch.rand(1, generator=g)) - 0.3 for _ in runs[:-1]]
        rs.append(0.5 * int(torch.randint(0, 3, (1,), generator=g)))
        for (_, e), r in zip(runs, rs):
            rewards[i, e - 1] = r
        turn_rewards.append(rs)
    return verl_step_as_proto(x, rewards, group), x, turn_rewards, group


@pytest.mark.parametrize("registered", [False, True], ids=["adapter", "verl_estimator"])
def test_igpo_through_verl_and_its_policy_loss_seam_at_two_ranks(registered):
    data, x, turn_rewards, group = per_turn_proto()
    adv = verl_advantage(data, IGPO, registered).batch["advantages"].to(F64)
    # igpo_written_out checks each row's turns against its per-turn rewards; the turns of a multi-turn response
    # carry different values (the gains and the discount act)
    expected = igpo_written_out(turn_rewards, x["response_mask"], group)
    assert_turn_advantages_through_verl_seam(IGPO, x, adv, expected)


# -- TRL --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_igpo_trains_in_a_trl_grpo_trainer_as_its_one_turn_case(tmp_path):
    def one_turn(reward, group):
        # one position per completion at TRL's advantage seam: one turn, its score the outcome
        one = torch.ones(len(reward), 1, dtype=torch.bool)
        return igpo_written_out([[float(r)] for r in reward], one, group).squeeze(-1)

    assert_trl_one_turn_case(IGPO, tmp_path, one_turn)


def test_igpo_is_refused_where_trl_completions_can_hold_several_turns(tmp_path):
    assert_trl_refuses_several_turns(IGPO, "igpo", tmp_path)
