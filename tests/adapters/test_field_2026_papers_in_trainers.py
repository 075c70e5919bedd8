"""This year's papers (issue 31) inside the trainers: CFPO (``cfpo``, arXiv:2601.22801) and UP-GRPO (``up_grpo``,
Liu 2026, a preprint post) each in a real TRL ``train()`` run of two CPU steps on the tiny model, and through verl's
policy-loss seam (``get_policy_loss_fn("lossplug")``) split over 2 ranks × micro-batches against the published
code (CFPO's verl port, UP-GRPO's ``compute_policy_loss``) written out over the whole step (float64, loss and
gradient). TPO (``tpo``, arXiv:2604.06159): two TRL steps with whole prompt groups per micro-batch and TRL's loud
refusal when it splits a group; verl's ``ppo_loss`` hands a policy loss no prompt ids, so verl's seam refuses it
naming ``group_id``.

Only public import paths: ``lossplug.adapters.trl`` and ``lossplug.adapters.verl``.
"""

from __future__ import annotations

import pytest
import torch

from ._field_trainers import (
    assert_trl_refuses_split_groups,
    assert_verl_policy_loss_refuses_for_want_of_prompt_ids,
    train_two_tiny_steps,
    verl_inputs,
    verl_seam_over_step,
)


@pytest.mark.slow
def test_cfpo_trains_inside_trls_grpo_trainer(tmp_path):
    recipe = {"preset": "grpo", "gates": [{"name": "cfpo", "eps": 0.2}], "reduction": "token"}
    trainer, _ = train_two_tiny_steps(recipe, tmp_path, rollout=False)
    keys = {k for entry in trainer.state.log_history for k in entry if k.startswith("lossplug/")}
    assert {"lossplug/cfpo/past_peak_frac_high", "lossplug/cfpo/past_peak_frac_low"} <= keys, sorted(keys)


@pytest.mark.parametrize("eps", [0.2, 0.1])
def test_cfpo_through_verls_seam_is_the_ports_formula_over_the_step(eps):
    pytest.importorskip("verl")
    x = verl_inputs(seed=11, update_noise=0.3, rollout_noise=None)
    mask = x["response_mask"]
    total, grad, metrics = verl_seam_over_step({"gates": [{"name": "cfpo", "eps": eps}], "reduction": "token"}, x)
    assert all("actor/lossplug/cfpo/past_peak_frac_high" in m for m in metrics), sorted(metrics[0])
    # the port (asparius/verl@18bd5cd compute_policy_loss_cfpo) with verl's token-mean over the whole step
    logp = torch.where(mask, x["log_prob"], -1.0).requires_grad_()
    old, adv = (torch.where(mask, x[k], -1.0) for k in ("old_log_prob", "advantages"))
    ratio = (logp - old).clamp(-20.0, 20.0).exp()
    past = ((ratio > 1 + eps) & (adv > 0)) | ((ratio < 1 - eps) & (adv < 0))
    assert 0 < int((past & mask).sum()) < int(mask.sum())  # some tokens are past the peak, not all
    pg_losses = -(adv * ratio - adv.abs() * (ratio - 1).pow(2) / (2 * eps))
    expected = torch.where(mask, pg_losses, 0).sum() / mask.sum()
    expected.backward()
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.where(mask, grad, 0), torch.where(mask, logp.grad, 0), rtol=1e-12, atol=1e-14)


@pytest.mark.slow
def test_up_grpo_trains_inside_trls_grpo_trainer(tmp_path):
    recipe = {"preset": "grpo", "gates": ["up_grpo"], "reduction": "token"}
    trainer, _ = train_two_tiny_steps(recipe, tmp_path, rollout=False)
    keys = {k for entry in trainer.state.log_history for k in entry if k.startswith("lossplug/")}
    assert {"lossplug/up_grpo/positive_frac", "lossplug/up_grpo/clip_frac_dual"} <= keys, sorted(keys)


@pytest.mark.parametrize("gate", [{}, {"eps_high": 0.28, "dual_clip_c": 1.5}], ids=["defaults", "dapo-clip-c1.5"])
def test_up_grpo_through_verls_seam_is_the_posts_code_over_the_step(gate):
    pytest.importorskip("verl")
    x = verl_inputs(seed=3, update_noise=1.0, rollout_noise=None)
    mask = x["response_mask"]
    total, grad, metrics = verl_seam_over_step({"gates": [{"name": "up_grpo", **gate}], "reduction": "token"}, x)
    assert all("actor/lossplug/up_grpo/positive_frac" in m for m in metrics), sorted(metrics[0])
    # the post's compute_policy_loss (rocfly88.github.io@36e2942) with verl's token-mean over the whole step
    eps_high, c = gate.get("eps_high", 0.2), gate.get("dual_clip_c", 3.0)
    logp = torch.where(mask, x["log_prob"], -1.0).requires_grad_()
    old, adv = (torch.where(mask, x[k], -1.0) for k in ("old_log_prob", "advantages"))
    ratio = torch.exp(logp - old)
    pos = -adv * logp
    neg1, neg2 = -adv * ratio, -adv * torch.clamp(ratio, 0.8, 1 + eps_high)
    clipped = torch.maximum(neg1, neg2)
    neg = torch.where(adv < 0, torch.min(-adv * c, clipped), clipped)
    pg_losses = torch.where(adv > 0, pos, neg)
    dual = (adv < 0) & (-adv * c < clipped) & mask
    assert 0 < int(dual.sum()) and 0 < int(((adv < 0) & (ratio < 0.8) & mask).sum())  # every branch acts
    expected = torch.where(mask, pg_losses, 0).sum() / mask.sum()
    expected.backward()
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.where(mask, grad, 0), torch.where(mask, logp.grad, 0), rtol=1e-12, atol=1e-14)


# -- TPO ----------------------------------------------------------------------------------------------------------------

TPO = {
    # the paper's standardisation (Appendix A): population z-score within the group, zero variance → 0
    "advantage": {"name": "grpo", "std": "population", "eps": 1e-6, "eps_mode": "threshold"},
    "gates": [{"name": "tpo", "group_size": 4}],
    "reduction": "response",
}


@pytest.mark.slow
def test_tpo_trains_inside_trls_grpo_trainer(tmp_path):
    # tiny_grpo_config: 4 completions per prompt, micro-batches of 4, one micro-batch per generation: whole groups
    trainer, _ = train_two_tiny_steps(TPO, tmp_path, rollout=False)
    losses = [e["lossplug/loss"] for e in trainer.state.log_history if "lossplug/loss" in e]
    assert all(v >= -1e-6 for v in losses)  # a cross-entropy between distributions over the group


@pytest.mark.slow
def test_tpo_refuses_a_group_that_trl_splits_over_micro_batches(tmp_path):
    assert_trl_refuses_split_groups(TPO, "tpo", tmp_path)


def test_tpo_under_verls_policy_loss_is_refused_naming_the_prompt_ids():
    assert_verl_policy_loss_refuses_for_want_of_prompt_ids(TPO, "tpo")
