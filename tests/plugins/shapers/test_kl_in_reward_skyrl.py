"""kl_in_reward is SkyRL 0.3.0's KL in the reward (use_kl_in_reward, trainer.apply_reward_kl_penalty): its own
compute_approx_kl, masked_mean and AdaptiveKLController (read from the published wheel), composed as the trainer
method composes them (rewards − kl · max(0, β); β updated with the batch's mean per-response KL, n_steps the batch
size), over three steps, for each of SkyRL's estimators."""

from __future__ import annotations

import pytest
import torch

import lossplug

from ..gates._field_origins import skyrl_ppo_utils

B, T = 6, 9
#: SkyRL's kl_estimator_type → lossplug's (verl's) estimator of the same formula and clamps
ESTIMATORS = {"k1": "k1", "abs": "abs", "k2": "k2", "k3": "k3"}


def step_batch(step: int) -> lossplug.PolicyBatch:
    g = torch.Generator().manual_seed(10 + step)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    ref = (old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0)
    scores = torch.where(mask, torch.randn(B, T, generator=g, dtype=torch.float64), 0.0)
    return lossplug.PolicyBatch(
        logp=old, old_logp=old, ref_logp=ref, action_mask=mask, reward=scores, group_id=torch.arange(B) // 2
    )


@pytest.mark.parametrize("skyrl_name", sorted(ESTIMATORS))
def test_three_adaptive_steps_equal_skyrls(origins, skyrl_name):
    ppo = skyrl_ppo_utils(origins)
    controller = ppo.AdaptiveKLController(init_kl_coef=0.05, target=0.02, horizon=40)
    recipe = lossplug.Recipe.model_validate(
        {
            "shapers": [
                {
                    "name": "kl_in_reward",
                    "estimator": ESTIMATORS[skyrl_name],
                    "coef": 0.05,
                    "controller": "adaptive",
                    "target_kl": 0.02,
                    "horizon": 40,
                }
            ],
            "advantage": "grpo",
            "gates": ["ppo_clip"],
            "reduction": "token",
        }
    )
    for step in range(3):
        b = step_batch(step)
        mask = b.action_mask.long()  # SkyRL's loss_mask
        kl = ppo.compute_approx_kl(b.old_logp, b.ref_logp, loss_mask=mask, kl_estimator_type=skyrl_name)
        expected = b.reward - kl * max(0, controller.value)
        avg_kl = ppo.masked_mean(kl, mask, dim=-1).mean().item()
        controller.update(current=avg_kl, n_steps=kl.shape[0])
        shaped = lossplug.estimate_advantages(b, recipe).reward
        torch.testing.assert_close(shaped, expected, rtol=0, atol=1e-15)
        beta = lossplug.controller_state(recipe)["shapers[0]"]["value"]
        assert beta == pytest.approx(float(controller.value), rel=1e-12), step
