"""NeMo-RL's leave-one-out GDPO (``gdpo_loo``) and ROLL's ``step_reinforce`` and ``agentic_reinforce`` inside the
trainers, through public import paths only.

* TRL: ``gdpo_loo`` (two reward functions) and ``agentic_reinforce`` run two real ``GRPOTrainer`` steps on the tiny
  model, and the advantages TRL's batch carries are the origins' formulas (written out here, independently of the
  plugins). ``step_reinforce`` reads ``trajectory_id``, which TRL's advantage seam cannot feed: refused by name.
  TRL's advantage seam has one position per completion, so ``agentic_reinforce`` sees one turn per completion there.
* verl: ``gdpo_loo`` through ``lossplug.adapters.verl.compute_advantage(data, recipe, reward_keys=...)`` (verl's
  registered estimator gets no per-function rewards: refused, with the way out), ``agentic_reinforce`` through both
  (its turns are the runs of verl's ``response_mask``), ``step_reinforce`` refused while the batch holds no
  trajectory ids, then run with verl-agent's ``traj_uid`` in ``non_tensor_batch``, equal to
  ``lossplug.estimate_advantages`` on a ``PolicyBatch`` with ``trajectory_id`` and to ROLL's formula; each one's
  advantages then go through verl's policy-loss seam at 2 ranks × micro-batches, loss and gradient against
  ``−Σ A·logp / N`` over the step (float64).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import lossplug
from lossplug import BatchValidationError, LossplugError

from ._field_trainers import verl_inputs, verl_seam_over_step, verl_step_as_proto

F64 = torch.float64


# -- the origins' formulas, written out -------------------------------------------------------------------------------


def nemo_gdpo(components, group):
    """NeMo-RL's GDPOAdvantageEstimator (leave-one-out, normalize_rewards, weights 1) row by row, in float64."""
    B, K = components.shape
    total = [0.0] * B
    for k in range(K):
        r = components[:, k].tolist()
        for i in range(B):
            others = [r[j] for j in range(B) if group[j] == group[i] and j != i]
            if not others:  # a group of one: baseline = its reward
                continue
            base = sum(others) / len(others)
            n = len(others)
            var = sum((x - base) ** 2 for x in others) / (n - 1) if n > 1 else 0.0
            std = math.sqrt(var)
            total[i] += (r[i] - base) / (std + 1e-6) if std > 0 else r[i] - base
    t = torch.tensor(total, dtype=F64)
    return (t - t.mean()) / t.std() if float(t.std()) > 0 else t - t.mean()


def roll_norm(score, group):
    """ROLL's agentic_reward_norm with grouping traj_group_id, norm_mean_type and norm_std_type group."""
    out = torch.zeros_like(score)
    for g in group.unique():
        rows = group == g
        s = score[rows]
        std = float(s.std()) if s.numel() > 1 else float("nan")
        out[rows] = (s - s.mean()) / (std + 1e-6) if s.numel() > 1 and abs(std) > 1e-6 else 0.0
    return out


def roll_turn_discount(normalised, mask, gamma):
    """``[B, T]``: γ^(turns after the token's turn) · R̂ on the action tokens (ROLL's segments walked backwards)."""
    out = torch.zeros(mask.shape, dtype=F64)
    for b in range(mask.shape[0]):
        value, inside = float(normalised[b]), False
        for t in reversed(range(mask.shape[1])):
            if mask[b, t]:
                if not inside and t < mask.shape[1] - 1 and bool(mask[b, t + 1 :].any()):
                    value *= gamma  # a new (earlier) turn starts here, walking backwards
                inside = True
                out[b, t] = value
            else:
                inside = False
    return out


def reinforce_over_the_step(x, advantages):
    """−Σ A·logp / N over the step's action tokens: loss and gradient."""
    mask = x["response_mask"]
    logp = torch.where(mask, x["log_prob"], -1.0).requires_grad_()
    expected = -(torch.where(mask, advantages * logp, 0)).sum() / mask.sum()
    expected.backward()
    return expected.detach(), torch.where(mask, logp.grad, 0)


def through_verls_seam(x, advantages):
    """The step through verl's policy-loss seam at 2 ranks with ``advantages`` (garbage kept off the mask)."""
    mask = x["response_mask"]
    x = {**x, "advantages": torch.where(mask, advantages.to(F64), x["advantages"])}
    total, grad, _ = verl_seam_over_step({"gates": ["reinforce"], "reduction": "token"}, x)
    expected, expected_grad = reinforce_over_the_step(x, advantages.to(F64))
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.where(mask, grad, 0), expected_grad, rtol=1e-12, atol=1e-14)


# -- TRL --------------------------------------------------------------------------------------------------------------


def char_reward(completions, **kwargs):
    """A second reward function that varies within a group: the completion's length in characters mod 3."""
    return [float(len(str(c)) % 3) for c in completions]


def one_micro_batch(trainer):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def trained(recipe, tmp_path, reward_funcs):
    pytest.importorskip("trl")
    from lossplug.testing import tiny

    trainer = tiny.tiny_grpo_trainer(recipe, tmp_path / "out", reward_funcs=reward_funcs, max_steps=2)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 2
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses and all(math.isfinite(loss) for loss in losses)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    return trainer


@pytest.mark.slow
def test_gdpo_loo_trains_in_a_trl_grpo_trainer(tmp_path):
    from lossplug.testing import tiny

    recipe = {"advantage": "gdpo_loo", "gates": ["ppo_clip"], "reduction": "token"}
    trainer = trained(recipe, tmp_path, [tiny.length_reward, char_reward])
    inputs = one_micro_batch(trainer)  # the whole generation batch of the tiny configuration
    components, group = inputs["lossplug_reward_components"].to(F64), inputs["lossplug_group_id"]
    assert components.shape[1] == 2 and bool((components.std(0) > 0).all())  # both functions vary
    torch.testing.assert_close(inputs["advantages"].to(F64), nemo_gdpo(components, group), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_agentic_reinforce_trains_in_a_trl_grpo_trainer(tmp_path):

    advantage = {"name": "agentic_reinforce", "gamma": 0.5, "grouping": "group", "mean": "group", "std": "group"}
    trainer = trained({"advantage": advantage, "gates": ["ppo_clip"], "reduction": "token"}, tmp_path, None)
    inputs = one_micro_batch(trainer)
    reward, group = inputs["lossplug_reward"].to(F64), inputs["lossplug_group_id"]
    # one position per completion at TRL's advantage seam: one turn, γ never applies
    torch.testing.assert_close(inputs["advantages"].to(F64), roll_norm(reward, group), atol=1e-5, rtol=1e-5)
    assert bool((inputs["advantages"] != 0).any())


@pytest.mark.parametrize("gamma", [0.5, 1.0])
def test_agentic_reinforce_below_gamma_one_is_refused_where_trl_completions_can_hold_several_turns(tmp_path, gamma):
    """With a rollout_func (or tools) a completion may hold several turns, which TRL's advantage seam (one position per
    completion) does not see: γ < 1 would silently give every turn the undiscounted score."""
    pytest.importorskip("trl")
    from lossplug.testing import tiny

    recipe = {"advantage": {"name": "agentic_reinforce", "gamma": gamma}, "gates": ["ppo_clip"], "reduction": "token"}
    tok = tiny.tiny_tokenizer()
    make = lambda: tiny.tiny_grpo_trainer(
        recipe, tmp_path / "out", tokenizer=tok, trainer_kwargs={"rollout_func": tiny.TinyRollout(tok)}
    )
    if gamma == 1.0:
        make()  # γ = 1 (ROLL's default) is exact whatever the turns
        return
    with pytest.raises(LossplugError, match=r"agentic_reinforce.*gamma=0\.5.*Next step: gamma: 1\.0"):
        make()


def test_trl_cannot_supply_step_reinforces_trajectory_id_and_says_which(tmp_path):
    pytest.importorskip("trl")
    from lossplug.testing import tiny

    with pytest.raises((LossplugError, BatchValidationError), match="trajectory_id") as err:
        trainer = tiny.tiny_grpo_trainer(
            {"advantage": "step_reinforce", "gates": ["ppo_clip"], "reduction": "token"}, tmp_path / "out"
        )
        one_micro_batch(trainer)
    assert "step_reinforce" in str(err.value) and "Next step" in str(err.value)


# -- verl -------------------------------------------------------------------------------------------------------------


def multi_turn_proto(seed=3, reward_keys=()):
    """verl_inputs' step (multi-turn response masks: observation tokens inside the response) as a DataProto: the
    score on each response's last action token, prompt groups of 4 in ``uid``, per-function rewards under
    ``reward_keys`` in ``non_tensor_batch``."""
    x = verl_inputs(seed=seed)
    mask = x["response_mask"]
    B, T = mask.shape
    g = torch.Generator().manual_seed(seed)
    group = torch.arange(B) // 4
    components = torch.stack(
        [(torch.rand(B, generator=g) < 0.5).to(F64), torch.rand(B, generator=g, dtype=F64) * 2], -1
    )
    score = components.sum(-1)
    last = T - 1 - mask.flip(-1).int().argmax(-1)  # each row's last action token
    rewards = torch.zeros(B, T, dtype=F64)
    rewards[torch.arange(B), last] = score
    per_function = {key: components[:, k].numpy() for k, key in enumerate(reward_keys)}
    return verl_step_as_proto(x, rewards, group, per_function), x, score, components, group


def test_gdpo_loo_through_the_verl_adapter_and_verls_policy_loss_seam():
    from lossplug.adapters.verl import compute_advantage

    keys = ("reward/correct", "reward/format")
    data, x, _, components, group = multi_turn_proto(reward_keys=keys)
    recipe = {"advantage": "gdpo_loo", "gates": ["ppo_clip"], "reduction": "token"}
    out = compute_advantage(data, recipe, reward_keys=list(keys))
    mask = x["response_mask"]
    expected = nemo_gdpo(components, group)[:, None].expand(mask.shape)
    torch.testing.assert_close(out.batch["advantages"], torch.where(mask, expected, 0), atol=1e-12, rtol=1e-12)
    through_verls_seam(x, out.batch["advantages"])


def test_verls_registered_estimator_cannot_supply_gdpo_loos_components_and_says_how():
    pytest.importorskip("lossplug.adapters.verl")
    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import compute_advantage

    data, *_ = multi_turn_proto()
    recipe = {"advantage": "gdpo_loo", "gates": ["ppo_clip"], "reduction": "token"}
    config = OmegaConf.create({"adv_estimator": "lossplug", "lossplug": recipe, "norm_adv_by_std_in_grpo": True})
    with pytest.raises(LossplugError) as err:
        compute_advantage(data, adv_estimator="lossplug", gamma=1.0, lam=1.0, config=config)
    assert "advantage plugin 'gdpo_loo' needs 'reward_components'" in str(err.value), str(err.value)
    assert "reward_keys" in str(err.value)


@pytest.mark.parametrize("registered", [False, True], ids=["adapter", "verl_estimator"])
def test_agentic_reinforce_through_verl_and_its_policy_loss_seam(registered):
    data, x, score, _, group = multi_turn_proto()
    mask = x["response_mask"]
    advantage = {"name": "agentic_reinforce", "gamma": 0.8, "grouping": "group", "mean": "group", "std": "group"}
    recipe = {"advantage": advantage, "gates": ["ppo_clip"], "reduction": "token"}
    if registered:
        pytest.importorskip("lossplug.adapters.verl")
        from omegaconf import OmegaConf
        from verl.trainer.ppo.ray_trainer import compute_advantage

        config = OmegaConf.create({"adv_estimator": "lossplug", "lossplug": recipe, "norm_adv_by_std_in_grpo": True})
        out = compute_advantage(data, adv_estimator="lossplug", gamma=0.8, lam=1.0, config=config)
    else:
        from lossplug.adapters.verl import compute_advantage

        out = compute_advantage(data, recipe)
    expected = roll_turn_discount(roll_norm(score, group), mask, 0.8)
    turns = (mask[:, 1:] & ~mask[:, :-1]).sum(-1) + mask[:, 0]
    assert int(turns.max()) >= 3  # multi-turn rows: the discount acts
    torch.testing.assert_close(out.batch["advantages"].to(F64), expected, atol=1e-12, rtol=1e-12)
    through_verls_seam(x, out.batch["advantages"])


def test_step_reinforce_through_the_verl_adapter_with_traj_uid_and_verls_policy_loss_seam():
    from lossplug.adapters.verl import compute_advantage

    data, x, score, _, group = multi_turn_proto()
    advantage = {"name": "step_reinforce", "gamma": 0.5, "grouping": "group", "mean": "group", "std": "group"}
    recipe = {"advantage": advantage, "gates": ["reinforce"], "reduction": "token"}
    with pytest.raises(LossplugError) as err:  # no trajectory ids in the batch: the adapter says where to put them
        compute_advantage(data, recipe)
    assert "advantage plugin 'step_reinforce' needs 'traj_uid', which the batch does not hold" in str(err.value)
    assert "Next step: put each row's trajectory in data.non_tensor_batch as 'traj_uid'" in str(err.value)
    # the next step: each verl row one step, two steps per trajectory (rows 2j, 2j + 1 in time order)
    mask = x["response_mask"]
    trajectory = torch.arange(mask.shape[0]) // 2
    batch = lossplug.PolicyBatch(
        logp=torch.where(mask, x["old_log_prob"], -1.0),
        action_mask=mask,
        reward=score,
        group_id=group,
        trajectory_id=trajectory,
    )
    adv = lossplug.estimate_advantages(batch, recipe).advantage
    returns = score.clone()
    returns[0::2] = score[0::2] + 0.5 * score[1::2]  # G = r + γ·G_next
    torch.testing.assert_close(adv, roll_norm(returns, group), atol=1e-12, rtol=1e-12)
    # the same ids as verl-agent's traj_uid strings in the DataProto: the adapter gives the same advantages
    data.non_tensor_batch["traj_uid"] = np.array([f"episode-{int(t)}" for t in trajectory], dtype=object)
    out = compute_advantage(data, recipe)
    torch.testing.assert_close(out.batch["advantages"].to(F64), torch.where(mask, adv[:, None], 0), atol=0, rtol=0)
    through_verls_seam(x, adv[:, None].expand(mask.shape))
