"""AReaL's rejection sampling (``divergence_rejection``: k3 and k1-max among its metrics) inside the trainers: a
real TRL ``train()`` run of two CPU steps on the tiny model (the tiny rollout engine supplies ``behavior_logp``), and
verl's policy-loss seam (``get_policy_loss_fn("lossplug")``, called as a trainer that passes ``rollout_log_probs``
does) split over 2 ranks × micro-batches against AReaL's formula over the whole step (float64, loss and gradient).

Only public import paths: ``lossplug.adapters.trl`` and ``lossplug.adapters.verl``.
"""

from __future__ import annotations

import pytest
import torch

import lossplug

from ._field_trainers import verl_actor_config, verl_policy_loss


@pytest.mark.slow
def test_trains_inside_trls_grpo_trainer(tmp_path):
    pytest.importorskip("trl")
    from lossplug.adapters.trl import LossplugGRPOTrainer
    from lossplug.testing import tiny

    # the tiny rollout engine's log-probs are far from the model's (engine KL ≈ 2.5 nats): a wide bound keeps some
    recipe = {
        "preset": "grpo",
        "gates": ["ppo_clip", {"name": "divergence_rejection", "metric": "kl_k3", "upper": 20.0}],
        "reduction": "token",
    }
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
    assert {"lossplug/loss", "lossplug/divergence_rejection/rejected_frac"} <= keys, sorted(keys)
    losses = [e["lossplug/loss"] for e in trainer.state.log_history if "lossplug/loss" in e]
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
    logp = (old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    rollout = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    garbage = 50 * torch.rand(B, T, generator=g, dtype=torch.float64)  # whatever verl holds off the mask
    return {
        "old_log_prob": torch.where(mask, old, -garbage),
        "log_prob": torch.where(mask, logp, garbage),
        "rollout_log_probs": torch.where(mask, rollout, -garbage),
        "advantages": torch.where(mask, adv, garbage),
        "response_mask": mask,
        "lengths": lengths,
    }


def areal_weight(gate: dict, old, rollout, mask):
    """AReaL's ``behave_imp_weight`` for a KL metric, written out (independently of lossplug)."""
    log_ratio = old - rollout
    metric = {
        "kl_k1": log_ratio,
        "kl_k2": 0.5 * log_ratio**2,
        "kl_k3": (-log_ratio).exp() - 1 + log_ratio,
    }[gate["metric"]]
    upper, lower = gate["upper"], gate.get("lower")
    if gate.get("level", "token") == "sequence":
        agg = gate["agg"]
        if agg == "max":
            metric = metric.masked_fill(~mask, float("-inf")).amax(-1, keepdim=True)
        else:
            metric = torch.where(mask, metric, 0).sum(-1, keepdim=True)
            metric = metric / mask.sum(-1, keepdim=True) if agg == "mean" else metric
    inside = (metric <= upper) & (metric >= (lower if lower is not None else float("-inf")))
    inside = inside.expand_as(mask)
    ratio = log_ratio.exp()
    if gate.get("action", "mask") == "clamp":
        return torch.where(inside, ratio, ratio.clamp(lower or 0.0, upper))
    return torch.where(inside, ratio, 0.0)


VERL_GATES = [
    {"name": "divergence_rejection", "metric": "kl_k3", "upper": 0.05},
    {"name": "divergence_rejection", "metric": "kl_k1", "level": "sequence", "agg": "max", "upper": 0.3},
    {"name": "divergence_rejection", "metric": "kl_k3", "level": "sequence", "agg": "sum", "upper": 0.3, "lower": 0.02},
    {
        "name": "divergence_rejection",
        "metric": "kl_k3",
        "level": "sequence",
        "agg": "mean",
        "action": "clamp",
        "upper": 1.5,
        "lower": 0.04,
    },
]


@pytest.mark.parametrize("gate", VERL_GATES, ids=lambda g: "-".join(str(v) for k, v in g.items() if k != "name"))
def test_verls_policy_loss_seam_gives_areal_formula_over_the_step(gate):
    pytest.importorskip("verl")
    x = verl_inputs(seed=7)
    mask = x["response_mask"]
    config = verl_actor_config({"gates": ["ppo_clip", gate], "reduction": "token"}, MICRO)
    config.global_batch_info.update(
        {"dp_size": DP, "batch_num_tokens": int(mask.sum()), "global_batch_size": B, "loss_scale_factor": None}
    )
    total, grad = torch.zeros((), dtype=torch.float64), torch.zeros_like(x["log_prob"])
    for start in range(0, B, MICRO):  # dp_size ranks × micro-batches, each padded to its own longest response
        rows, width = slice(start, start + MICRO), int(x["lengths"][start : start + MICRO].max())
        mb = {k: v[rows, :width] for k, v in x.items() if k != "lengths"}
        log_prob = mb["log_prob"].clone().requires_grad_()
        loss, metrics = verl_policy_loss(config, mb, log_prob)
        loss.backward()
        total = total + loss.detach() / DP  # verl multiplies each share by dp_size and averages the ranks' gradients
        grad[rows, :width] = log_prob.grad / DP
        assert "actor/lossplug/divergence_rejection/rejected_frac" in metrics, sorted(metrics)
    # AReaL's ppo_actor_loss_fn over the whole step: clipped surrogate × weight, ÷ the action tokens before rejection
    logp = torch.where(mask, x["log_prob"], -1.0).requires_grad_()
    old, rollout, adv = (torch.where(mask, x[k], -1.0) for k in ("old_log_prob", "rollout_log_probs", "advantages"))
    ratio = (logp - old).exp()
    weight = areal_weight(gate, old, rollout, mask)
    assert 0 < int((mask & (weight != (old - rollout).exp())).sum()) < int(mask.sum())  # the bounds act, not on all
    per_token = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * weight
    expected = torch.where(mask, per_token, 0).sum() / mask.sum()
    expected.backward()
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.where(mask, grad, 0), torch.where(mask, logp.grad, 0), rtol=1e-12, atol=1e-14)
