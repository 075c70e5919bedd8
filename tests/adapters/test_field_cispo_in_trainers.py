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

from ._field_trainers import train_two_tiny_steps, verl_inputs, verl_seam_over_step

SKYRL_CISPO = {"name": "cispo", "eps_low": 0.0, "eps_high": 5.0}


@pytest.mark.slow
def test_trains_inside_trls_grpo_trainer(tmp_path):
    recipe = {"preset": "grpo", "gates": [SKYRL_CISPO], "reduction": "token"}
    trainer, _ = train_two_tiny_steps(recipe, tmp_path, rollout=False)
    history = trainer.state.log_history
    low = [e["lossplug/cispo/clip_frac_low"] for e in history if "lossplug/cispo/clip_frac_low" in e]
    # the second step re-uses the batch after an update: some ratios fall below 1 and are raised to it
    assert low and max(low) > 0, history


# -- verl --------------------------------------------------------------------------------------------------------------


def skyrl_cispo_per_token(logp, old, adv, eps_low: float, eps_high: float):
    """SkyRL 0.3.0 ``compute_policy_loss_cispo`` per token (to minimise): −sg(clamp(r, 1 − ε_low, 1 + ε_high))·A·logp,
    ``r = exp(clamp(logp − old, ±20))``."""
    r = (logp - old).clamp(-20, 20).exp()
    return -(r.clamp(1 - eps_low, 1 + eps_high).detach() * adv * logp)


@pytest.mark.parametrize("eps_low,eps_high", [(0.0, 5.0), (0.0, 0.2)])
def test_verls_policy_loss_seam_gives_skyrls_cispo_over_the_step(eps_low, eps_high):
    pytest.importorskip("verl")
    x = verl_inputs(seed=7, update_noise=0.6, rollout_noise=None)
    mask = x["response_mask"]
    gate = {"name": "cispo", "eps_low": eps_low, "eps_high": eps_high}
    total, grad, metrics = verl_seam_over_step({"gates": [gate], "reduction": "token"}, x)
    low_fractions = [m["actor/lossplug/cispo/clip_frac_low"] for m in metrics]
    assert max(low_fractions) > 0  # the lower bound of exactly 1 binds on these ratios
    logp = torch.where(mask, x["log_prob"], -1.0).requires_grad_()
    old = torch.where(mask, x["old_log_prob"], -1.0)
    adv = torch.where(mask, x["advantages"], 0.0)
    per_token = skyrl_cispo_per_token(logp, old, adv, eps_low, eps_high)
    expected = torch.where(mask, per_token, 0).sum() / mask.sum()  # token_mean over every action token of the step
    expected.backward()
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.where(mask, grad, 0), torch.where(mask, logp.grad, 0), rtol=1e-12, atol=1e-14)
