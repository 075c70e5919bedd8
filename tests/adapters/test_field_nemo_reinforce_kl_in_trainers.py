"""NeMo-RL's Reinforce++ with ``use_kl_in_reward`` (``reinforce_plus_plus_baseline`` with ``kl_coef``) inside the
trainers, through public import paths only.

* verl: ``lossplug.adapters.verl.compute_advantage(data, recipe)`` (a custom trainer's call) on a ``DataProto`` that
  holds ``old_log_probs`` and ``ref_log_prob`` — as verl's ``ray_trainer`` holds them at advantage time — equals
  NeMo-RL's estimator (transcribed in ``tests/plugins/advantages/test_reinforce_plus_plus.py``) on multi-turn
  response masks, and the advantages then go through verl's policy-loss seam at 2 ranks × micro-batches (``ppo_clip``),
  loss and gradient against the surrogate written out (float64). verl's own ``ray_trainer.compute_advantage`` with
  ``adv_estimator=lossplug`` hands a registered estimator no log-probs: the estimator reads both from that call's
  ``DataProto`` (its caller's frame), bitwise the adapter's ``compute_advantage`` on the same ``DataProto``; without a
  reference (no ``ref_log_prob``) it is refused naming the setting, and called some other way, naming both fields
  and the way out.
* TRL: its advantage seam has one position per completion and no log-probs: refused when the trainer is built,
  naming both fields and the next step.
"""

from __future__ import annotations

import pytest
import torch

from lossplug import LossplugError

from ..plugins.advantages.test_reinforce_plus_plus import nemo_reinforce_plus_plus
from ._field_trainers import B, T, verl_inputs, verl_seam_over_step, verl_step_as_proto

F64 = torch.float64
ADVANTAGE = {"name": "reinforce_plus_plus_baseline", "kl_coef": 0.2, "kl_estimator": "k3", "variance": "biased"}
RECIPE = {
    "advantage": ADVANTAGE,
    "gates": [{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2}],
    "reduction": "token",
}


def kl_step(seed: int = 3):
    """verl_inputs' step (multi-turn masks, garbage off them) as verl's DataProto at advantage time: the score on each
    response's last action token, prompt groups of 4 in ``uid``, ``old_log_probs`` and ``ref_log_prob``."""
    x = verl_inputs(seed=seed)
    mask = x["response_mask"]
    g = torch.Generator().manual_seed(seed)
    group = torch.arange(B) // 4
    score = (torch.rand(B, generator=g) < 0.5).to(F64) + 0.25 * torch.rand(B, generator=g, dtype=F64)
    last = T - 1 - mask.flip(-1).int().argmax(-1)
    rewards = torch.zeros(B, T, dtype=F64)
    rewards[torch.arange(B), last] = score
    ref = (x["old_log_prob"] + 0.5 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    ref = torch.where(mask, ref, -77.0)  # garbage off the mask, as verl holds there
    data = verl_step_as_proto(x, rewards, group)
    data.batch["ref_log_prob"] = ref
    oracle_input = {"score": score, "group": group, "mask": mask, "old": x["old_log_prob"], "ref": ref}
    return data, x, oracle_input


def ppo_clip_over_the_step(x, advantages):
    """The PPO-clip surrogate over the step's action tokens (ε 0.2, token mean): loss and gradient."""
    mask = x["response_mask"]
    logp = torch.where(mask, x["log_prob"], -1.0).requires_grad_()
    ratio = torch.exp(logp - torch.where(mask, x["old_log_prob"], -1.0))
    per_token = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2))
    expected = torch.where(mask, per_token, 0).sum() / mask.sum()
    expected.backward()
    return expected.detach(), torch.where(mask, logp.grad, 0)


def test_nemo_rls_kl_in_the_advantage_through_the_verl_adapter_and_verls_policy_loss_seam():
    from lossplug.adapters.verl import compute_advantage

    data, x, oracle_input = kl_step()
    mask = x["response_mask"]
    out = compute_advantage(data, RECIPE)
    expected = torch.where(mask, torch.tensor(nemo_reinforce_plus_plus(oracle_input, 0.2, "k3"), dtype=F64), 0)
    advantages = out.batch["advantages"].to(F64)
    torch.testing.assert_close(advantages, expected, atol=1e-12, rtol=0)
    row_constant = torch.stack([advantages[i, mask[i]].std() for i in range(B)])
    assert bool((row_constant > 0).any())  # the per-token KL moves tokens of one response apart

    step = {**x, "advantages": torch.where(mask, advantages, x["advantages"])}
    total, grad, _ = verl_seam_over_step(RECIPE, step)
    expected_loss, expected_grad = ppo_clip_over_the_step(x, expected)
    torch.testing.assert_close(total, expected_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.where(mask, grad, 0), expected_grad, rtol=1e-12, atol=1e-14)


def verls_compute_advantage(data):
    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import compute_advantage

    config = OmegaConf.create({"adv_estimator": "lossplug", "lossplug": RECIPE, "norm_adv_by_std_in_grpo": True})
    return compute_advantage(data, adv_estimator="lossplug", gamma=1.0, lam=1.0, config=config)


def test_verls_registered_estimator_reads_the_log_probs_of_its_dataproto():
    pytest.importorskip("lossplug.adapters.verl")
    from lossplug.adapters.verl import compute_advantage

    data, x, oracle_input = kl_step()
    out = verls_compute_advantage(data)
    explicit = compute_advantage(kl_step()[0], RECIPE)
    assert torch.equal(out.batch["advantages"], explicit.batch["advantages"])
    assert torch.equal(out.batch["returns"], explicit.batch["returns"])
    mask = x["response_mask"]
    expected = torch.where(mask, torch.tensor(nemo_reinforce_plus_plus(oracle_input, 0.2, "k3"), dtype=F64), 0)
    torch.testing.assert_close(out.batch["advantages"].to(F64), expected, atol=1e-12, rtol=0)


def test_verls_registered_estimator_without_a_reference_names_the_setting():
    pytest.importorskip("lossplug.adapters.verl")
    data, *_ = kl_step()
    data.batch.pop("ref_log_prob")
    with pytest.raises(LossplugError) as err:
        verls_compute_advantage(data)
    message = str(err.value)
    assert "advantage plugin 'reinforce_plus_plus_baseline' needs 'ref_log_prob', which the batch does not" in message
    assert "Next step: actor_rollout_ref.actor.use_kl_loss=true" in message, message


def test_the_estimator_called_some_other_way_names_both_log_probs_and_the_way_out():
    pytest.importorskip("lossplug.adapters.verl")
    from lossplug.adapters.verl import compute_lossplug_advantage

    data, *_ = kl_step()
    with pytest.raises(LossplugError) as err:
        compute_lossplug_advantage(
            data.batch["token_level_rewards"],
            data.batch["response_mask"],
            index=data.non_tensor_batch["uid"],
            config={"lossplug": RECIPE},
        )
    message = str(err.value)
    for field in ("old_log_probs", "ref_log_prob"):
        assert f"advantage plugin 'reinforce_plus_plus_baseline' needs '{field}'" in message, message
    assert "this call did not come from it" in message
    assert "lossplug.adapters.verl.compute_advantage(data, recipe)" in message and "Next step" in message


def test_without_the_kl_verls_registered_estimator_runs_it():
    """kl_coef 0 requires no log-probs: verl's own compute_advantage runs the same recipe."""
    pytest.importorskip("lossplug.adapters.verl")
    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import compute_advantage

    data, x, oracle_input = kl_step()
    recipe = {**RECIPE, "advantage": {**ADVANTAGE, "kl_coef": 0.0}}
    config = OmegaConf.create({"adv_estimator": "lossplug", "lossplug": recipe, "norm_adv_by_std_in_grpo": True})
    out = compute_advantage(data, adv_estimator="lossplug", gamma=1.0, lam=1.0, config=config)
    mask = x["response_mask"]
    expected = torch.where(mask, torch.tensor(nemo_reinforce_plus_plus(oracle_input, 0.0), dtype=F64), 0)
    torch.testing.assert_close(out.batch["advantages"].to(F64), expected, atol=1e-12, rtol=0)


def test_trl_refuses_the_kl_in_the_advantage_and_names_the_next_step(tmp_path):
    pytest.importorskip("trl")
    from lossplug.testing import tiny

    with pytest.raises(LossplugError) as err:
        tiny.tiny_grpo_trainer(RECIPE, tmp_path / "out")
    message = str(err.value)
    for field in ("old_logp", "ref_logp"):
        assert f"recipe.advantage (reinforce_plus_plus_baseline) reads {field}" in message, message
    assert "Next step: put the KL in the loss instead: a kl regularizer" in message
    assert "algorithm.adv_estimator=lossplug reads old_log_probs" in message
