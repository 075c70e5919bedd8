"""OpenRLHF's ``no_std_norm`` (``whiten: center``) and ``kl.unbiased_gradient`` (``kl`` with ``gradient: unbiased``)
inside the trainers: a real TRL ``train()`` run of two CPU steps on the tiny model (the second off-policy, so the KL's
weight ``π_θ/π_old`` moves off 1), and verl — its advantage seam (``lossplug.adapters.verl.compute_advantage`` on
a ``DataProto``, on the driver: the whole batch) and its policy-loss seam split over 2 ranks × micro-batches, whose
loss and gradient over the step equal OpenRLHF's PPO loss on the centred advantages (float64). verl's ``ppo_loss``
adds its own KL terms only, so a recipe KL with ``gradient: unbiased`` is refused there, with the reason.

Only public import paths: ``lossplug.adapters.trl`` and ``lossplug.adapters.verl``. The oracles against OpenRLHF's
own code are ``tests/plugins/advantages/test_whiten_center.py`` and
``tests/plugins/regularizers/test_kl_unbiased_gradient.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from lossplug import LossplugError, Recipe

from ._field_trainers import MICRO, verl_inputs, verl_policy_loss, verl_seam_over_step

F64 = torch.float64
KL = {"name": "kl", "coef": 0.02, "estimator": "k3", "gradient": "unbiased"}


@pytest.mark.slow
def test_center_and_the_unbiased_kl_gradient_train_inside_trls_grpo_trainer(tmp_path):
    pytest.importorskip("trl")
    from lossplug.testing import tiny

    recipe = {
        # TRL's advantage seam holds one position per completion, gathered over all processes: the score minus the
        # batch mean (reinforce_plus_plus_baseline's group-centred scores already have mean 0 there)
        "advantage": {"name": "reinforce_plus_plus", "whiten": "center"},
        "gates": [{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2}],
        "reduction": "token",
        "regularizers": [KL],
    }
    model, tok = tiny.tiny_model_and_tokenizer(tmp_path / "model")  # beta != 0: TRL reloads the reference from disk
    trainer = tiny.tiny_grpo_trainer(recipe, tmp_path / "out", model=model, tokenizer=tok, beta=KL["coef"])
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 2
    history = trainer.state.log_history
    losses = [e["lossplug/loss"] for e in history if "lossplug/loss" in e]
    assert losses and all(math.isfinite(v) for v in losses)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    kl = [e["lossplug/reg/kl/token_mean"] for e in history if "lossplug/reg/kl/token_mean" in e]
    assert kl and all(math.isfinite(v) and v >= 0 for v in kl), sorted(k for e in history for k in e)
    means = [e["lossplug/advantage/mean"] for e in history if "lossplug/advantage/mean" in e]
    stds = [e["lossplug/advantage/std"] for e in history if "lossplug/advantage/std" in e]
    assert means and all(abs(m) <= 1e-6 for m in means) and all(s > 0 for s in stds), (means, stds)
    assert Recipe.from_file(tmp_path / "out" / "recipe.yaml").to_dict() == Recipe.load(recipe).to_dict()


# -- verl --------------------------------------------------------------------------------------------------------------


def outcome_proto(seed: int = 0, prompts: int = 4, n: int = 3, T: int = 6):
    """verl's batch for an outcome estimator: right-padded responses, the score on each last token, uid groups."""
    np = pytest.importorskip("numpy")
    from verl import DataProto

    g = torch.Generator().manual_seed(seed)
    B = prompts * n
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    score = 2 * torch.rand(B, generator=g, dtype=F64) - 0.5
    rewards = torch.zeros(B, T, dtype=F64)
    rewards[torch.arange(B), lengths - 1] = score
    group = torch.arange(B) // n
    tensors = {
        "token_level_rewards": rewards,
        "response_mask": mask.long(),
        "old_log_probs": -torch.rand(B, T, dtype=F64),
    }
    uid = np.array([f"prompt-{int(k)}" for k in group], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid}), score, group, mask


def openrlhf_reinforce_baseline_no_std_norm(score, group, mask):
    """OpenRLHF's ``reinforce_baseline`` with ``no_std_norm``, written out: the group mean off each score, the
    return-to-go of that (γ = 1: the same on every action token), minus its mean over every action token."""
    advantage = torch.zeros(mask.shape, dtype=F64)
    for b in range(len(score)):
        centred = score[b] - score[group == group[b]].mean()
        for t in range(mask.shape[1]):
            advantage[b, t] = centred if mask[b, t] else 0.0
    return torch.where(mask, advantage - advantage[mask].mean(), 0.0)


def test_center_through_the_verl_adapters_compute_advantage():
    pytest.importorskip("verl")
    from lossplug.adapters.verl import compute_advantage

    data, score, group, mask = outcome_proto()
    recipe = {
        "advantage": {"name": "reinforce_plus_plus_baseline", "whiten": "center"},
        "gates": ["ppo_clip"],
        "reduction": "token",
    }
    out = compute_advantage(data, recipe)
    expected = openrlhf_reinforce_baseline_no_std_norm(score, group, mask)
    assert float((out.batch["advantages"].to(F64) - expected).abs().max()) <= 1e-12
    assert abs(float(out.batch["advantages"][mask].sum())) <= 1e-12  # centred over the whole batch's action tokens


def test_verls_policy_loss_seam_over_centred_advantages_is_openrlhfs_ppo_loss_over_the_step():
    """The advantages centred over the step's action tokens (as verl's driver hands them to the actor), then
    ppo_clip through verl's seam at 2 ranks: OpenRLHF's ``PolicyLoss`` (ε 0.2, token mean over the step)."""
    pytest.importorskip("verl")
    x = verl_inputs(seed=3, update_noise=0.2, rollout_noise=None)
    mask = x["response_mask"]
    x["advantages"] = torch.where(mask, x["advantages"] - x["advantages"][mask].mean(), x["advantages"])
    recipe = {"gates": [{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2}], "reduction": "token"}
    total, grad, _ = verl_seam_over_step(recipe, x)
    logp = torch.where(mask, x["log_prob"], -1.0).requires_grad_()
    old, adv = (torch.where(mask, x[k], -1.0) for k in ("old_log_prob", "advantages"))
    ratio = (logp - old).clamp(-20, 20).exp()
    per_token = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    expected = torch.where(mask, per_token, 0).sum() / mask.sum()
    expected.backward()
    assert abs(float(total) - float(expected.detach())) <= 1e-12
    assert float((torch.where(mask, grad, 0) - torch.where(mask, logp.grad, 0)).abs().max()) <= 1e-12


def test_the_unbiased_kl_gradient_under_verls_policy_loss_is_refused_with_the_reason():
    """verl's ``ppo_loss`` adds its KL itself (``use_kl_loss``, ``kl_loss_type``) and hands the policy loss no
    reference log-probs: a KL with OpenRLHF's gradient is no verl setting, so the recipe is refused, saying so."""
    pytest.importorskip("verl")
    recipe = {"gates": ["ppo_clip"], "reduction": "token", "regularizers": [KL]}
    from verl.workers.config import ActorConfig

    from lossplug.adapters.verl import LossplugPolicyLossConfig

    config = ActorConfig(
        strategy="fsdp",
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=MICRO,
        loss_agg_mode="token-mean",
        use_kl_loss=True,  # verl's own k3 KL at the recipe's coefficient: the closest verl setting
        kl_loss_type="k3",
        kl_loss_coef=KL["coef"],
        policy_loss=LossplugPolicyLossConfig(loss_mode="lossplug", recipe=recipe),
    )
    x = verl_inputs(seed=1)
    batch = {k: v[:MICRO] for k, v in x.items() if k != "lengths"}
    with pytest.raises(LossplugError, match="No verl setting adds these terms"):
        verl_policy_loss(config, batch, batch["log_prob"].clone().requires_grad_())
