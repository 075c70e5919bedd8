"""The reliability suites' batch completion (``_fields.complete_fields``) keeps its promises: it can complete a batch
for every registered plugin, and what it synthesises obeys the contract and the relations the suites rely on."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

import lossplug
from lossplug import PolicyBatch, Recipe
from lossplug.needs import recipe_needs

_spec = importlib.util.spec_from_file_location("_reliability_fields", Path(__file__).with_name("_fields.py"))
assert _spec is not None and _spec.loader is not None
_fields = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fields)
complete_fields = _fields.complete_fields

_REG = lossplug.registry()


def _recipes() -> list[Any]:
    out = []
    for kind, plugins in sorted(_REG.plugins.items()):
        for name in sorted(plugins):
            if kind == "gate":
                spec = {
                    "gates": [name] if plugins[name].role == "update" else ["reinforce", name],
                    "reduction": "token",
                }
            elif kind == "advantage":
                spec = {"advantage": name, "gates": ["reinforce"], "reduction": "token"}
            elif kind == "regularizer":
                spec = {"gates": ["reinforce"], "reduction": "token", "regularizers": [{"name": name, "coef": 0.1}]}
            else:
                continue
            out.append(pytest.param(spec, id=f"{kind}:{name}"))
    return out


def base_fields() -> dict[str, Any]:
    """3 responses × 4 positions, padded; log-probs from 0 (a certain token) down; rewards and groups."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    logp = torch.linspace(0.0, -20.0, 12).reshape(3, 4)
    return dict(
        logp=logp.requires_grad_(),
        action_mask=mask,
        advantage=torch.tensor([1.0, -1.0, 0.5]),
        reward=torch.tensor([1.0, -3.0, 1e6]),
        value=torch.zeros(3, 4),
        group_id=torch.tensor([0, 0, 1]),
    )


@pytest.mark.parametrize("spec", _recipes())
def test_every_registered_plugin_gets_a_batch_the_contract_accepts(spec):
    recipe = Recipe.model_validate(spec)
    f = complete_fields(base_fields(), recipe)
    missing = [name for name in recipe_needs(recipe) if f.get(name) is None]
    assert not missing, f"complete_fields left out {missing}"
    PolicyBatch(**f)  # the contract accepts every synthesised field


def test_synthesised_fields_keep_their_relations():
    recipe = Recipe.model_validate(
        {"advantage": "optimal_token_baseline", "gates": ["reinforce"], "reduction": "token"}
    )
    f = complete_fields(base_fields(), recipe)
    mask = f["action_mask"]
    p = torch.exp(f["old_logp"].double())
    spi = f["sum_pi_squared"].double()
    tol = 1e-6
    assert ((spi >= p.square() - tol) & (spi <= p.square() + (1 - p).square() + tol))[mask].all()
    # both ends of the interval are reached: p² at the first position, p² + (1 − p)² at the last
    assert spi[0, 0].item() == pytest.approx(p.square()[0, 0].item(), abs=tol)
    assert spi[-1, -1].item() == pytest.approx((p.square() + (1 - p).square())[-1, -1].item(), abs=tol)
    entropy = _fields.entropy_like(f)
    assert (entropy[mask] >= 0).all() and torch.isfinite(entropy).all() and entropy.max() == _fields.MAX_ENTROPY
    reward = f["reward"].double()
    for layout in ("split", "each"):
        components = _fields.reward_components_like(f, layout).double()
        expected = reward if layout == "split" else 2 * reward
        torch.testing.assert_close(components.sum(-1), expected)
    assert torch.equal(_fields.reward_baseline_like(f), f["reward"].roll(1))


def test_poisoned_padding_is_poisoned_in_the_synthesised_fields_too():
    f = base_fields()
    f["logp"] = f["logp"].detach().masked_fill(~f["action_mask"], float("nan"))
    recipe = Recipe.model_validate(
        {
            "advantage": "optimal_token_baseline",
            "gates": ["reinforce", "top_entropy"],
            "reduction": "token",
        }
    )
    out = complete_fields(f, recipe)
    for name in ("entropy", "sum_pi_squared"):
        t = out[name]
        assert torch.isnan(t[~f["action_mask"]]).all() and torch.isfinite(t[f["action_mask"]]).all(), name
    PolicyBatch(**out)


def test_a_field_it_cannot_synthesise_fails_by_name():
    recipe = Recipe.model_validate({"gates": ["reinforce"], "reduction": "token"})
    f = base_fields()
    original = _fields.recipe_needs
    try:
        _fields.recipe_needs = lambda r: {**original(r), "mystery_field": ("gates[1] 'lpx_needs_mystery'",)}
        with pytest.raises(AssertionError, match="needs 'mystery_field'.*cannot synthesise"):
            complete_fields(f, recipe)
    finally:
        _fields.recipe_needs = original


def test_synthesised_observation_tokens_are_valid_environment_tokens():
    # echo's observation_mask: off the actions, on valid log-probs, never on poisoned padding, and padding remains
    recipe = Recipe.model_validate(
        {"gates": ["reinforce"], "reduction": "token", "regularizers": [{"name": "echo", "coef": 0.1}]}
    )
    f = complete_fields(base_fields(), recipe)
    obs, mask = f["observation_mask"], f["action_mask"]
    assert obs.dtype == torch.bool and obs.shape == mask.shape
    assert obs.any() and not (obs & mask).any()
    assert (~obs & ~mask).any()  # each row's last position stays padding
    assert torch.equal(obs, ~mask & torch.ones_like(mask).index_fill(1, torch.tensor([mask.shape[1] - 1]), False))
    poisoned = base_fields()
    poisoned["logp"] = (
        poisoned["logp"]
        .detach()
        .masked_fill(torch.tensor([[0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0]], dtype=torch.bool), float("nan"))
    )
    out = complete_fields(poisoned, recipe)
    assert not out["observation_mask"][2, 1] and out["observation_mask"][2, 2]
    PolicyBatch(**out)
