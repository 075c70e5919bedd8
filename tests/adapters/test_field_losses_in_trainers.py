"""The losses ported from SkyRL, NeMo-RL, OpenRLHF and prime-rl inside the trainers: real TRL ``train()`` runs of a
few CPU steps on the tiny model (one per family; the tiny rollout engine supplies ``behavior_logp``), and verl's
policy-loss seam (``get_policy_loss_fn("lossplug")``, called as a trainer that passes ``rollout_log_probs`` does)
split over 2 ranks × micro-batches against each loss's formula over the whole step (float64, loss and gradient).
``prompt_mean`` needs the prompt groups, which verl's seam does not receive: refused there by name.

Only public import paths: ``lossplug.adapters.trl`` and ``lossplug.adapters.verl``.
"""

from __future__ import annotations

import pytest
import torch

import lossplug

from ._field_trainers import MICRO, verl_actor_config, verl_inputs, verl_policy_loss, verl_seam_over_step

# -- TRL ---------------------------------------------------------------------------------------------------------------

#: family → (recipe, the gate's metrics that must reach TRL's log)
TRL_CASES = {
    "skyrl": (
        {"preset": "grpo", "gates": ["importance_sampling"], "reduction": "token"},
        {"lossplug/importance_sampling/clamp_frac"},
    ),
    "nemo_rl": ({"preset": "grpo", "gates": ["force_on_policy"], "reduction": "token"}, set()),
    "openrlhf": (
        {
            "preset": "grpo",
            # the tiny rollout engine's log-probs are far from the model's (engine KL ≈ 2.5 nats): wide bounds keep some
            "gates": ["ppo_clip", {"name": "seq_mask_tis", "low": 0.01, "high": 100.0}],
            "reduction": "token",
        },
        {"lossplug/seq_mask_tis/mask_frac", "lossplug/seq_mask_tis/mask_token_frac"},
    ),
    "skyrl_dppo_binary_kl": (
        {
            "preset": "grpo",
            "gates": [{"name": "dppo_binary_kl", "eps_low": 0.05, "eps_high": 0.05}],
            "reduction": "token",
        },
        {"lossplug/dppo_binary_kl/mask_frac"},
    ),
    "prime_rl": (
        {"preset": "grpo", "gates": ["dppo_binary_tv"], "reduction": "token"},
        {"lossplug/dppo_binary_tv/mask_frac"},
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(TRL_CASES))
def test_trains_inside_trls_grpo_trainer(family, tmp_path):
    pytest.importorskip("trl")
    from lossplug.adapters.trl import LossplugGRPOTrainer
    from lossplug.testing import tiny

    recipe, gate_metrics = TRL_CASES[family]
    tok = tiny.tiny_tokenizer()
    trainer = LossplugGRPOTrainer(
        model=tiny.tiny_model(tok),
        reward_funcs=[tiny.length_reward],
        args=tiny.tiny_grpo_config(tmp_path / "out", max_steps=2),
        train_dataset=tiny.tiny_dataset(),
        processing_class=tok,
        recipe=recipe,
        rollout_func=tiny.TinyRollout(tok),  # the engine's log-probs: behavior_logp
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 2
    keys = {k for entry in trainer.state.log_history for k in entry if k.startswith("lossplug/")}
    assert {"lossplug/loss", *gate_metrics} <= keys, sorted(keys)
    losses = [e["lossplug/loss"] for e in trainer.state.log_history if "lossplug/loss" in e]
    assert losses and all(torch.isfinite(torch.tensor(v)) for v in losses)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert lossplug.Recipe.from_file(tmp_path / "out" / "recipe.yaml").gates == lossplug.Recipe.load(recipe).gates


# -- verl --------------------------------------------------------------------------------------------------------------


def per_token_loss(gate: dict, logp, old, rollout, adv, mask):
    """Each loss as its origin writes it, per token (to minimise), independently of lossplug."""
    name = gate["name"]
    r = (logp - rollout).exp()
    if name == "importance_sampling":  # SkyRL / Tinker
        return -(r * adv)
    if name == "rollout_is":  # SkyRL: zero outside (1 − eps_low, 1 + eps_high), detached
        return -(torch.where((r > 0.8) & (r < 1.2), r, torch.zeros_like(r)).detach() * adv * logp)
    if name == "cispo_rollout":  # SkyRL's cispo defaults: clamp(r, 1 − 0, 1 + 5)
        return -(r.clamp(1.0, 6.0).detach() * adv * logp)
    if name == "force_on_policy":  # NeMo-RL
        return -(adv * (logp - logp.detach()).exp())
    if name in ("dppo_binary_tv", "ipo"):  # prime-rl, adv_tau 1, kl_tau 1e-3
        diff = logp.exp() - rollout.exp()
        if name == "ipo":
            masked = diff.abs() > 0.1
        else:
            masked = torch.where(adv > 0, diff > 0.2, diff < -0.2)
        return -(~masked * adv * r) + 1e-3 * (logp - rollout) ** 2
    if name == "dppo_binary_kl":  # SkyRL's binary_kl at the rollout log-probs, delta 0.05 / 0.1, no KL term
        p, mu = logp.detach().exp(), rollout.exp()
        binary_kl = mu * (rollout - logp.detach()) + (1 - mu) * torch.log((1 - mu + 1e-8) / (1 - p + 1e-8))
        masked = ((adv > 0) & (p > mu) & (binary_kl > 0.1)) | ((adv < 0) & (p < mu) & (binary_kl > 0.05))
        return -(~masked * adv * r)
    if name == "seq_mask_tis":  # OpenRLHF: after PPO's clip (0.2), bounds 0.5 and 5
        ratio = (logp - old).exp()
        ppo = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        engine = old - rollout
        geometric = ((engine * mask).sum(-1) / mask.sum(-1)).exp()
        kept = (geometric >= 0.5) & (geometric <= 5.0)
        return kept[:, None] * engine.exp() * ppo
    raise AssertionError(name)


VERL_GATES = [
    [{"name": "importance_sampling"}],
    [{"name": "rollout_is"}],
    [{"name": "cispo_rollout"}],
    [{"name": "force_on_policy"}],
    [{"name": "dppo_binary_tv"}],
    [{"name": "ipo"}],
    [{"name": "dppo_binary_kl", "eps_low": 0.05, "eps_high": 0.1}],
    [{"name": "ppo_clip"}, {"name": "seq_mask_tis", "low": 0.5, "high": 5.0}],
]


@pytest.mark.parametrize("gates", VERL_GATES, ids=lambda g: "+".join(s["name"] for s in g))
def test_verls_policy_loss_seam_gives_each_formula_over_the_step(gates):
    pytest.importorskip("verl")
    x = verl_inputs(seed=len(gates[-1]["name"]))
    mask = x["response_mask"]
    total, grad, metrics = verl_seam_over_step({"gates": gates, "reduction": "token"}, x)
    assert all(isinstance(v, float) for m in metrics for k, v in m.items() if k.startswith("actor/lossplug/"))
    # the formula over the whole step: a token mean over every action token of every rank
    logp = torch.where(mask, x["log_prob"], -1.0).requires_grad_()
    clean = {
        k: torch.where(mask, x[k], -1.0 if "log" in k else 0.0)
        for k in ("old_log_prob", "rollout_log_probs", "advantages")
    }
    gate = gates[-1]
    per_token = per_token_loss(gate, logp, clean["old_log_prob"], clean["rollout_log_probs"], clean["advantages"], mask)
    expected = torch.where(mask, per_token, 0).sum() / mask.sum()
    expected.backward()
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.where(mask, grad, 0), torch.where(mask, logp.grad, 0), rtol=1e-12, atol=1e-14)


def test_prompt_mean_is_refused_by_name_where_the_seam_has_no_prompt_groups():
    # verl hands a policy loss no uid: a reduction over prompts cannot run there, and says which field it lacks
    pytest.importorskip("verl")
    x = verl_inputs(seed=0)
    config = verl_actor_config({"gates": ["importance_sampling"], "reduction": "prompt_mean"}, MICRO)
    with pytest.raises(lossplug.LossplugError, match=r"recipe.reduction \(prompt_mean\) reads group_id: .*Next step"):
        verl_policy_loss(config, x)
