"""prompt_mean: SkyRL's reduction, the mean over prompt groups of each group's token mean.

Oracles, float64, loss and gradient: the definition transcribed here (always) and SkyRL 0.3.0's own
``apply_loss_reduction_to_advantages_minibatch`` + ``importance_sampling_loss`` (from SkyRL's wheel, ``tests/_origins.py``); exactness
under any split into micro-batches with the step's Normalizer (groups cut across micro-batches included); properties.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lossplug
from lossplug.testing.batches import loss_and_grad, policy_fields

from .gates._field_origins import skyrl_config, skyrl_ppo_utils

LAYOUTS = {
    "contiguous": lambda B: torch.arange(B) // 3,
    "scattered": lambda B: torch.arange(B) % 3,
    "unequal": lambda B: torch.tensor([0, 0, 0, 0, 1, 2, 2, 3, 3, 3, 3, 3][:B]),
    "one group": lambda B: torch.zeros(B, dtype=torch.int64),
    "singletons": lambda B: torch.arange(B) * 7,
}
SHAPES = [(4, 5), (9, 11), (12, 33)]


def fields(B: int, T: int, layout: str, seed: int = 0, token_advantage: bool = False) -> dict:
    f = policy_fields(B, T, seed=seed, log_ratio_scale=0.5, token_advantage=token_advantage)
    f["action_mask"][:, 0] = True
    out = {k: f[k] for k in ("logp", "behavior_logp", "advantage", "action_mask")}
    out["group_id"] = LAYOUTS[layout](B)
    return out


def transcribed(logp, adv, mask, group_id):
    """−Σ_g (1/G) · Σ_{i∈g,t} A_it·logp_it / max(N_g, 1): reinforce's objective reduced over prompts."""
    adv = adv if adv.ndim == 2 else adv[:, None].expand_as(logp)
    groups = group_id.unique()
    total = sum((adv * logp * mask)[group_id == g].sum() / mask[group_id == g].sum().clamp(min=1) for g in groups)
    return -total / len(groups)


def run(f: dict, gate="reinforce", normalizer=None, **kw):
    return loss_and_grad({"gates": [gate], "reduction": "prompt_mean"}, normalizer=normalizer, **f, **kw)


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("token_advantage", [False, True])
@pytest.mark.parametrize("with_normalizer", [False, True])
def test_against_the_transcribed_definition(B, T, layout, token_advantage, with_normalizer):
    for seed in range(2):
        f = fields(B, T, layout, seed, token_advantage)
        norm = lossplug.Normalizer.for_masks([f["action_mask"]], group_ids=[f["group_id"]]) if with_normalizer else None
        result, grad = run({k: v for k, v in f.items() if k != "behavior_logp"}, normalizer=norm)
        logp = f["logp"].clone().requires_grad_()
        expected = transcribed(logp, f["advantage"], f["action_mask"].double(), f["group_id"])
        expected.backward()
        torch.testing.assert_close(result.loss, expected, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_micro_batches_add_up_to_the_step_even_when_they_cut_a_group(layout):
    f = fields(12, 9, layout, seed=3)
    norm = lossplug.Normalizer.for_masks([f["action_mask"]], group_ids=[f["group_id"]])
    full, full_grad = run(f, "importance_sampling", norm)
    for split in (
        [[0, 1, 2, 3, 4], [5], [6, 7, 8, 9, 10, 11]],
        [[i] for i in range(12)],
        [[0, 5, 9], [1, 2, 3, 4, 6, 7, 8, 10, 11]],
    ):
        total, grad = torch.zeros((), dtype=torch.float64), torch.zeros_like(f["logp"])
        for rows in split:
            idx = torch.tensor(rows)
            part, g = run({k: v[idx] for k, v in f.items()}, "importance_sampling", norm)
            total, grad[idx] = total + part.loss, g
        torch.testing.assert_close(total, full.loss, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, full_grad, rtol=1e-12, atol=1e-14)


@pytest.fixture(scope="module")
def ppo_utils(origins):
    return skyrl_ppo_utils(origins)


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_against_skyrl(ppo_utils, B, T, layout):
    f = fields(B, T, layout, seed=1, token_advantage=True)
    # SkyRL groups a prompt's sequences in one slice of the mini-batch: sort the rows by prompt
    order = torch.argsort(f["group_id"], stable=True)
    f = {k: v[order] for k, v in f.items()}
    ids, counts = torch.unique_consecutive(f["group_id"], return_counts=True)
    ends = counts.cumsum(0).tolist()
    boundaries = list(zip([0, *ends[:-1]], ends))
    mask = f["action_mask"].double()
    scaled = ppo_utils.apply_loss_reduction_to_advantages_minibatch(
        f["advantage"], mask, "prompt_mean", micro_batch_size=B, max_seq_len=T, prompt_boundaries=boundaries
    )
    logp = f["logp"].clone().requires_grad_()
    expected, _ = ppo_utils.importance_sampling_loss(
        logp, f["behavior_logp"], scaled, skyrl_config(), loss_mask=mask, rollout_logprobs=f["behavior_logp"]
    )
    expected.backward()
    result, grad = run(f, "importance_sampling")
    torch.testing.assert_close(result.loss, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-14)


@st.composite
def batches(draw):
    B, T = draw(st.integers(1, 8)), draw(st.integers(2, 9))
    f = fields(B, T, "contiguous", seed=draw(st.integers(0, 2**20)))
    f["group_id"] = torch.tensor(draw(st.lists(st.integers(0, 3), min_size=B, max_size=B)))
    return {k: v for k, v in f.items() if k != "behavior_logp"}


def token_weights(f: dict) -> torch.Tensor:
    """Each action token's weight in the reduction: −∂loss/∂logp ÷ A under reinforce."""
    _, grad = run(f)
    return torch.where(f["action_mask"], -grad / f["advantage"][:, None], 0)


@given(batches())
def test_every_prompt_weighs_one_over_the_number_of_prompts(f):
    weights = token_weights(f)
    groups = f["group_id"].unique()
    for g in groups:
        torch.testing.assert_close(weights[f["group_id"] == g].sum(), torch.tensor(1.0 / len(groups)).double())


@given(batches(), st.randoms(use_true_random=False))
def test_shuffling_the_rows_shuffles_the_weights(f, rnd):
    perm = torch.tensor(rnd.sample(range(f["logp"].shape[0]), f["logp"].shape[0]))
    shuffled = {k: v[perm] for k, v in f.items()}
    torch.testing.assert_close(token_weights(shuffled), token_weights(f)[perm], rtol=1e-12, atol=1e-15)


@given(batches())
def test_one_group_is_the_token_mean_and_singleton_groups_the_response_mean(f):
    one = {**f, "group_id": torch.zeros_like(f["group_id"])}
    singletons = {**f, "group_id": torch.arange(f["group_id"].numel())}
    for batch, reduction in ((one, "token"), (singletons, "response")):
        a, ga = run(batch)
        b, gb = loss_and_grad({"gates": ["reinforce"], "reduction": reduction}, **batch)
        torch.testing.assert_close(a.loss, b.loss, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-15)


def test_bad_input_is_refused_by_name():
    f = fields(6, 5, "contiguous")
    with pytest.raises(lossplug.BatchValidationError, match="group_id"):
        run({k: v for k, v in f.items() if k != "group_id"})
    with pytest.raises(lossplug.LossplugError, match="group_tokens"):
        run(f, normalizer=lossplug.Normalizer.for_masks([f["action_mask"]]))
    other = lossplug.Normalizer.for_masks([f["action_mask"]], group_ids=[f["group_id"] + 10])
    with pytest.raises(lossplug.LossplugError, match=r"group_id \[0, 1\]"):
        run(f, normalizer=other)
    from lossplug.needs import recipe_needs

    assert recipe_needs({"gates": ["reinforce"], "reduction": "prompt_mean"})["group_id"] == (
        "reduction 'prompt_mean'",
    )
