"""ROLL's and AReaL's gates (topr, kimi15, decoupled_ppo, m2po) inside the trainers: real ``GRPOTrainer.train()``
steps on the tiny model, and verl's policy-loss registry on micro-batches split over ranks, against transcribed
per-token formulas (float64, loss and gradient).

TRL has no policy versions: decoupled_ppo runs there with ``prox_logp: recompute`` (``old_logp`` recomputed by TRL
with ``num_iterations > 1``, the behaviour log-probs from a ``rollout_func``); its version-based approximations are
tested at the ``lossplug.policy_loss`` level (tests/plugins/gates/test_decoupled_ppo.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from lossplug.testing import tiny

from ._field_trainers import verl_actor_config, verl_policy_loss

#: one recipe per family; TRL trains each for two steps with two iterations per generation (old_logp ≠ logp)
FAMILIES = {
    "topr": {"advantage": "grpo", "gates": [{"name": "topr", "split_on": "reward"}], "reduction": "token"},
    "kimi15": {"advantage": {"name": "grpo", "scale": "none"}, "gates": [{"name": "kimi15"}], "reduction": "token"},
    "decoupled_ppo": {
        "advantage": "grpo",
        "gates": [{"name": "decoupled_ppo", "weight_cap": 5.0, "eps_high": 0.28}],
        "reduction": "token",
    },
    "m2po": {
        "advantage": "grpo",
        "gates": ["ppo_clip", {"name": "m2po", "threshold": 0.04, "renormalize": True}],
        "reduction": "token",
    },
}
#: a metric each family must have logged in TRL
TRL_METRIC = {
    "topr": "lossplug/topr/negative_frac",
    "kimi15": "lossplug/kimi15/penalty_mean",
    "decoupled_ppo": "lossplug/decoupled_ppo/weight_rejected_frac",
    "m2po": "lossplug/m2po/masked_frac",
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_trains_inside_trl(family, tmp_path):
    pytest.importorskip("trl")
    tok = tiny.tiny_tokenizer()
    model = tiny.tiny_model(tok)
    before = [p.detach().clone() for p in model.parameters()]
    needs_rollout = family in ("decoupled_ppo", "m2po")  # they read the behaviour log-probs
    trainer = tiny.tiny_grpo_trainer(
        FAMILIES[family],
        tmp_path / "out",
        model=model,
        tokenizer=tok,
        max_steps=2,
        num_iterations=2,
        trainer_kwargs={"rollout_func": tiny.TinyRollout(tok)} if needs_rollout else None,
    )
    trainer.train()
    logs = [row for row in trainer.state.log_history if "loss" in row]
    assert trainer.state.global_step == 2 and len(logs) == 2
    assert all(math.isfinite(row["loss"]) for row in logs)
    assert all(TRL_METRIC[family] in row for row in logs), sorted(logs[0])
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))


# ---------------------------------------------------------------------------------------------------------------------
# verl

B, T, DP, MICRO = 8, 12, 2, 2


def verl_inputs(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    mask &= (torch.rand(B, T, generator=g) > 0.15) | (torch.arange(T) == 0)  # observation tokens
    behave = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    old = (behave + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    logp = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    garbage = 50 * torch.rand(B, T, generator=g, dtype=torch.float64)  # whatever verl holds off the mask
    return {
        "old_log_prob": torch.where(mask, old, -garbage),
        "log_prob": torch.where(mask, logp, garbage),
        "rollout_log_probs": torch.where(mask, behave, -garbage),
        "advantages": torch.where(mask, adv, garbage),
        "response_mask": mask,
        "lengths": lengths,
    }


def m2po_keep(delta: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """AReaL's rule as a loop: drop the largest δ² until the mean of the rest is below the threshold."""
    m2 = sorted(
        ((float(v) ** 2, i) for i, (v, k) in enumerate(zip(delta.flatten(), mask.flatten())) if k), reverse=True
    )
    drop = len(m2) - 1
    for k in range(len(m2)):
        rest = [v for v, _ in m2[k:]]
        if sum(rest) / len(rest) < threshold:
            drop = k
            break
    keep = torch.zeros(delta.numel(), dtype=torch.bool)
    keep[[i for _, i in m2[drop:]]] = True
    return keep.view_as(mask)


def ppo(ratio, adv, low=0.2, high=0.2):
    return torch.minimum(ratio * adv, ratio.clamp(1 - low, 1 + high) * adv)


def transcribed_objective(family: str, mb: dict[str, torch.Tensor], logp: torch.Tensor) -> torch.Tensor:
    """The per-token objective of each family's recipe on one micro-batch (the paper's / origin's formula)."""
    old, behave, adv, mask = mb["old_log_prob"], mb["rollout_log_probs"], mb["advantages"], mb["response_mask"]
    ratio = torch.exp(logp - old)
    if family == "topr":  # split on the advantage's sign (verl passes no reward)
        return torch.where(adv > 0, adv * logp, ratio.clamp(max=1.0).detach() * adv * logp)
    if family == "kimi15":
        return adv * logp - 0.5 * 0.1 * (logp - old) ** 2
    if family == "decoupled_ppo":
        w = torch.exp(old - behave)
        return torch.where(w <= 5.0, w, 0.0) * ppo(ratio, adv, high=0.28)
    keep = m2po_keep(old - behave, mask, 0.04)
    return keep * (mask.sum() / keep.sum()) * ppo(ratio, adv)


VERL_RECIPES = {**FAMILIES, "topr": {"gates": [{"name": "topr"}], "reduction": "token"}}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_in_verls_policy_loss_matches_its_formula(family):
    pytest.importorskip("verl")
    recipe = {k: v for k, v in VERL_RECIPES[family].items() if k != "advantage"}
    config = verl_actor_config(recipe, MICRO)
    inputs = verl_inputs(seed=len(family))
    n = int(inputs["response_mask"].sum())
    config.global_batch_info.update({"dp_size": DP, "batch_num_tokens": n, "global_batch_size": B})
    worst = {"loss_abs": 0.0, "grad_abs": 0.0}
    total, expected_total = 0.0, 0.0
    for start in range(0, B, MICRO):  # dp_size ranks × micro-batches, each padded to its own longest response
        rows = slice(start, start + MICRO)
        width = int(inputs["lengths"][rows].max())
        mb = {k: v[rows, :width] for k, v in inputs.items() if k != "lengths"}
        log_prob = mb["log_prob"].clone().requires_grad_()
        loss, metrics = verl_policy_loss(config, mb, log_prob)
        loss.backward()
        reference_logp = mb["log_prob"].clone().requires_grad_()
        mask = mb["response_mask"]
        expected = -torch.where(mask, transcribed_objective(family, mb, reference_logp), 0).sum() / n * DP
        expected.backward()
        worst["loss_abs"] = max(worst["loss_abs"], float((loss.detach() - expected.detach()).abs()))
        worst["grad_abs"] = max(worst["grad_abs"], float((log_prob.grad - reference_logp.grad).abs().max()))
        total += float(loss) / DP
        expected_total += float(expected) / DP
        assert isinstance(metrics, dict)
    assert worst["loss_abs"] <= 1e-12 and worst["grad_abs"] <= 1e-12, worst
    assert abs(total - expected_total) <= 1e-12
    print(f"verl lossplug[{family}] vs formula", worst)
