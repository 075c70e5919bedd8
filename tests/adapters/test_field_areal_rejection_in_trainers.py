"""AReaL's rejection sampling (``divergence_rejection``: k3 and k1-max among its metrics) inside the trainers: a
real TRL ``train()`` run of two CPU steps on the tiny model (the tiny rollout engine supplies ``behavior_logp``), and
verl's policy-loss seam (``get_policy_loss_fn("lossplug")``, called as a trainer that passes ``rollout_log_probs``
does) split over 2 ranks × micro-batches against AReaL's formula over the whole step (float64, loss and gradient).

Only public import paths: ``lossplug.adapters.trl`` and ``lossplug.adapters.verl``.
"""

from __future__ import annotations

import pytest
import torch

from ._field_trainers import train_two_tiny_steps, verl_inputs, verl_seam_over_step


@pytest.mark.slow
def test_trains_inside_trls_grpo_trainer(tmp_path):
    # the tiny rollout engine's log-probs are far from the model's (engine KL ≈ 2.5 nats): a wide bound keeps some
    recipe = {
        "preset": "grpo",
        "gates": ["ppo_clip", {"name": "divergence_rejection", "metric": "kl_k3", "upper": 20.0}],
        "reduction": "token",
    }
    trainer, _ = train_two_tiny_steps(recipe, tmp_path)
    keys = {k for entry in trainer.state.log_history for k in entry if k.startswith("lossplug/")}
    assert "lossplug/divergence_rejection/rejected_frac" in keys, sorted(keys)


# -- verl --------------------------------------------------------------------------------------------------------------


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
    x = verl_inputs(seed=7, update_noise=0.2)
    mask = x["response_mask"]
    total, grad, metrics = verl_seam_over_step({"gates": ["ppo_clip", gate], "reduction": "token"}, x)
    assert all("actor/lossplug/divergence_rejection/rejected_frac" in m for m in metrics), sorted(metrics[0])
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
