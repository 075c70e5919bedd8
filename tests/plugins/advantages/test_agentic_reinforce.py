"""``agentic_reinforce``: against ROLL's agentic pipeline transcribed in ``_roll.py`` (float64; ROLL is on no package
index) — the trajectory's summed score normalised by ``agentic_reward_norm``, put on the sample's last token
(``expand_to_token_level``), multiplied by the response mask, walked back segment by segment
(``compute_agentic_reinforce_return``), whitened (``masked_whiten``) when asked, zero off the mask — over the
normalisations ROLL's ``reward_normalization`` can ask for; and, end to end, the loss and gradient of a REINFORCE
recipe. Properties (hypothesis): each turn's value is γ times the next turn's, a one-turn row gets ``R̂`` whatever γ,
the rows' order changes nothing.

The rows are multi-turn trajectories: 1–4 turns of 1–3 action tokens separated by 1–2 observation tokens, each
ending with a model turn (ROLL's reward then lands on an action token: see the module's docstring for a trajectory
ending with an observation), right-padded; the per-turn rewards sit on each turn's last token. Measured: ≤ 4.5e-16
abs against the transcription.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossplug

from ._multi_turn import assert_reinforce_loss_and_gradient
from ._roll import agentic_reinforce_return, agentic_reward_norm, masked_whiten

F64 = torch.float64


def recipe(**params):
    return lossplug.Recipe.model_validate(
        {"advantage": {"name": "agentic_reinforce", **params}, "gates": ["reinforce"], "reduction": "token"}
    )


def trajectories(seed, groups=3, per_group=4, token_rewards=True):
    gen = torch.Generator().manual_seed(seed)
    masks, rewards, group = [], [], []
    for g in range(groups):
        for _ in range(per_group):
            row_mask, row_reward = [], []
            turns = int(torch.randint(1, 5, (1,), generator=gen))
            for k in range(turns):
                if k:  # the observation the environment answered with
                    n_obs = int(torch.randint(1, 3, (1,), generator=gen))
                    row_mask += [False] * n_obs
                    row_reward += [0.0] * n_obs
                n_act = int(torch.randint(1, 4, (1,), generator=gen))
                row_mask += [True] * n_act
                r = (
                    float(torch.rand(1, generator=gen) < 0.5)
                    if k == turns - 1
                    else 0.1 * float(torch.randn(1, generator=gen))
                )
                row_reward += [0.0] * (n_act - 1) + [1.0 if g == 0 and k == turns - 1 else (r if g else 0.0)]
            masks.append(row_mask)
            rewards.append(row_reward)
            group.append(g)
    T = max(len(m) for m in masks) + 1  # at least one padding position
    mask = torch.tensor([m + [False] * (T - len(m)) for m in masks])
    reward = torch.tensor([r + [0.0] * (T - len(r)) for r in rewards], dtype=F64)
    B = len(masks)
    batch = lossplug.PolicyBatch(
        logp=-(0.1 + torch.rand(B, T, generator=gen, dtype=F64)),
        action_mask=mask,
        reward=reward if token_rewards else reward.sum(-1),
        group_id=torch.tensor(group),
    )
    return batch, [len(m) for m in masks]


def roll_agentic_reinforce(batch, lengths, gamma=1.0, grouping="batch", mean="none", std="none", whiten=False):
    reward = batch.reward if batch.reward.ndim == 1 else batch.reward.sum(-1)  # scores.sum(dim=-1)
    norm = agentic_reward_norm(
        reward.tolist(),
        batch.group_id.tolist(),
        grouping,
        None if mean == "none" else mean,
        None if std == "none" else std,
    )
    B, T = batch.action_mask.shape
    token_rewards = [[0.0] * T for _ in range(B)]
    for b in range(B):  # expand_to_token_level: on the sample's last token
        token_rewards[b][lengths[b] - 1] = norm[b]
    mask = batch.action_mask.tolist()
    token_rewards = [[r if m else 0.0 for r, m in zip(rr, mm)] for rr, mm in zip(token_rewards, mask)]
    adv = torch.tensor(agentic_reinforce_return(token_rewards, mask, gamma), dtype=F64)
    if whiten:
        adv = masked_whiten(adv, batch.action_mask)
    return adv * batch.action_mask


PARAMS = [
    {},
    {"gamma": 0.9},
    {"gamma": 0.7, "grouping": "group", "mean": "group"},
    {"gamma": 0.9, "grouping": "group", "mean": "group", "std": "group"},
    {"gamma": 0.5, "grouping": "batch", "mean": "batch", "std": "batch", "whiten": True},
    {"gamma": 0.0, "grouping": "group", "mean": "group", "std": "batch"},
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("token_rewards", [True, False], ids=["token_reward", "row_reward"])
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "defaults")
def test_matches_rolls_agentic_reinforce(seed, token_rewards, params):
    batch, lengths = trajectories(seed, token_rewards=token_rewards)
    got = torch.where(batch.action_mask, lossplug.compute_advantages(batch, recipe(**params)), 0)
    torch.testing.assert_close(got, roll_agentic_reinforce(batch, lengths, **params), atol=1e-12, rtol=1e-12)


def test_loss_and_gradient_of_reinforce_with_it():
    batch, lengths = trajectories(7)
    params = {"gamma": 0.8, "grouping": "group", "mean": "group", "std": "group"}
    assert_reinforce_loss_and_gradient(batch, recipe(**params), roll_agentic_reinforce(batch, lengths, **params))


def test_turns_are_the_runs_of_action_tokens():
    """Turns [0, 1], [3], [5, 6] (observations at 2 and 4, padding at 7): γ², γ, 1 times R."""
    batch = lossplug.PolicyBatch(
        logp=-torch.ones(1, 8, dtype=F64),
        action_mask=torch.tensor([[True, True, False, True, False, True, True, False]]),
        reward=torch.tensor([2.0], dtype=F64),
    )
    adv = lossplug.compute_advantages(batch, recipe(gamma=0.5))
    assert torch.equal(adv, torch.tensor([[0.5, 0.5, 0.0, 1.0, 0.0, 2.0, 2.0, 0.0]], dtype=F64))


@settings(deadline=None)
@given(seed=st.integers(0, 2**20), gamma=st.floats(0.01, 1.0))
def test_each_turn_is_gamma_times_the_next_and_order_changes_nothing(seed, gamma):
    params = {"gamma": gamma, "grouping": "group", "mean": "group"}
    batch, _ = trajectories(seed, groups=2, per_group=3)
    adv = lossplug.compute_advantages(batch, recipe(**params))
    mask = batch.action_mask
    for b in range(mask.shape[0]):
        values = [float(adv[b, t]) for t in range(mask.shape[1]) if mask[b, t]]
        starts = [t for t in range(mask.shape[1]) if mask[b, t] and (t == 0 or not mask[b, t - 1])]
        per_turn = [float(adv[b, t]) for t in starts]
        last = per_turn[-1]
        for k, v in enumerate(per_turn):
            assert abs(v - gamma ** (len(per_turn) - 1 - k) * last) <= 1e-12 * max(1.0, abs(last))
        assert set(values) <= set(per_turn)  # every token of a turn carries its turn's value
    perm = torch.randperm(mask.shape[0], generator=torch.Generator().manual_seed(seed))
    shuffled = batch.replace(
        logp=batch.logp[perm], action_mask=mask[perm], reward=batch.reward[perm], group_id=batch.group_id[perm]
    )
    torch.testing.assert_close(lossplug.compute_advantages(shuffled, recipe(**params)), adv[perm], atol=1e-12, rtol=0)


def test_bad_parameters_and_a_missing_group_id_are_refused_by_name():
    batch, _ = trajectories(0)
    with pytest.raises(lossplug.BatchValidationError, match="group_id"):
        lossplug.compute_advantages(batch.replace(group_id=None), recipe(grouping="group", mean="group"))
    lossplug.compute_advantages(batch.replace(group_id=None), recipe(mean="batch"))  # grouping: batch needs none
    for bad in ({"gamma": -0.1}, {"std": "running"}, {"whiten": "sometimes"}):
        with pytest.raises(lossplug.RecipeError, match="agentic_reinforce"):
            recipe(**bad)
