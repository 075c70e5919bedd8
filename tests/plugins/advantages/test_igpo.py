"""``igpo``: against IGPO's reference code transcribed loop by loop in float64 (the authors' GuoqingWang1/IGPO as
updated on 2026-02-01, commit 745078b5a35d0b84d3d9184e0f0de05ed04e11ad in the fork debajoycs98/IGPO; on no package
index): ``verl/trainer/ppo/core_algos.py`` ``compute_grpo_outcome_advantage`` (the outcome position, the nonzero
information-gain positions, the group's mean and population std ``sqrt(var + 1e-8)`` over them, joint or separate,
``+ 1e-6``) and ``_compute_turn_level_advantage`` (turns read off the nonzero normalised rewards, ``A = r̂ + γ·A_next``,
broadcast to the turn's mask positions), then PPO's clip with the token mean (verl's ``token-mean``), loss and
gradient. The transcription keeps the reference's outcome position (the mask's count − 1) as an option: on rows
without observation holes it is the last action token, and there the literal reading is checked too.

Properties (hypothesis): the rows' order changes nothing, a constant added to every turn reward of a group changes
nothing, a turn's reward may sit on any of its tokens, every token of a turn carries one value, with γ = 1 the first
turns of a group sum to 0 (joint), with γ = 0 each turn carries only its own normalised reward. Bad input is refused
by name. Measured: advantages ≤ 8.9e-16 abs from the transcription, loss 0 and gradient ≤ 1.1e-17.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossplug

from ._multi_turn import (
    assert_bad_turn_batches_are_refused_by_name,
    assert_equal_rewards_and_lone_rows_get_zero,
    assert_row_order_changes_nothing,
)

F64 = torch.float64


def recipe(**params):
    return lossplug.Recipe.model_validate(
        {"advantage": {"name": "igpo", **params}, "gates": ["ppo_clip"], "reduction": "token"}
    )


# ---------------------------------------------------------------------------------------------------------------------
# The reference, transcribed (float64, plain Python lists and loops)


def reference_advantages(rewards, mask, uid, gamma=1.0, mode="joint", std=True, outcome_at="last", epsilon=1e-6):
    """``compute_grpo_outcome_advantage`` then ``_compute_turn_level_advantage``, loop by loop. ``outcome_at="count"``
    is the reference's literal ``f1_mask`` (position ``sum(mask) − 1``); ``"last"`` the last mask position."""
    B, T = len(rewards), len(rewards[0])
    f1, ig = [[False] * T for _ in range(B)], [[False] * T for _ in range(B)]
    for i in range(B):
        ones = [t for t in range(T) if mask[i][t]]
        pos = max(len(ones) - 1, 0) if outcome_at == "count" else (ones[-1] if ones else 0)
        for t in range(T):
            f1[i][t] = t == pos and bool(mask[i][t])
            ig[i][t] = bool(mask[i][t]) and not f1[i][t] and rewards[i][t] != 0

    def stats(sel):
        values = {}
        for i in range(B):
            for t in range(T):
                if sel[i][t]:
                    values.setdefault(uid[i], []).append(rewards[i][t])
        out = {}
        for g, vs in values.items():
            m = sum(vs) / len(vs)
            s = 1.0 if len(vs) <= 1 else (sum((v - m) ** 2 for v in vs) / len(vs) + 1e-8) ** 0.5
            out[g] = (m, s)
        return out

    normalised = [[0.0] * T for _ in range(B)]
    selections = [[[f1[i][t] or ig[i][t] for t in range(T)] for i in range(B)]] if mode == "joint" else [f1, ig]
    for sel in selections:
        st_ = stats(sel)
        for i in range(B):
            for t in range(T):
                if sel[i][t]:
                    m, s = st_[uid[i]]
                    normalised[i][t] = (rewards[i][t] - m) / (s + epsilon) if std else rewards[i][t] - m

    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        ends = [t for t in range(T) if normalised[i][t] != 0]
        values, following = [], 0.0
        for pos in reversed(ends):
            following = normalised[i][pos] + gamma * following
            values.append((pos, following))
        values.reverse()
        start = 0
        for pos, value in values:
            for t in range(start, pos + 1):
                if mask[i][t]:
                    out[i][t] = value
            start = pos + 1
    return torch.tensor(out, dtype=F64)


def reference_loss(logp, old_logp, advantages, mask, clip=0.2):
    """verl's vanilla PPO policy loss with ``token-mean`` (the reference's actor): −min(r·A, clip(r)·A), masked mean."""
    ratio = torch.exp(logp - old_logp)
    per_token = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - clip, 1 + clip) * advantages)
    return (per_token * mask).sum() / mask.sum()


# ---------------------------------------------------------------------------------------------------------------------
# Multi-turn rows, right-padded: turns of 1–3 action tokens, observations of 1–2 tokens between them


def rows_of(seed, groups=3, per_group=4, zero_gains=False, max_turns=4):
    """``(mask, rewards)`` lists per row: 1–``max_turns`` turns, an information gain U(−0.5, 0.5) on the last token of
    every turn but the last (exactly 0 with p 0.3 when ``zero_gains``: a turn that changed nothing, or the reference's
    padding of missing gains), the outcome (an F1 in {0, 0.5, 1}) on the last turn's last token."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(groups * per_group):
        turns = int(torch.randint(1, max_turns + 1, (1,), generator=gen))
        mask, rewards = [], []
        for k in range(turns):
            n = int(torch.randint(1, 4, (1,), generator=gen))
            if k == turns - 1:
                r = 0.5 * int(torch.randint(0, 3, (1,), generator=gen))
            elif zero_gains and float(torch.rand(1, generator=gen)) < 0.3:
                r = 0.0
            else:
                r = float(torch.rand(1, generator=gen)) - 0.5
            mask += [True] * n
            rewards += [0.0] * (n - 1) + [r]
            if k < turns - 1:
                o = int(torch.randint(1, 3, (1,), generator=gen))
                mask += [False] * o
                rewards += [0.0] * o
        rows.append((mask, rewards))
    return rows, per_group


def batch_of(rows, per_group, seed=0):
    T = max(len(m) for m, _ in rows) + 1
    B = len(rows)
    gen = torch.Generator().manual_seed(seed + 1)
    logp = -(0.1 + torch.rand(B, T, generator=gen, dtype=F64))
    return lossplug.PolicyBatch(
        logp=logp,
        old_logp=(logp + 0.3 * torch.randn(B, T, generator=gen, dtype=F64)).clamp(max=0),  # in and out of the clip
        action_mask=torch.tensor([m + [False] * (T - len(m)) for m, _ in rows]),
        reward=torch.tensor([r + [0.0] * (T - len(r)) for _, r in rows], dtype=F64),
        group_id=torch.arange(B) // per_group,
    )


def expected_of(batch, **kw):
    return reference_advantages(batch.reward.tolist(), batch.action_mask.tolist(), batch.group_id.tolist(), **kw)


def turn_runs(mask_row):
    runs, t = [], 0
    while t < len(mask_row):
        if mask_row[t]:
            s = t
            while t < len(mask_row) and mask_row[t]:
                t += 1
            runs.append((s, t))
        else:
            t += 1
    return runs


# ---------------------------------------------------------------------------------------------------------------------
# Against the reference


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "params",
    [{}, {"gamma": 0.9}, {"norm": "separate"}, {"norm": "separate", "gamma": 0.5}, {"std": False}, {"gamma": 0.0}],
    ids=["default", "gamma0.9", "separate", "separate_gamma0.5", "no_std", "gamma0"],
)
def test_matches_the_reference_advantage(seed, params):
    rows, G = rows_of(seed)
    batch = batch_of(rows, G, seed)
    got = lossplug.compute_advantages(batch, recipe(**params))
    kw = {"gamma": params.get("gamma", 1.0), "mode": params.get("norm", "joint"), "std": params.get("std", True)}
    expected = expected_of(batch, **kw)
    assert got.dtype == F64 and not got.requires_grad
    torch.testing.assert_close(got, expected, atol=1e-14, rtol=0)
    assert bool((got[~batch.action_mask] == 0).all())
    turns = [len(turn_runs(m)) for m, _ in rows]
    assert max(turns) >= 3 and min(turns) == 1


@pytest.mark.parametrize("norm", ["joint", "separate"])
@pytest.mark.parametrize("seed", [4, 5])
def test_exact_zero_gains_are_left_out_as_the_reference_leaves_them_out(seed, norm):
    """A turn whose information gain is exactly 0 counts in no statistic and is normalised to 0 (γ = 1: the
    reference's merging of such a turn into the next gives the same values)."""
    rows, G = rows_of(seed, zero_gains=True)
    batch = batch_of(rows, G, seed)
    assert bool(((batch.reward == 0) & batch.action_mask).any())
    got = lossplug.compute_advantages(batch, recipe(norm=norm))
    torch.testing.assert_close(got, expected_of(batch, mode=norm), atol=1e-14, rtol=0)


def test_a_zero_gain_turn_is_its_own_turn_where_the_reference_merges_it_into_the_next():
    """The documented difference at γ < 1: turn 1 of row 0 gains exactly 0 (normalised 0); here it gets γ·A(turn 2),
    the reference — reading turns off the nonzero normalised rewards — gives its tokens A(turn 2)."""
    batch = lossplug.PolicyBatch(
        logp=torch.zeros(2, 6, dtype=F64),
        action_mask=torch.tensor([[1, 1, 0, 1, 0, 1], [1, 0, 0, 0, 0, 0]], dtype=torch.bool),
        reward=torch.tensor([[0.0, 0.0, 0.0, 0.4, 0.0, 1.0], [0.5, 0, 0, 0, 0, 0]], dtype=F64),
        group_id=torch.zeros(2, dtype=torch.long),
    )
    got = lossplug.compute_advantages(batch, recipe(gamma=0.5))
    literal = expected_of(batch, gamma=0.5)
    torch.testing.assert_close(got[0, 3:], literal[0, 3:], atol=1e-15, rtol=0)
    torch.testing.assert_close(got[1], literal[1], atol=1e-15, rtol=0)
    torch.testing.assert_close(got[0, :2], 0.5 * got[0, 3].expand(2), atol=1e-15, rtol=0)  # γ·A(turn 2)
    torch.testing.assert_close(literal[0, :2], literal[0, 3].expand(2), atol=1e-15, rtol=0)  # A(turn 2) itself
    assert abs(float(got[0, 3])) > 0.05
    g1 = lossplug.compute_advantages(batch, recipe(gamma=1.0))
    torch.testing.assert_close(g1, expected_of(batch, gamma=1.0), atol=1e-15, rtol=0)  # γ = 1: the same


def test_the_references_literal_outcome_position_on_rows_without_holes():
    """One turn per row, left-aligned: the mask's count − 1 (the reference's ``f1_mask``) is the last action token."""
    rows, G = rows_of(7, max_turns=1)
    batch = batch_of(rows, G, 7)
    got = lossplug.compute_advantages(batch, recipe())
    torch.testing.assert_close(got, expected_of(batch, outcome_at="count"), atol=1e-14, rtol=0)
    # ... which is an outcome-only group normalisation: (R − mean) / (population std (+1e-8 under the root) + 1e-6)
    R = batch.reward.sum(-1)
    g = batch.group_id
    mean = torch.stack([R[g == k].mean() for k in g.tolist()])
    std = torch.stack([(R[g == k].var(unbiased=False) + 1e-8).sqrt() for k in g.tolist()])
    one_turn = ((R - mean) / (std + 1e-6)).unsqueeze(-1).expand_as(got)
    m = batch.action_mask
    torch.testing.assert_close(got[m], one_turn[m], atol=1e-14, rtol=0)


def test_loss_and_gradient_through_ppo_clip_with_token_reduction():
    rows, G = rows_of(11)
    batch = batch_of(rows, G, 11)
    adv = lossplug.compute_advantages(batch, recipe(gamma=0.9))
    logp = batch.logp.clone().requires_grad_()
    result = lossplug.policy_loss(batch.replace(logp=logp, advantage=adv), recipe(gamma=0.9))
    result.loss.backward()
    reference = batch.logp.clone().requires_grad_()
    mask = batch.action_mask.to(F64)
    expected = reference_loss(reference, batch.old_logp, expected_of(batch, gamma=0.9), mask)
    expected.backward()
    ratio = torch.exp(batch.logp - batch.old_logp)[batch.action_mask]
    assert bool(((ratio < 0.8) | (ratio > 1.2)).any()) and bool(((ratio > 0.8) & (ratio < 1.2)).any())
    torch.testing.assert_close(result.loss, expected, atol=1e-14, rtol=0)
    torch.testing.assert_close(logp.grad, reference.grad, atol=1e-14, rtol=0)


def test_the_worked_example():
    """Group: a search with gain 0.3, then a right answer (1); a direct wrong answer (0). Joint population {0.3, 1, 0}:
    mean 13/30, population std sqrt(0.17556 + 1e-8); the first turn gets r̂(0.3) + r̂(1), the answer r̂(1)."""
    batch = lossplug.PolicyBatch(
        logp=torch.zeros(2, 5, dtype=F64),
        action_mask=torch.tensor([[1, 1, 0, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool),
        reward=torch.tensor([[0.0, 0.3, 0.0, 1.0, 0.0], [0.0] * 5], dtype=F64),
        group_id=torch.zeros(2, dtype=torch.long),
    )
    mean = (0.3 + 1.0 + 0.0) / 3
    s = ((((0.3 - mean) ** 2 + (1 - mean) ** 2 + mean**2) / 3) + 1e-8) ** 0.5 + 1e-6
    a1, a2, b = (0.3 - mean) / s, (1 - mean) / s, (0 - mean) / s
    expected = torch.tensor([[a1 + a2, a1 + a2, 0, a2, 0], [b, b, 0, 0, 0]], dtype=F64)
    torch.testing.assert_close(lossplug.compute_advantages(batch, recipe()), expected, atol=1e-15, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# Properties


@settings(deadline=None)
@given(
    seed=st.integers(0, 2**20),
    gamma=st.floats(0.0, 1.0),
    norm=st.sampled_from(["joint", "separate"]),
    shift=st.floats(-3.0, 3.0),
)
def test_order_shift_and_turn_structure(seed, gamma, norm, shift):
    rows, G = rows_of(seed, groups=2, per_group=3)
    batch = batch_of(rows, G, seed)
    params = {"gamma": gamma, "norm": norm}
    adv = lossplug.compute_advantages(batch, recipe(**params))
    mask, B = batch.action_mask, batch.action_mask.shape[0]
    assert_row_order_changes_nothing(batch, recipe(**params), adv, seed)
    # a constant added to every turn reward of group 0 changes nothing (no gain is shifted onto exactly 0 here)
    ends = mask & ~torch.nn.functional.pad(mask[:, 1:], (0, 1), value=False)
    shifted_reward = batch.reward + shift * (ends & (batch.group_id == 0).unsqueeze(-1))
    if bool((shifted_reward[ends] != 0).all()) or shift == 0:
        shifted = batch.replace(reward=shifted_reward)
        torch.testing.assert_close(
            lossplug.compute_advantages(shifted, recipe(**params)), adv, atol=1e-9 * (1 + abs(shift)), rtol=0
        )
    # every token of a turn carries one value
    for b in range(B):
        for s, e in turn_runs(mask[b].tolist()):
            assert float(adv[b, s:e].max() - adv[b, s:e].min()) <= 1e-12


@settings(deadline=None)
@given(seed=st.integers(0, 2**20))
def test_first_turns_sum_to_zero_at_gamma_1_and_gamma_0_is_the_turns_own_reward(seed):
    rows, G = rows_of(seed, groups=2, per_group=3)
    batch = batch_of(rows, G, seed)
    mask = batch.action_mask
    first = [turn_runs(mask[b].tolist())[0][0] for b in range(mask.shape[0])]
    adv = lossplug.compute_advantages(batch, recipe())
    for g in range(2):
        total = sum(float(adv[b, first[b]]) for b in range(mask.shape[0]) if int(batch.group_id[b]) == g)
        assert abs(total) <= 1e-10  # Σ over the group of every normalised reward is 0 (all gains nonzero here)
    own = lossplug.compute_advantages(batch, recipe(gamma=0.0))
    later = lossplug.compute_advantages(batch, recipe(gamma=1.0))
    for b in range(mask.shape[0]):
        runs = turn_runs(mask[b].tolist())
        values = [float(own[b, s]) for s, _ in runs]
        # at γ = 1 a turn's value is the sum of its own and the later turns' normalised rewards
        for k, (s, _) in enumerate(runs):
            assert float(later[b, s]) == pytest.approx(sum(values[k:]), abs=1e-12)


@settings(deadline=None)
@given(seed=st.integers(0, 2**20))
def test_a_turns_reward_may_sit_on_any_of_its_tokens_and_a_row_score_is_the_outcome(seed):
    rows, G = rows_of(seed, groups=2, per_group=3)
    batch = batch_of(rows, G, seed)
    adv = lossplug.compute_advantages(batch, recipe(gamma=0.7))
    mask = batch.action_mask
    moved = batch.reward.clone()
    for b in range(mask.shape[0]):
        for s, e in turn_runs(mask[b].tolist()):  # the turn's reward moves from its last token to its first
            total = float(moved[b, s:e].sum())
            moved[b, s:e] = 0
            moved[b, s] = total
    torch.testing.assert_close(
        lossplug.compute_advantages(batch.replace(reward=moved), recipe(gamma=0.7)), adv, atol=1e-12, rtol=0
    )
    # one score per row is the outcome on the row's last action token (no information gain)
    last = mask & (mask.flip(-1).cumsum(-1).flip(-1) == 1)
    outcome = torch.where(last, batch.reward, 0)
    torch.testing.assert_close(
        lossplug.compute_advantages(batch.replace(reward=outcome.sum(-1)), recipe()),
        lossplug.compute_advantages(batch.replace(reward=outcome), recipe()),
        atol=1e-12,
        rtol=0,
    )


def test_groups_of_equal_outcomes_without_gains_and_of_one_row_get_zero():
    rows, G = rows_of(5, max_turns=1)
    batch = batch_of(rows, G, 5)
    assert_equal_rewards_and_lone_rows_get_zero(batch, recipe())


# ---------------------------------------------------------------------------------------------------------------------
# Bad input, named


def test_bad_input_is_refused_by_name():
    rows, G = rows_of(3)
    batch = batch_of(rows, G, 3)
    assert_bad_turn_batches_are_refused_by_name(batch, recipe())
    mask = batch.action_mask
    nan = batch.reward.clone()
    nan[2, int(mask[2].nonzero()[-1])] = float("nan")
    with pytest.raises(lossplug.BatchValidationError, match="reward"):
        lossplug.compute_advantages(batch.replace(reward=nan), recipe())
    for bad in ({"gamma": 1.5}, {"gamma": -0.1}, {"eps": -1e-6}, {"norm": "per_turn"}, {"turns": 2}):
        with pytest.raises(lossplug.RecipeError, match="igpo"):
            recipe(**bad)
