"""outlier_sequence_mask: SkyRL's outlier-token rejection of whole responses on the engine ratio.

Two oracles, float64, loss and gradient (PPO clip then the mask, token_sum as SkyRL's pre-scaled sum): the rule
transcribed here from SkyRL's definitions (always), and SkyRL 0.3.0's own ``compute_outlier_token_mask``, read from its
wheel (``tests/_origins.py``) and executed from its file without
importing the package, with ``safe_exp_delta`` taken from its ``torch_utils.py`` the same way. Measured: identical
masks, bit-identical loss and gradient (0.0). Properties: the weight is 0 or 1, constant over a response; equal
engines keep everything; no gradient flows through the weight.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossplug
from lossplug.testing.batches import loss_and_grad

from ._engine_ratio import correction_weight
from ._engine_ratio import engine_fields as fields

SHAPES = [(1, 2), (3, 7), (6, 10), (8, 33)]
CASES = [{"low": 0.5, "high": 2.0}, {"low": 0.7, "high": None}, {"low": None, "high": 1.5}, {}]
CLIP = 0.2


def run(params: dict, f: dict):
    gates = [{"name": "ppo_clip", "eps_low": CLIP, "eps_high": CLIP}, {"name": "outlier_sequence_mask", **params}]
    return loss_and_grad({"gates": gates, "reduction": "token_sum"}, **f)


def ppo_loss_with(keep, logp, old, adv, mask):
    ratio = (logp - old).clamp(-20, 20).exp()
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    return -(keep * surrogate * mask).sum()


def transcribed_keep(params: dict, old, behavior, mask):
    """SkyRL's rule read as a formula: a response is kept when none of its action tokens leaves the bounds."""
    ratio = (old - behavior).clamp(-20, 20).exp()
    low, high = params.get("low", 1e-4), params.get("high", 100.0)
    out = torch.zeros_like(mask)
    if high is not None:
        out |= (ratio > high) & mask
    if low is not None:
        out |= (ratio < low) & mask
    return (~out.any(-1, keepdim=True)).to(old.dtype)


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("params", CASES, ids=str)
def test_against_the_transcribed_rule(params, B, T):
    for seed in range(4):
        f = fields(B, T, seed)
        result, grad = run(params, f)
        logp = f["logp"].clone().requires_grad_()
        keep = transcribed_keep(params, f["old_logp"], f["behavior_logp"], f["action_mask"])
        expected = ppo_loss_with(keep, logp, f["old_logp"], f["advantage"], f["action_mask"])
        expected.backward()
        torch.testing.assert_close(result.loss, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-12)


def _definitions(path: Path, names: tuple[str, ...], namespace: dict) -> dict:
    tree = ast.parse(path.read_text(), str(path))
    tree.body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in tree.body} == set(names), f"{path.name} no longer defines {names}"
    exec(compile(tree, str(path), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def skyrl_outlier_mask(origins):
    utils = origins.package("skyrl") / "backends" / "skyrl_train" / "utils"
    helpers = _definitions(utils / "torch_utils.py", ("safe_exp_delta",), {"torch": torch})
    namespace = {"torch": torch, "Tuple": tuple, "DictConfig": object, "safe_exp_delta": helpers["safe_exp_delta"]}
    return _definitions(utils / "off_policy_correction_utils.py", ("compute_outlier_token_mask",), namespace)[
        "compute_outlier_token_mask"
    ]


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("params", CASES, ids=str)
def test_against_skyrl(skyrl_outlier_mask, params, B, T):
    low, high = params.get("low", 1e-4), params.get("high", 100.0)
    config = SimpleNamespace(outlier_token_is_threshold_low=low, outlier_token_is_threshold_high=high)
    for seed in range(3):
        f = fields(B, T, seed)
        result, grad = run(params, f)
        mask = f["action_mask"].double()
        keep, _ = skyrl_outlier_mask(f["old_logp"], f["behavior_logp"], mask, config)
        logp = f["logp"].clone().requires_grad_()
        expected = ppo_loss_with(keep, logp, f["old_logp"], f["advantage"], f["action_mask"])
        expected.backward()
        torch.testing.assert_close(result.loss, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-12)


def weight_of(params: dict, f: dict) -> torch.Tensor:
    return correction_weight("outlier_sequence_mask", params, f)


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 5),
    T=st.integers(2, 9),
    seed=st.integers(0, 2**20),
    scale=st.sampled_from([0.05, 0.5, 2.0]),
    case=st.sampled_from(CASES),
)
def test_weight_is_zero_or_one_and_constant_over_a_response(B, T, seed, scale, case):
    weight = weight_of(case, fields(B, T, seed, scale))
    assert not weight.requires_grad
    assert torch.all((weight == 0) | (weight == 1))
    assert torch.all(weight == weight[:, :1])


def test_equal_engines_keep_everything_and_one_extreme_token_drops_its_response():
    f = fields(3, 4, seed=1)
    f["behavior_logp"] = f["old_logp"].clone()
    assert torch.equal(weight_of({"low": 0.9, "high": 1.1}, f), torch.ones(3, 4, dtype=torch.float64))
    f["behavior_logp"][1, 0] -= 5.0  # ρ = e⁵ on one token of response 1
    assert weight_of({}, f)[:, 0].tolist() == [1.0, 0.0, 1.0]  # SkyRL's suggested bounds 1e-4 and 100


def test_parameters_are_checked():
    for bad in ({"low": None, "high": None}, {"low": 2.0, "high": 1.0}, {"high": 0.0}):
        with pytest.raises(lossplug.RecipeError, match="outlier_sequence_mask"):
            lossplug.Recipe.model_validate(
                {"gates": ["ppo_clip", {"name": "outlier_sequence_mask", **bad}], "reduction": "token"}
            )
