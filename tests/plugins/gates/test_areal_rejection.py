"""divergence_rejection against AReaL 1.0.4's own ``apply_rejection_sampling`` and ``ppo_actor_loss_fn`` (float64:
the weight, the loss and the gradient) for every metric × level × aggregation × action AReaL has, and its rules."""

from __future__ import annotations

import ast
import dataclasses
import functools
import sys
import types
from typing import Any

import pytest
import torch

import lossplug
from lossplug.testing.batches import loss_and_grad

#: AReaL's float32 casts (the rejection's log-ratio, the KL estimator's operands) and the same lines in float64: with
#: them replaced the oracle can demand float64 agreement, which shows those casts are the only difference
FLOAT32_CASTS = {
    "functional.py": [
        (
            "proximal_logprobs.detach().float() - old_logprobs.detach().float()",
            "proximal_logprobs.detach() - old_logprobs.detach()",
        )
    ],
    "data.py": [("log_probs.float() - log_probs_base.float()", "log_probs - log_probs_base")],
}


def _load(path, names, namespace):
    text = path.read_text()
    for cast, wide in FLOAT32_CASTS[path.name]:
        assert cast in text, f"AReaL's {path.name} no longer reads {cast!r}"
        text = text.replace(cast, wide)
    tree = ast.parse(text, str(path))
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name in names]
    assert {n.name for n in nodes} == set(names), f"AReaL's {path.name} no longer defines {names}"
    module = types.ModuleType(f"areal_rejection_oracle_{path.stem}")
    module.__dict__.update(namespace)
    sys.modules[module.__name__] = module
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), module.__dict__)
    return module.__dict__


@pytest.fixture(scope="module")
def areal64(origins) -> types.SimpleNamespace:
    """AReaL's rejection sampling and PPO actor loss from its wheel, its float32 casts in float64."""
    root = origins.package("areal")
    base: dict[str, Any] = {"torch": torch, "dataclass": dataclasses.dataclass, "Any": Any, "functools": functools}
    data = _load(root / "utils" / "data.py", ("KLEstimator",), base)
    functional = _load(
        root / "utils" / "functional" / "functional.py",
        ("RejectionSamplingResult", "_check_bounds", "apply_rejection_sampling", "ppo_actor_loss_fn"),
        {**base, "RejectionSamplingConfig": object, "KLEstimator": data["KLEstimator"]},
    )
    return types.SimpleNamespace(**functional)


def stale_batch(B, T, seed, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    behave = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    old = (behave + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    logp = (old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return dict(logp=logp, old_logp=old, behavior_logp=behave, advantage=adv, action_mask=mask)


#: (upper, lower) per metric and level/agg: bounds that keep some tokens and reject others on ``stale_batch``
BOUNDS = {
    ("ratio", "token"): [(1.5, None), (1.5, 0.7)],
    ("ratio", "sum"): [(1.5, None), (3.0, 0.4)],
    ("ratio", "mean"): [(1.1, None), (1.2, 0.9)],
    ("ratio", "max"): [(1.6, None), (2.0, 1.2)],
    ("kl_k1", "token"): [(0.3, None), (0.3, -0.3)],
    ("kl_k1", "sum"): [(0.5, None), (1.0, -1.0)],
    ("kl_k1", "mean"): [(0.1, None), (0.1, -0.1)],
    ("kl_k1", "max"): [(0.5, None), (0.6, 0.2)],
    ("kl_k2", "token"): [(0.05, None), (0.05, 0.001)],
    ("kl_k2", "sum"): [(0.3, None), (0.5, 0.05)],
    ("kl_k2", "mean"): [(0.05, None), (0.06, 0.02)],
    ("kl_k2", "max"): [(0.15, None), (0.2, 0.05)],
    ("kl_k3", "token"): [(0.05, None), (0.05, 0.001)],
    ("kl_k3", "sum"): [(0.3, None), (0.5, 0.05)],
    ("kl_k3", "mean"): [(0.05, None), (0.06, 0.02)],
    ("kl_k3", "max"): [(0.15, None), (0.2, 0.05)],
}
CASES = [
    (metric, level, agg, action, upper, lower)
    for (metric, scope), bounds in BOUNDS.items()
    for action in ("mask", "clamp")
    for upper, lower in bounds
    for level, agg in ([("token", "mean")] if scope == "token" else [("sequence", scope)])
]
SHAPES = [(3, 5), (6, 11), (9, 24)]


def gate_output(fields, **params):
    plugin = lossplug.registry().plugins["gate"]["divergence_rejection"]
    return plugin(lossplug.GateInput.from_batch(lossplug.PolicyBatch(**fields)), plugin.params(**params))


@pytest.mark.parametrize(("metric", "level", "agg", "action", "upper", "lower"), CASES)
def test_weight_loss_and_gradient_match_areal(areal64, metric, level, agg, action, upper, lower):
    config = types.SimpleNamespace(metric=metric, level=level, agg=agg, action=action, upper=upper, lower=lower)
    params = dict(metric=metric, level=level, agg=agg, action=action, upper=upper, lower=lower)
    acted, kept = 0, 0
    for seed, (B, T) in enumerate(SHAPES):
        f = stale_batch(B, T, seed)
        mask = f["action_mask"]
        expected = areal64.apply_rejection_sampling(f["old_logp"], f["behavior_logp"], mask, None, config)
        out = gate_output(f, **params)
        torch.testing.assert_close(out.weight, expected.behave_imp_weight, rtol=1e-14, atol=0)
        acted += int((mask & (out.weight != torch.exp(f["old_logp"] - f["behavior_logp"]))).sum())
        kept += int((out.weight > 0).sum())

        logp = f["logp"].clone().requires_grad_()
        areal_loss, _ = areal64.ppo_actor_loss_fn(
            logprobs=logp,
            proximal_logprobs=f["old_logp"],
            old_logprobs=f["behavior_logp"],
            advantages=f["advantage"].unsqueeze(-1).expand_as(mask),
            eps_clip=0.2,
            loss_mask=mask,
            rejection_sampling=config,
        )
        areal_loss.backward()
        recipe = {"gates": [{"name": "ppo_clip"}, {"name": "divergence_rejection", **params}], "reduction": "token"}
        result, grad = loss_and_grad(recipe, **f)
        torch.testing.assert_close(result.loss, areal_loss.detach(), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-14)
    # the bounds exercise the rule: some tokens rejected or clamped (or, for the sequence ratio, reweighted), some kept
    assert acted > 0 and kept > 0


def test_k3_is_areals_direction_not_verls():
    f = stale_batch(1, 1, 0)
    f["old_logp"] = torch.tensor([[-1.0]], dtype=torch.float64)
    f["behavior_logp"] = torch.tensor([[-2.0]], dtype=torch.float64)  # ρ = e: k3 = 1/e − 1 + 1 = 0.3679, verl's 0.718
    f["action_mask"] = torch.ones(1, 1, dtype=torch.bool)
    assert float(gate_output(f, metric="kl_k3", upper=0.37).weight) == pytest.approx(torch.e.__float__())
    assert float(gate_output(f, metric="kl_k3", upper=0.36).weight) == 0.0


def test_k1_max_rejects_a_response_by_its_largest_log_ratio():
    f = stale_batch(2, 3, 0)
    f["action_mask"] = torch.ones(2, 3, dtype=torch.bool)
    f["behavior_logp"] = torch.full((2, 3), -1.0, dtype=torch.float64)
    f["old_logp"] = torch.tensor([[-1.0, -0.5, -1.5], [-1.0, -0.9, -1.1]], dtype=torch.float64)
    out = gate_output(f, metric="kl_k1", level="sequence", agg="max", upper=0.2)
    assert torch.equal(out.weight[0], torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(out.weight[1], torch.exp(f["old_logp"][1] + 1.0))


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"metric": "ratio", "upper": 1.0}, "upper must be > 1"),
        ({"metric": "kl_k3", "upper": 0.1, "lower": 0.2}, "must not exceed upper"),
        ({"metric": "ratio", "upper": 2.0, "lower": 0.0}, "lower must be > 0"),
        ({"metric": "kl_k4"}, "metric"),
        ({"agg": "median"}, "agg"),
    ],
)
def test_bad_parameters_are_refused_naming_the_rule(params, words):
    plugin = lossplug.registry().plugins["gate"]["divergence_rejection"]
    with pytest.raises(Exception, match=words):
        plugin.params(**params)
