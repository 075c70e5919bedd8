"""The entropy papers' plugins inside the trainers: ``entropy_advantage`` (Cheng et al., arXiv:2506.14758) in a real
TRL ``train()`` run of two CPU steps on the tiny model (TRL's forward pass gives the loss its entropies), checked
against the paper's shaped advantage on a micro-batch TRL built; and verl's policy-loss seam, which receives no
entropies, refusing it with the reason and the next step.

Only public import paths: ``lossplug.adapters.trl`` and ``lossplug.adapters.verl``.
"""

from __future__ import annotations

import pytest
import torch

from ._field_trainers import train_two_tiny_steps, verl_actor_config, verl_inputs, verl_policy_loss

ENTROPY_ADVANTAGE = {"preset": "grpo", "gates": ["ppo_clip", "entropy_advantage"], "reduction": "token"}


@pytest.mark.slow
def test_entropy_advantage_trains_inside_trls_grpo_trainer(tmp_path):
    trainer, _ = train_two_tiny_steps(ENTROPY_ADVANTAGE, tmp_path, rollout=False)
    capped = [e["lossplug/entropy_advantage/capped_frac"] for e in trainer.state.log_history if "lossplug/loss" in e]
    assert capped and all(0.0 <= v <= 1.0 for v in capped), capped


@pytest.mark.slow
def test_entropy_advantage_on_a_trl_micro_batch_is_the_papers_shaped_advantage(tmp_path):
    """One micro-batch as TRL's ``_compute_loss`` builds it (its own forward pass: log-probs and entropies), through
    the adapter, against TRL's clipped surrogate written out on ``A + min(α·H^detach, |A|/κ)``."""
    pytest.importorskip("trl")
    from lossplug.testing import tiny

    trainer = tiny.tiny_grpo_trainer(ENTROPY_ADVANTAGE, tmp_path / "out")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    loss = trainer.compute_loss(trainer.model, inputs)
    grads = torch.autograd.grad(loss, params, allow_unused=True)

    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, ids, attention, inputs["completion_ids"].size(1), compute_entropy=True
    )
    mask = inputs["completion_mask"].bool()
    if "tool_mask" in inputs:
        mask = mask & inputs["tool_mask"].bool()
    old = inputs.get("old_per_token_logps")
    old = logps.detach() if old is None else old
    adv = inputs["advantages"][:, None]
    shaped = adv + torch.min(0.4 * entropies.detach(), adv.abs() / 2.0)
    ratio = torch.exp(logps - old)
    surrogate = torch.min(ratio * shaped, torch.clamp(ratio, 0.8, 1.2) * shaped)
    # the token reduction over the step's action tokens (TRL's num_items_in_batch), one micro-batch of one step
    expected = -(surrogate * mask).sum() / mask.sum()
    expected_grads = torch.autograd.grad(expected, params, allow_unused=True)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    # the shaping is visible: the plain surrogate on A differs (some advantages are nonzero, the bonus is not 0)
    plain = -(torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv) * mask).sum() / mask.sum()
    assert bool((adv != 0).any()) and abs(float(plain - expected)) > 1e-4, (float(plain), float(expected))
    for got, want in zip(grads, expected_grads):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_verls_policy_loss_seam_refuses_entropy_advantage_naming_the_entropies():
    pytest.importorskip("verl")
    from lossplug.contracts import LossplugError

    x = verl_inputs(seed=3)
    mb = {k: v for k, v in x.items() if k != "lengths"}
    config = verl_actor_config({"gates": ["ppo_clip", "entropy_advantage"], "reduction": "token"}, 8)
    with pytest.raises(LossplugError) as err:
        verl_policy_loss(config, mb)
    message = str(err.value)
    for words in ("entropy_advantage", "entropy", "no entropies", "Next step: run it in TRL"):
        assert words in message, message
