"""GVPO (the ``gvpo`` gate) and KTAE (the ``ktae`` advantage) inside the trainers, through public import paths only.

GVPO: two real TRL ``train()`` steps on the tiny model (each micro-batch one whole prompt group, as GVPO needs), and
the loud refusal when TRL splits a group over micro-batches; verl's ``ppo_loss`` hands a policy loss no prompt ids,
so verl's seam refuses it naming ``group_id`` (the authors' verl fork passes ``uid_tensor`` to their own actor).

KTAE: verl's advantage seam (``lossplug.adapters.verl.compute_advantage`` on a ``DataProto``, which reads the
sampled token ids from ``responses``) against the estimator on the same tensors, its per-token advantages then
through verl's policy-loss seam at 2 ranks × micro-batches against the PPO-clip formula over the step; verl's
registered estimator, to which verl's ``compute_advantage`` passes no ``responses``, reads them from that call's
``DataProto`` (bitwise the adapter's ``compute_advantage``) and refuses when called some other way; TRL (one
advantage per completion) refuses it naming ``token_ids`` and the way out.
"""

from __future__ import annotations

import math

import pytest
import torch

from lossplug import LossplugError

from ._field_trainers import (
    B,
    T,
    assert_trl_refuses_split_groups,
    assert_verl_policy_loss_refuses_for_want_of_prompt_ids,
    train_two_tiny_steps,
    verl_inputs,
    verl_seam_over_step,
)

F64 = torch.float64
GVPO = {
    "advantage": {"name": "grpo", "scale": "none"},  # the authors' norm_adv_by_std_in_grpo=False: R − R̄
    "gates": [{"name": "gvpo", "beta": 0.1, "group_size": 4}],
    "reduction": "response",
}
KTAE = {"advantage": "ktae", "gates": ["ppo_clip"], "reduction": "token"}


# -- GVPO ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_gvpo_trains_inside_trls_grpo_trainer(tmp_path):
    # tiny_grpo_config: 4 completions per prompt, micro-batches of 4, one micro-batch per generation: whole groups
    trainer, _ = train_two_tiny_steps(GVPO, tmp_path, rollout=False)
    losses = [e["lossplug/loss"] for e in trainer.state.log_history if "lossplug/loss" in e]
    assert all(math.isfinite(v) and v >= 0 for v in losses)  # ½·MSE / (n − 1) ≥ 0


@pytest.mark.slow
def test_gvpo_refuses_a_group_that_trl_splits_over_micro_batches(tmp_path):
    assert_trl_refuses_split_groups(GVPO, "gvpo", tmp_path)


def test_gvpo_under_verls_policy_loss_is_refused_naming_the_prompt_ids():
    assert_verl_policy_loss_refuses_for_want_of_prompt_ids(GVPO, "gvpo")


# -- KTAE ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def ktae_proto():
    pytest.importorskip("verl")
    np = pytest.importorskip("numpy")
    from verl import DataProto

    g = torch.Generator().manual_seed(0)
    x = verl_inputs(1)
    mask = x["response_mask"]
    group = torch.arange(B) // 4  # two prompts of 4 rollouts, verl's repeat(interleave=True) order
    correct = torch.tensor([1, 1, 0, 0, 1, 0, 0, 0], dtype=torch.bool)
    responses = torch.randint(3, 9, (B, T), generator=g)
    responses[correct & (group == 0), 0] = 1  # token 1 opens the correct rollouts of prompt 0 only
    responses[~correct & (group == 0), 0] = 2  # token 2 opens its wrong ones
    responses = torch.where(mask, responses, 151643)  # verl pads responses with the pad token
    rewards = torch.zeros(B, T, dtype=F64)
    rewards[:, 0] = correct.to(F64)  # (on an action position: the first token of every response is one)
    uid = np.array([f"prompt-{int(k)}" for k in group], dtype=object)
    tensors = {"token_level_rewards": rewards, "response_mask": mask.long(), "responses": responses}
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid}), x, correct, group, mask, responses


def test_ktae_through_the_verl_adapters_compute_advantage_reads_responses(ktae_proto):
    import lossplug
    from lossplug.adapters.verl import compute_advantage

    data, _, correct, group, mask, responses = ktae_proto
    out = compute_advantage(data, KTAE)
    batch = lossplug.PolicyBatch(
        logp=torch.zeros(B, T, dtype=F64),
        action_mask=mask,
        reward=correct.to(F64),
        group_id=group,
        token_ids=responses,
    )
    expected = lossplug.estimate_advantages(batch, KTAE).advantage
    torch.testing.assert_close(out.batch["advantages"], expected, rtol=0, atol=0)
    adv = out.batch["advantages"]
    grpo = torch.where(correct, 1.0, -1.0) / math.sqrt(4 / 3) / (1 + 1e-6 * math.sqrt(3 / 4))  # ±0.866/(1+…)
    # the first token of prompt 0's correct rollouts adds a positive score, its wrong ones' a negative one
    first = adv[group == 0, 0] - grpo[group == 0].to(F64)
    assert (first[correct[group == 0]] > 0.5).all() and (first[~correct[group == 0]] < -0.5).all()
    assert (adv[~mask] == 0).all()


def test_ktae_advantages_through_verls_policy_loss_at_two_ranks(ktae_proto):
    from lossplug.adapters.verl import compute_advantage

    data, x, _, _, mask, _ = ktae_proto
    adv = compute_advantage(data, KTAE).batch["advantages"]
    x = {**x, "advantages": torch.where(mask, adv, x["advantages"])}  # verl's garbage off the mask stays
    loss, grad, _ = verl_seam_over_step(KTAE, x)
    # PPO clip (0.2) over the step's action tokens, written out
    old = torch.where(mask, x["old_log_prob"], 0)
    logp = torch.where(mask, x["log_prob"], 0).clone().requires_grad_()
    ratio = (logp - old).exp()
    a = torch.where(mask, adv, 0)
    objective = torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
    expected = -(torch.where(mask, objective, 0).sum() / mask.sum())
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, torch.where(mask, logp.grad, 0), rtol=1e-12, atol=1e-14)


def test_ktae_as_verls_registered_estimator_reads_responses_from_its_dataproto(ktae_proto):
    import copy

    pytest.importorskip("lossplug.adapters.verl")  # registers the estimator 'lossplug'
    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from lossplug.adapters.verl import compute_advantage as adapters_compute_advantage

    data, _, correct, group, mask, _ = ktae_proto
    explicit = adapters_compute_advantage(copy.deepcopy(data), KTAE)
    config = OmegaConf.create({"adv_estimator": "lossplug", "lossplug": KTAE, "norm_adv_by_std_in_grpo": True})
    out = compute_advantage(data, adv_estimator="lossplug", gamma=1.0, lam=1.0, config=config)
    assert torch.equal(out.batch["advantages"], explicit.batch["advantages"])
    assert torch.equal(out.batch["returns"], explicit.batch["returns"])
    adv = out.batch["advantages"]  # the token scores are there: prompt 0's first tokens moved apart from GRPO's
    grpo = torch.where(correct, 1.0, -1.0) / math.sqrt(4 / 3) / (1 + 1e-6 * math.sqrt(3 / 4))
    first = adv[group == 0, 0] - grpo[group == 0].to(F64)
    assert (first[correct[group == 0]] > 0.5).all() and (first[~correct[group == 0]] < -0.5).all()
    assert (adv[~mask] == 0).all()


def test_ktae_estimator_called_some_other_way_is_refused_naming_responses(ktae_proto):
    pytest.importorskip("lossplug.adapters.verl")
    from lossplug.adapters.verl import compute_lossplug_advantage

    data, *_ = ktae_proto
    with pytest.raises(LossplugError, match=r"advantage plugin 'ktae' needs 'responses'.*did not come from it"):
        compute_lossplug_advantage(
            data.batch["token_level_rewards"],
            data.batch["response_mask"],
            index=data.non_tensor_batch["uid"],
            config={"lossplug": KTAE},
        )


def test_ktae_in_trl_is_refused_naming_token_ids(tmp_path):
    pytest.importorskip("trl")
    from lossplug.testing import tiny

    with pytest.raises(LossplugError, match=r"token_ids.*one advantage per completion"):
        tiny.tiny_grpo_trainer(KTAE, tmp_path / "out").train()
