"""MT-GRPO's turn-level advantage (``mt_grpo``, arXiv:2505.11821; verl #1654) inside the trainers, through public
import paths only.

* verl: per-turn rewards in ``token_level_rewards`` (the first turn's reward on its last action token, the outcome
  on the response's last action token) and a ``response_mask`` with observation holes (several turns per response),
  through ``lossplug.adapters.verl.compute_advantage(data, recipe)`` and through verl's registered estimator
  (``adv_estimator=lossplug``); the advantages are MT-GRPO's formula written out here row by row (independently of
  the plugin), then go through verl's policy-loss seam at 2 ranks × micro-batches, loss and gradient against PPO's
  clip over the step (float64).
* TRL: two real ``GRPOTrainer`` steps; TRL's advantage seam has one position per completion (one turn, the score
  summed), so what runs there is MT-GRPO's one-turn case, ``(R − mean) / (std + 1e-4)``, checked on TRL's batch.
  Where a completion can hold several turns (tools, a ``rollout_func``) the turns are not seen there: refused.
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
MT_GRPO = {"advantage": "mt_grpo", "gates": ["ppo_clip"], "reduction": "token"}


# -- MT-GRPO written out ----------------------------------------------------------------------------------------------


def normalised(values, group):
    """(r − mean) / (torch's sample std + 1e-4) in each group (the reference's _compute_normalized_advantages)."""
    out = []
    for i, r in enumerate(values):
        members = [values[j] for j in range(len(values)) if group[j] == group[i]]
        mean = sum(members) / len(members)
        std = (sum((x - mean) ** 2 for x in members) / (len(members) - 1)) ** 0.5
        out.append((r - mean) / (std + 1e-4))
    return out


def mt_grpo_written_out(turn_reward, outcome, mask, group, coef=1.0):
    """Outcome advantage everywhere plus coef × turn advantage on the first turn; the combined advantage on a
    one-turn response (MTGRPOEnvTrainer._assign_advantages); 0 off the mask."""
    B, T = mask.shape
    group = group.tolist()
    a_t = normalised(turn_reward, group)
    a_o = normalised(outcome, group)
    a_c = normalised([t + o for t, o in zip(turn_reward, outcome)], group)
    out = torch.zeros(B, T, dtype=F64)
    for i in range(B):
        runs = turn_runs(mask[i].tolist())
        for k, (s, e) in enumerate(runs):
            for t in range(s, e):
                out[i, t] = a_c[i] if len(runs) == 1 else a_o[i] + (coef * a_t[i] if k == 0 else 0.0)
    return out


# -- verl -------------------------------------------------------------------------------------------------------------


def per_turn_proto(seed=3):
    """verl_inputs' step as a DataProto whose token_level_rewards carry per-turn rewards: a turn reward on the first
    turn's last token of every response of two or more turns (0 for one of one turn, as the reference's turn
    functions give without a tool call), the outcome on the response's last action token; groups of 4 in ``uid``."""
    x, turns, g, group, rewards = verl_turn_step(seed)
    turn_reward, outcome = [], []
    for i, runs in enumerate(turns):
        o = float(torch.rand(1, generator=g) < 0.5) + 0.1 * float(torch.rand(1, generator=g))
        t = 0.1 * int(torch.randint(0, 3, (1,), generator=g)) if len(runs) > 1 else 0.0
        rewards[i, runs[-1][1] - 1] += o
        rewards[i, runs[0][1] - 1] += t
        turn_reward.append(t)
        outcome.append(o)
    return verl_step_as_proto(x, rewards, group), x, turn_reward, outcome, group


@pytest.mark.parametrize("registered", [False, True], ids=["adapter", "verl_estimator"])
def test_mt_grpo_through_verl_and_its_policy_loss_seam_at_two_ranks(registered):
    data, x, turn_reward, outcome, group = per_turn_proto()
    adv = verl_advantage(data, MT_GRPO, registered).batch["advantages"].to(F64)
    # several turns and one-turn responses in both groups; the first turn of a multi-turn response differs from its
    # later turns (the turn advantage acts)
    expected = mt_grpo_written_out(turn_reward, outcome, x["response_mask"], group)
    assert_turn_advantages_through_verl_seam(MT_GRPO, x, adv, expected)


# -- TRL --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_mt_grpo_trains_in_a_trl_grpo_trainer_as_its_one_turn_case(tmp_path):
    def one_turn(reward, group):
        # one position per completion at TRL's advantage seam: one turn, the combined advantage (r − mean)/(std + 1e-4)
        expected = torch.tensor(normalised(reward.tolist(), group.tolist()), dtype=F64)
        constant = torch.tensor([bool((reward[group == g] == reward[group == g][0]).all()) for g in group.tolist()])
        return torch.where(constant, 0.0, expected)

    assert_trl_one_turn_case(MT_GRPO, tmp_path, one_turn)


def test_mt_grpo_is_refused_where_trl_completions_can_hold_several_turns(tmp_path):
    assert_trl_refuses_several_turns(MT_GRPO, "mt_grpo", tmp_path)
