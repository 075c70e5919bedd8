"""engine_divergence_mask: OpenRLHF's binary-KL / TV trust region on the train–inference mismatch.

Two oracles, float64, loss and gradient: the formula transcribed here from OpenRLHF's definitions (always), and
OpenRLHF 0.11.2's own ``PolicyLoss``, read from its wheel (``tests/_origins.py``). ``openrlhf/models/loss.py`` is executed from its file without importing the package (whose ``__init__`` needs flash-attn and DeepSpeed), with
``masked_mean`` taken from its ``models/utils.py`` the same way. Measured: bit-identical loss and gradient (0.0).
Properties: the weight is the engine ratio where kept and 0 where dropped; equal engines keep every token with
weight 1; no gradient flows through the weight.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossplug
from lossplug.testing.batches import loss_and_grad

from ._engine_ratio import correction_weight
from ._engine_ratio import engine_fields as fields

SHAPES = [(1, 1), (3, 7), (6, 10), (8, 33)]
CASES = [
    {"divergence": "binary_kl", "level": "token", "delta": 0.002},
    {"divergence": "binary_kl", "level": "sequence", "delta": 0.01},
    {"divergence": "tv", "level": "token", "delta": 0.05},
    {"divergence": "tv", "level": "sequence", "delta": 0.1},
]
CLIP = 0.2


def run(params: dict, f: dict):
    """PPO clip (OpenRLHF's, ±20 log-ratio clamp) then the trust region, global token mean."""
    return loss_and_grad(
        {
            "gates": [
                {"name": "ppo_clip", "eps_low": CLIP, "eps_high": CLIP},
                {"name": "engine_divergence_mask", **params},
            ],
            "reduction": "token",
        },
        **f,
    )


def transcribed(params: dict, logp, old, behavior, adv, mask):
    """OpenRLHF's PolicyLoss (ppo, is_correction_mode mask, a divergence gating), read as formulas."""
    ratio = (logp - old).clamp(-20, 20).exp()
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    p = behavior.exp().clamp(1e-6, 1 - 1e-6)  # the rollout engine's probability
    q = old.exp().clamp(1e-6, 1 - 1e-6)  # the training engine's
    if params["divergence"] == "binary_kl":
        stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
    else:
        stat = (p - q).abs()
    if params["level"] == "sequence":
        stat = ((stat * mask).sum(-1) / mask.sum(-1)).unsqueeze(-1).expand_as(stat)
    weight = torch.where(stat <= params["delta"], (old - behavior).exp(), torch.zeros_like(stat))
    return -(weight * surrogate * mask).sum() / mask.sum()


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("params", CASES, ids=lambda p: f"{p['divergence']}-{p['level']}")
def test_against_the_transcribed_formula(params, B, T):
    for seed in range(4):
        f = fields(B, T, seed)
        result, grad = run(params, f)
        logp = f["logp"].clone().requires_grad_()
        expected = transcribed(params, logp, f["old_logp"], f["behavior_logp"], f["advantage"], f["action_mask"])
        expected.backward()
        torch.testing.assert_close(result.loss, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-12)


def _definitions(path: Path, keep, namespace: dict) -> dict:
    """Execute the top-level statements of ``path`` that ``keep`` accepts, in ``namespace``."""
    tree = ast.parse(path.read_text(), str(path))
    tree.body = [node for node in tree.body if keep(node)]
    exec(compile(tree, str(path), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def policy_loss_cls(origins):
    models = origins.package("openrlhf") / "models"
    utils = _definitions(
        models / "utils.py",
        lambda n: isinstance(n, ast.FunctionDef) and n.name == "masked_mean",
        {"torch": torch, "Optional": Optional},
    )
    not_relative = lambda n: not (isinstance(n, ast.ImportFrom) and n.level > 0)
    loss = _definitions(models / "loss.py", not_relative, {"masked_mean": utils["masked_mean"], "__name__": "loss"})
    assert "is_correction_gating" in inspect.signature(loss["PolicyLoss"].__init__).parameters, "OpenRLHF changed"
    return loss["PolicyLoss"]


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("params", CASES, ids=lambda p: f"{p['divergence']}-{p['level']}")
def test_against_openrlhf(policy_loss_cls, params, B, T):
    loss_fn = policy_loss_cls(
        clip_eps_low=CLIP,
        clip_eps_high=CLIP,
        is_correction_level="seq" if params["level"] == "sequence" else "token",
        is_correction_mode="mask",
        is_correction_gating=params["divergence"],
        is_correction_threshold=[0.0, params["delta"]],
    )
    for seed in range(3):
        f = fields(B, T, seed)
        result, grad = run(params, f)
        logp = f["logp"].clone().requires_grad_()
        out = loss_fn(logp, f["old_logp"], f["advantage"], f["action_mask"].double(), f["behavior_logp"])
        expected = out[0] if isinstance(out, tuple) else out
        expected.backward()
        torch.testing.assert_close(result.loss, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-12)


def weight_of(params: dict, f: dict) -> torch.Tensor:
    return correction_weight("engine_divergence_mask", params, f)


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 5),
    T=st.integers(2, 9),
    seed=st.integers(0, 2**20),
    scale=st.sampled_from([0.05, 0.5, 2.0]),
    case=st.sampled_from(CASES),
)
def test_weight_is_the_engine_ratio_where_kept_and_zero_where_dropped(B, T, seed, scale, case):
    f = fields(B, T, seed, scale)
    weight = weight_of(case, f)
    ratio = (f["old_logp"] - f["behavior_logp"]).exp()
    mask = f["action_mask"]
    kept = weight != 0
    assert not weight.requires_grad
    torch.testing.assert_close(weight[kept & mask], ratio[kept & mask], rtol=1e-12, atol=0)
    if case["level"] == "sequence":  # a response is kept or dropped whole
        assert torch.all((kept | ~mask).all(-1) | (~kept | ~mask).all(-1))


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"{p['divergence']}-{p['level']}")
def test_equal_engines_keep_every_token_with_weight_one(params):
    f = fields(4, 6, seed=3)
    f["behavior_logp"] = f["old_logp"].clone()
    weight = weight_of(params, f)
    assert torch.equal(weight[f["action_mask"]], torch.ones_like(weight[f["action_mask"]]))


def test_a_token_both_engines_find_unlikely_is_kept_whatever_its_ratio():
    """The region is on probabilities: ρ = e⁴ between two probabilities below 1e-3 is a tiny divergence."""
    f = fields(1, 2, seed=0)
    f["old_logp"] = torch.tensor([[-7.0, -0.1]], dtype=torch.float64)
    f["behavior_logp"] = torch.tensor([[-11.0, -0.1]], dtype=torch.float64)
    f["action_mask"] = torch.tensor([[True, True]])
    weight = weight_of({"divergence": "tv", "delta": 0.01}, f)
    torch.testing.assert_close(weight[0], torch.tensor([4.0, 0.0], dtype=torch.float64).exp())
    inp = lossplug.GateInput.from_batch(lossplug.PolicyBatch(**f))
    icepop = lossplug.registry().plugins["gate"]["icepop"]
    assert icepop.fn(inp, icepop.params(low=0.5, high=5.0)).weight[0, 0] == 0  # a ratio bound drops it (e⁴ > 5)


def test_parameters_are_checked():
    for bad in ({"delta": 0.0}, {"divergence": "js"}, {"level": "step"}):
        with pytest.raises(lossplug.RecipeError, match="engine_divergence_mask"):
            lossplug.Recipe.model_validate(
                {"gates": ["ppo_clip", {"name": "engine_divergence_mask", **bad}], "reduction": "token"}
            )
