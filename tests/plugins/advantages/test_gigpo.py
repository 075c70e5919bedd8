"""``gigpo``: against verl-agent's ``compute_gigpo_outcome_advantage`` and ``compute_step_discounted_returns``
transcribed here loop by loop in float64 (≤ 1e-12; verl-agent is on no package index, so its own code cannot run
here); hypothesis properties: a shift of every reward of a prompt group changes nothing (undiscounted, centring
only), equal returns give 0, ω scales the step level only.

The batches are multi-turn: several episodes per prompt group, 1–4 steps each, the episodes' rows interleaved (a
trajectory's rows in batch order are its time order), anchor states shared by the episodes' first steps and by some
later ones.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossplug
from lossplug import LossplugError

from ._multi_turn import episode_rows, interleave, split_last_trajectory_over_two_groups

F64 = torch.float64
T = 5


def recipe(**params):
    return lossplug.Recipe.model_validate(
        {"advantage": {"name": "gigpo", **params}, "gates": ["ppo_clip"], "reduction": "token"}
    )


def episodes(seed, groups=3, per_group=4, dtype=F64):
    """Rows (one per step), interleaved across the episodes of the batch; every field gigpo reads."""
    gen = torch.Generator().manual_seed(seed)
    rows = episode_rows(gen, groups, per_group, anchors=True)  # (group, trajectory, step, anchor, reward)
    # interleave: sort by step index, then by a random key (time order within each trajectory is kept)
    rows = interleave(rows, torch.rand(len(rows), generator=gen))
    B = len(rows)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = torch.arange(T) < lengths[:, None]
    batch = lossplug.PolicyBatch(
        logp=-torch.ones(B, T, dtype=dtype),
        action_mask=mask,
        reward=torch.tensor([r[4] for r in rows], dtype=dtype),
        group_id=torch.tensor([r[0] for r in rows]),
        trajectory_id=torch.tensor([r[1] for r in rows]),
        anchor_id=torch.tensor([r[3] for r in rows]),
    )
    return batch, lengths


def transcribed(batch, step_weight=1.0, gamma=0.95, scale="none", eps=1e-6, episode_stats="steps"):
    """GiGPO's Eq. 3, 5, 7, 8 loop by loop, in float64."""
    r = batch.reward.tolist()
    group, traj, anchor = batch.group_id.tolist(), batch.trajectory_id.tolist(), batch.anchor_id.tolist()
    B = len(r)
    episode_return = [sum(r[j] for j in range(B) if traj[j] == traj[i]) for i in range(B)]
    to_go = [0.0] * B
    for tr in set(traj):
        steps = [j for j in range(B) if traj[j] == tr]  # batch order is time order
        running = 0.0
        for j in reversed(steps):
            running = r[j] + gamma * running
            to_go[j] = running

    def normalise(values, members, single_mean_zero):
        n = len(members)
        if n == 1:
            mean, std = (0.0 if single_mean_zero else values[0]), 1.0
        else:
            mean = sum(values) / n
            std = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5
        return mean, std, n > 1 and all(v == values[0] for v in values)

    adv = [0.0] * B
    for i in range(B):
        rows = [j for j in range(B) if group[j] == group[i]]
        if episode_stats == "trajectories":
            rows = [j for j in rows if j == min(k for k in range(B) if traj[k] == traj[j])]
        mean, std, constant = normalise([episode_return[j] for j in rows], rows, True)
        a_e = 0.0 if constant else (episode_return[i] - mean) / ((std + eps) if scale == "std" else 1.0)
        peers = [j for j in range(B) if group[j] == group[i] and anchor[j] == anchor[i]]
        mean, std, constant = normalise([to_go[j] for j in peers], peers, False)
        a_s = 0.0 if constant else (to_go[i] - mean) / ((std + eps) if scale == "std" else 1.0)
        adv[i] = a_e + step_weight * a_s
    return torch.tensor(adv, dtype=F64), torch.tensor(to_go, dtype=F64)


PARAMS = [
    {},
    {"scale": "std"},
    {"scale": "std", "gamma": 1.0, "step_weight": 0.5},
    {"episode_stats": "trajectories", "scale": "std", "gamma": 0.7},
    {"gamma": 0.0, "step_weight": 2.0},
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "defaults")
def test_matches_the_transcribed_formula(seed, params):
    batch, _ = episodes(seed)
    expected, _ = transcribed(batch, **params)
    torch.testing.assert_close(lossplug.compute_advantages(batch, recipe(**params)), expected, atol=1e-12, rtol=1e-12)


def test_discounted_returns_follow_batch_order_within_a_trajectory():
    from lossplug.ops import Groups
    from lossplug.plugins.advantages.gigpo import discounted_returns

    batch, _ = episodes(5)
    _, expected = transcribed(batch, gamma=0.9)
    got = discounted_returns(batch.reward, Groups.from_ids(batch.trajectory_id), 0.9)
    torch.testing.assert_close(got, expected, atol=1e-14, rtol=0)


def test_a_trajectory_spanning_two_groups_is_refused_by_name():
    batch, _ = episodes(0)
    group = split_last_trajectory_over_two_groups(batch)
    with pytest.raises(LossplugError, match="trajectory_id rule broken.*same group_id"):
        lossplug.compute_advantages(batch.replace(group_id=group), recipe())


def test_missing_anchor_id_fails_validation_by_name():
    batch, _ = episodes(0)
    with pytest.raises(lossplug.BatchValidationError, match="anchor_id"):
        lossplug.compute_advantages(batch.replace(anchor_id=None), recipe())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(-5.0, 5.0), st.floats(0.0, 3.0))
def test_properties(seed, shift, weight):
    batch, _ = episodes(seed, groups=2, per_group=3)
    plain = recipe(gamma=1.0, step_weight=weight)
    adv = lossplug.compute_advantages(batch, plain)
    # centring only, undiscounted: adding c to every episode's final reward of a group shifts every return and every
    # return-to-go of the group by c, which the group (and anchor) means remove
    last = torch.tensor(
        [
            bool(i == max(j for j in range(batch.batch_size) if batch.trajectory_id[j] == batch.trajectory_id[i]))
            for i in range(batch.batch_size)
        ]
    )
    shifted = batch.replace(reward=torch.where(last & (batch.group_id == 0), batch.reward + shift, batch.reward))
    torch.testing.assert_close(lossplug.compute_advantages(shifted, plain), adv, atol=1e-9, rtol=1e-9)
    # every reward equal to 0 (no signal anywhere): exactly 0
    silent = lossplug.compute_advantages(batch.replace(reward=torch.zeros_like(batch.reward)), recipe(scale="std"))
    assert bool((silent == 0).all())
    # ω multiplies the step level only
    episode_only = lossplug.compute_advantages(batch, recipe(gamma=1.0, step_weight=0.0))
    both = lossplug.compute_advantages(batch, recipe(gamma=1.0, step_weight=1.0))
    torch.testing.assert_close(adv, episode_only + weight * (both - episode_only), atol=1e-9, rtol=1e-9)
