"""TreePO's tree advantage (the ``treepo`` estimator, arXiv:2508.17445) and the trainers.

Neither trainer's batch carries the sampling tree: TRL's GRPOTrainer samples independent completions, and verl's
DataProto holds no per-token node ids (TreePO's own verl fork keys its subgroups by a ``prompt#b1#b2…`` string uid
its tree rollout writes). So verl's registered estimator, the verl adapter's ``compute_advantage`` and TRL refuse the
recipe naming ``segment_id``, through the adapters' existing machinery for fields a seam lacks. Once advantages are
estimated on a PolicyBatch that has the ids, the loss side needs nothing more: they run through verl's policy-loss
seam at 2 ranks × micro-batches against PPO-clip written out.
"""

from __future__ import annotations

import random

import pytest
import torch

import lossplug
from lossplug import LossplugError

from ._field_trainers import B, T, verl_inputs, verl_seam_over_step

F64 = torch.float64
TREEPO = {"advantage": "treepo", "gates": ["ppo_clip"], "reduction": "token"}
MISSING = r"advantage plugin 'treepo' needs 'segment_id'"


@pytest.fixture
def proto():
    pytest.importorskip("verl")
    np = pytest.importorskip("numpy")
    from verl import DataProto

    x = verl_inputs(2)
    mask = x["response_mask"]
    group = torch.arange(B) // 4
    correct = torch.tensor([1, 0, 0, 1, 1, 0, 0, 0], dtype=torch.bool)
    rewards = torch.zeros(B, T, dtype=F64)
    rewards[:, 0] = correct.to(F64)
    uid = np.array([f"prompt-{int(k)}" for k in group], dtype=object)
    tensors = {"token_level_rewards": rewards, "response_mask": mask.long(), "responses": torch.zeros(B, T).long()}
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid}), x, correct, group


def test_verls_registered_estimator_refuses_treepo_naming_segment_id(proto):
    pytest.importorskip("lossplug.adapters.verl")  # registers the estimator 'lossplug'
    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import compute_advantage

    data, *_ = proto
    config = OmegaConf.create({"adv_estimator": "lossplug", "lossplug": TREEPO, "norm_adv_by_std_in_grpo": True})
    with pytest.raises(LossplugError, match=MISSING):
        compute_advantage(data, adv_estimator="lossplug", gamma=1.0, lam=1.0, config=config)


def test_the_verl_adapters_compute_advantage_refuses_treepo_naming_segment_id(proto):
    from lossplug.adapters.verl import compute_advantage

    data, *_ = proto
    with pytest.raises(LossplugError, match=r"compute_advantage\(recipe\): " + MISSING):
        compute_advantage(data, TREEPO)


def test_treepo_advantages_through_verls_policy_loss_at_two_ranks(proto):
    _, x, correct, group = proto
    mask = x["response_mask"]
    # each prompt's tree: rows 4k, 4k+1 share their first action token's segment, rows 4k+2, 4k+3 another; the rest
    # of each row is a leaf segment of its own
    first = mask.long().cumsum(-1) == 1
    segment_id = torch.where(first, 1 + (torch.arange(B) % 4 >= 2).long().unsqueeze(-1), 10 + torch.arange(B)[:, None])
    batch = lossplug.PolicyBatch(
        logp=torch.zeros(B, T, dtype=F64),
        action_mask=mask,
        reward=correct.to(F64),
        group_id=group,
        segment_id=segment_id,
    )
    adv = lossplug.estimate_advantages(batch, TREEPO).advantage  # [B]
    assert not torch.allclose(
        adv, lossplug.estimate_advantages(batch, {**TREEPO, "advantage": "reinforce_plus_plus_baseline"}).advantage
    )  # the subgroups changed it
    per_token = adv.unsqueeze(-1).expand(B, T)
    x = {**x, "advantages": torch.where(mask, per_token, x["advantages"])}  # verl's garbage off the mask stays
    loss, grad, _ = verl_seam_over_step(TREEPO, x)
    old = torch.where(mask, x["old_log_prob"], 0)
    logp = torch.where(mask, x["log_prob"], 0).clone().requires_grad_()
    ratio = (logp - old).exp()
    objective = torch.minimum(ratio * per_token, ratio.clamp(0.8, 1.2) * per_token)
    expected = -(torch.where(mask, objective, 0).sum() / mask.sum())
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, torch.where(mask, logp.grad, 0), rtol=1e-12, atol=1e-14)


def test_treepo_in_trl_is_refused_naming_segment_id(tmp_path):
    pytest.importorskip("trl")
    from lossplug.testing import tiny

    random.seed(0)
    with pytest.raises(LossplugError, match=r"segment_id"):
        tiny.tiny_grpo_trainer(TREEPO, tmp_path / "out").train()
