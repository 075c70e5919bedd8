"""SkyRL's ``policy_loss_type: cispo`` with its defaults (``cispo_eps_clip_low: 0.0``, ``cispo_eps_clip_high: 5.0``):
``{name: cispo, eps_low: 0.0, eps_high: 5.0}``, a weight never below 1, inside the trainers. A real TRL ``train()``
run of two CPU steps on the tiny model (off-policy: the second step's ratios move, so the lower bound of 1 binds),
and verl's policy-loss seam (``get_policy_loss_fn("lossplug")``) split over 2 ranks × micro-batches against SkyRL's
formula over the whole step (float64, loss and gradient).

Only public import paths: ``lossplug.adapters.trl`` and ``lossplug.adapters.verl``.
"""

from __future__ import annotations

import pytest
import torch

import lossplug

from ._field_trainers import verl_actor_config, verl_policy_loss

SKYRL_CISPO = {"name": "cispo", "eps_low": 0.0, "eps_high": 5.0}


@pytest.mark.slow
def test_trains_inside_trls_grpo_trainer(tmp_path):
    pytest.importorskip("trl")
    from lossplug.adapters.trl import LossplugGRPOTrainer
    from lossplug.testing import tiny

    recipe = {"preset": "grpo", "gates": [SKYRL_CISPO], "reduction": "token"}
    tok = tiny.tiny_tokenizer()
    trainer = LossplugGRPOTrainer(
        model=tiny.tiny_model(tok),
        reward_funcs=[tiny.length_reward],
        args=tiny.tiny_grpo_config(tmp_path / "out", max_steps=2),
        train_dataset=tiny.tiny_dataset(),
        processing_class=tok,
        recipe=recipe,
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 2
    history = trainer.state.log_history
    low = [e["lossplug/cispo/clip_frac_low"] for e in history if "lossplug/cispo/clip_frac_low" in e]
    # the second step re-uses the batch after an update: some ratios fall below 1 and are raised to it
    assert low and max(low) > 0, history
    losses = [e["lossplug/loss"] for e in history if "lossplug/loss" in e]
    assert losses and all(torch.isfinite(torch.tensor(v)) for v in losses)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert lossplug.Recipe.from_file(tmp_path / "out" / "recipe.yaml").gates == lossplug.Recipe.load(recipe).gates


# -- verl --------------------------------------------------------------------------------------------------------------

B, T, DP, MICRO = 8, 12, 2, 2


def verl_inputs(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    mask[:, 1:] &= torch.rand(B, T - 1, generator=g) > 0.15  # observation tokens inside the response
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    logp = (old + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    garbage = 50 * torch.rand(B, T, generator=g, dtype=torch.float64)  # whatever verl holds off the mask
    return {
        "old_log_prob": torch.where(mask, old, -garbage),
        "log_prob": torch.where(mask, logp, garbage),
        "rollout_log_probs": torch.where(mask, old, -garbage),
        "advantages": torch.where(mask, adv, garbage),
        "response_mask": mask,
        "lengths": lengths,
    }


def skyrl_cispo_per_token(logp, old, adv, eps_low: float, eps_high: float):
    """SkyRL 0.3.0 ``compute_policy_loss_cispo`` per token (to minimise): −sg(clamp(r, 1 − ε_low, 1 + ε_high))·A·logp,
    ``r = exp(clamp(logp − old, ±20))``."""
    r = (logp - old).clamp(-20, 20).exp()
    return -(r.clamp(1 - eps_low, 1 + eps_high).detach() * adv * logp)


@pytest.mark.parametrize("eps_low,eps_high", [(0.0, 5.0), (0.0, 0.2)])
def test_verls_policy_loss_seam_gives_skyrls_cispo_over_the_step(eps_low, eps_high):
    pytest.importorskip("verl")
    x = verl_inputs(seed=7)
    mask = x["response_mask"]
    gate = {"name": "cispo", "eps_low": eps_low, "eps_high": eps_high}
    config = verl_actor_config({"gates": [gate], "reduction": "token"}, MICRO)
    config.global_batch_info.update(
        {"dp_size": DP, "batch_num_tokens": int(mask.sum()), "global_batch_size": B, "loss_scale_factor": None}
    )
    total, grad = torch.zeros((), dtype=torch.float64), torch.zeros_like(x["log_prob"])
    low_fractions = []
    for start in range(0, B, MICRO):  # dp_size ranks × micro-batches, each padded to its own longest response
        rows, width = slice(start, start + MICRO), int(x["lengths"][start : start + MICRO].max())
        mb = {k: v[rows, :width] for k, v in x.items() if k != "lengths"}
        log_prob = mb["log_prob"].clone().requires_grad_()
        loss, metrics = verl_policy_loss(config, mb, log_prob)
        loss.backward()
        total = total + loss.detach() / DP  # verl multiplies each share by dp_size and averages the ranks' gradients
        grad[rows, :width] = log_prob.grad / DP
        low_fractions.append(metrics["actor/lossplug/cispo/clip_frac_low"])
    assert max(low_fractions) > 0  # the lower bound of exactly 1 binds on these ratios
    logp = torch.where(mask, x["log_prob"], -1.0).requires_grad_()
    old = torch.where(mask, x["old_log_prob"], -1.0)
    adv = torch.where(mask, x["advantages"], 0.0)
    per_token = skyrl_cispo_per_token(logp, old, adv, eps_low, eps_high)
    expected = torch.where(mask, per_token, 0).sum() / mask.sum()  # token_mean over every action token of the step
    expected.backward()
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.where(mask, grad, 0), torch.where(mask, logp.grad, 0), rtol=1e-12, atol=1e-14)
