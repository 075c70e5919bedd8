"""accuracy_band is ROLL's difficulty_mask (formula transcribed from alibaba/ROLL 4142237, roll/utils/functionals.py:
each prompt's mean score over its n responses, kept strictly between the thresholds), as a filter: the groups outside
the band leave the advantage and every denominator."""

from __future__ import annotations

import pytest
import torch

import lossplug

N = 4  # responses per prompt, consecutive (ROLL reshapes by num_return_sequences)


def roll_difficulty_mask(scores: torch.Tensor, low: float, high: float) -> torch.Tensor:
    mean = scores.reshape(-1, N).mean(dim=-1, keepdim=True).expand(-1, N).reshape(-1)
    return (mean > low) & (mean < high)


def batch(scores: torch.Tensor) -> lossplug.PolicyBatch:
    B, T = scores.shape[0], 5
    return lossplug.PolicyBatch(
        logp=torch.full((B, T), -1.0, dtype=torch.float64),
        action_mask=torch.ones(B, T, dtype=torch.bool),
        reward=scores,
        group_id=torch.arange(B) // N,
    )


def recipe(**params) -> dict:
    return {
        "filters": [{"name": "accuracy_band", **params}],
        "advantage": "grpo",
        "gates": ["ppo_clip"],
        "reduction": "token",
    }


@pytest.mark.parametrize(("low", "high"), [(0.1, 0.95), (0.25, 0.75), (0.0, 1.0)])
def test_the_kept_rows_are_rolls_difficulty_mask(low, high):
    # pass rates 0, 1/4, 1/2, 3/4, 1 — and the boundaries themselves are out (strict inequalities)
    scores = torch.tensor([0, 0, 0, 0] + [1, 0, 0, 0] + [1, 1, 0, 0] + [1, 1, 1, 0] + [1, 1, 1, 1], dtype=torch.float64)
    res = lossplug.estimate_advantages(batch(scores), recipe(low=low, high=high))
    expected = roll_difficulty_mask(scores, low, high)
    assert torch.equal(res.action_mask.any(-1), expected)
    assert torch.equal(res.advantage[~expected], torch.zeros(int((~expected).sum()), dtype=torch.float64))


def test_a_group_order_scattered_over_the_batch_does_not_matter():
    scores = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0], dtype=torch.float64)
    b = batch(scores).replace(group_id=torch.tensor([0, 1, 0, 1, 0, 1, 0, 1]))
    res = lossplug.estimate_advantages(b, recipe())
    # group 0 (rows 0, 2, 4, 6): mean 0.5, kept; group 1 (rows 1, 3, 5, 7): mean 0.25, kept
    assert res.action_mask.any(-1).all()
    res = lossplug.estimate_advantages(b, recipe(low=0.3))
    assert res.action_mask.any(-1).tolist() == [True, False] * 4


def test_an_empty_band_is_refused():
    with pytest.raises(lossplug.RecipeError, match="low"):
        lossplug.Recipe.model_validate(recipe(low=0.5, high=0.5))
