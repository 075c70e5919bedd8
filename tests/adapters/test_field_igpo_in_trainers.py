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

from ._field_trainers import verl_inputs, verl_seam_over_step, verl_step_as_proto
from .test_field_mt_grpo_in_trainers import ppo_clip_over_the_step, turn_runs
from .test_field_roll_nemo_advantages_in_trainers import one_micro_batch, trained

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
    x = verl_inputs(seed=seed)
    mask = x["response_mask"]
    B, T = mask.shape
    g = torch.Generator().manual_seed(seed)
    group = torch.arange(B) // 4
    rewards = torch.zeros(B, T, dtype=F64)
    turn_rewards = []
    for i in range(B):
        runs = turn_runs(mask[i].tolist())
        rs = [0.6 * float(torch.rand(1, generator=g)) - 0.3 for _ in runs[:-1]]
        rs.append(0.5 * int(torch.randint(0, 3, (1,), generator=g)))
        for (_, e), r in zip(runs, rs):
            rewards[i, e - 1] = r
        turn_rewards.append(rs)
    return verl_step_as_proto(x, rewards, group), x, turn_rewards, group


@pytest.mark.parametrize("registered", [False, True], ids=["adapter", "verl_estimator"])
def test_igpo_through_verl_and_its_policy_loss_seam_at_two_ranks(registered):
    data, x, turn_rewards, group = per_turn_proto()
    mask = x["response_mask"]
    if registered:
        pytest.importorskip("lossplug.adapters.verl")  # registers the estimator 'lossplug'
        from omegaconf import OmegaConf
        from verl.trainer.ppo.ray_trainer import compute_advantage

        config = OmegaConf.create({"adv_estimator": "lossplug", "lossplug": IGPO, "norm_adv_by_std_in_grpo": True})
        out = compute_advantage(data, adv_estimator="lossplug", gamma=1.0, lam=1.0, config=config)
    else:
        from lossplug.adapters.verl import compute_advantage

        out = compute_advantage(data, IGPO)
    turns = [len(rs) for rs in turn_rewards]
    assert max(turns) >= 3 and min(turns) == 1  # several turns and one-turn responses
    adv = out.batch["advantages"].to(F64)
    torch.testing.assert_close(adv, igpo_written_out(turn_rewards, mask, group), atol=1e-12, rtol=0)
    # the turns of a multi-turn response carry different values (the gains and the discount act)
    assert any(
        abs(float(adv[i, turn_runs(mask[i].tolist())[0][0]] - adv[i, turn_runs(mask[i].tolist())[-1][0]])) > 1e-3
        for i in range(mask.shape[0])
        if turns[i] > 1
    )
    x = {**x, "advantages": torch.where(mask, adv, x["advantages"])}  # verl's garbage off the mask stays
    loss, grad, _ = verl_seam_over_step(IGPO, x)
    expected, expected_grad = ppo_clip_over_the_step(x, adv)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.where(mask, grad, 0), expected_grad, rtol=1e-12, atol=1e-14)


# -- TRL --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_igpo_trains_in_a_trl_grpo_trainer_as_its_one_turn_case(tmp_path):
    trainer = trained(IGPO, tmp_path, None)
    inputs = one_micro_batch(trainer)
    reward, group = inputs["lossplug_reward"].to(F64), inputs["lossplug_group_id"]
    # one position per completion at TRL's advantage seam: one turn, its score the outcome
    expected = igpo_written_out(
        [[float(r)] for r in reward], torch.ones(len(reward), 1, dtype=torch.bool), group
    ).squeeze(-1)
    torch.testing.assert_close(inputs["advantages"].to(F64), expected, atol=1e-5, rtol=1e-5)
    assert bool((inputs["advantages"] != 0).any())


def test_igpo_is_refused_where_trl_completions_can_hold_several_turns(tmp_path):
    pytest.importorskip("trl")
    from lossplug import LossplugError
    from lossplug.testing import tiny

    tok = tiny.tiny_tokenizer()
    with pytest.raises(LossplugError, match=r"igpo.*one position per completion"):
        tiny.tiny_grpo_trainer(
            IGPO, tmp_path / "out", tokenizer=tok, trainer_kwargs={"rollout_func": tiny.TinyRollout(tok)}
        )
