"""mismatch_rejection's mask is verl 0.9.1's compute_rollout_rejection_mask (the installed package) for every
rollout_rs option, and dropping those tokens at the batch makes lossplug's token-mean loss verl's (the rejected tokens
leave the denominator, where the rollout_rs gate keeps them)."""

from __future__ import annotations

import pytest
import torch

import lossplug

pytest.importorskip("verl")

from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

B, T = 8, 12


def batch() -> lossplug.PolicyBatch:
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([12, 3, 7, 12, 1, 9, 5, 11])
    mask = torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    behavior = old + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)
    return lossplug.PolicyBatch(
        logp=(old + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0),
        old_logp=old,
        behavior_logp=behavior.clamp(max=0),
        action_mask=mask,
        reward=torch.randint(0, 2, (B,), generator=g).double(),
        advantage=torch.randn(B, generator=g, dtype=torch.float64),
        group_id=torch.arange(B) // 2,
    )


OPTIONS = [
    ("token_k1", "0.6_1.6"),
    ("token_k2", "0.1"),
    ("token_k3", "0.08"),
    ("seq_sum_k1", "0.3_3.0"),
    ("seq_mean_k2", "0.1"),
    ("seq_mean_k3", "0.1"),
    ("seq_max_k2", "0.4"),
    ("seq_max_k3", "0.3"),
    ("token_k1,seq_max_k2", "0.5_2.0,0.5"),
]


def filtered(b: lossplug.PolicyBatch, options: str, threshold: str) -> torch.Tensor:
    recipe = {
        "filters": [{"name": "mismatch_rejection", "options": options, "threshold": threshold}],
        "advantage": "grpo",
        "gates": ["ppo_clip"],
        "reduction": "token",
    }
    return lossplug.apply_rollout_stages(b, lossplug.compile_recipe(lossplug.Recipe.model_validate(recipe))).action_mask


@pytest.mark.parametrize(("options", "threshold"), OPTIONS)
def test_the_mask_is_verls_rejection_mask(options, threshold):
    b = batch()
    expected, _ = compute_rollout_rejection_mask(
        b.old_logp - b.behavior_logp, b.action_mask.double(), rollout_rs=options, rollout_rs_threshold=threshold
    )
    got = filtered(b, options, threshold)
    assert torch.equal(got, expected.bool()), (got.sum(), expected.sum())
    assert (~got & b.action_mask).any(), "the thresholds reject nothing: the test would prove nothing"


@pytest.mark.parametrize("options,threshold", [("token_k1", "0.6_1.6"), ("seq_mean_k3", "0.1")])
def test_under_token_mean_the_filtered_loss_is_verls_after_its_rejection(options, threshold):
    b = batch()
    mask = filtered(b, options, threshold)
    keep_rows = mask.any(-1)
    logp = b.logp.clone().requires_grad_(True)
    ours = lossplug.PolicyBatch(
        logp=logp[keep_rows],
        old_logp=b.old_logp[keep_rows],
        action_mask=mask[keep_rows],
        advantage=b.advantage[keep_rows],
    )
    normalizer = lossplug.Normalizer(action_tokens=int(mask.sum()), sequences=int(keep_rows.sum()))
    loss = lossplug.policy_loss(ours, {"gates": ["ppo_clip"], "reduction": "token"}, normalizer).loss
    verl_logp = b.logp.clone().requires_grad_(True)
    verl_mask, _ = compute_rollout_rejection_mask(
        b.old_logp - b.behavior_logp, b.action_mask.double(), rollout_rs=options, rollout_rs_threshold=threshold
    )
    pg_losses = -b.advantage.unsqueeze(-1) * torch.exp(verl_logp - b.old_logp)
    clipped = -b.advantage.unsqueeze(-1) * torch.clamp(torch.exp(verl_logp - b.old_logp), 0.8, 1.2)
    verl_loss = core_algos.agg_loss(torch.maximum(pg_losses, clipped), verl_mask, "token-mean")
    torch.testing.assert_close(loss, verl_loss, rtol=1e-12, atol=1e-14)
    loss.backward()
    verl_loss.backward()
    torch.testing.assert_close(logp.grad, verl_logp.grad, rtol=1e-12, atol=1e-14)
