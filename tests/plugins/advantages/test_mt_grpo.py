"""``mt_grpo``: against MT-GRPO's reference code transcribed loop by loop in float64 (SiliangZeng/Multi-Turn-RL-Agent,
commit 7dbdd08bdb27810019bc1511dbd0af3c7cfaac7a, on no package index): ``_compute_normalized_advantages`` (the group's
mean and torch's sample std, ``+ 1e-4``), ``_find_result_positions`` (the first user message holding ``<result>``),
``_assign_advantages`` (the segment boundaries of the completion mask; outcome advantage everywhere plus λ times the
turn advantage before the result, the combined advantage without one) and ``compute_loss`` (``−min(r·A,
clip(r)·A)`` summed over the mask, divided by its count: PPO's clip with token reduction), loss and gradient.
Properties (hypothesis): the rows' order changes nothing, a constant added to every outcome of a group changes
nothing, a turn's reward may sit on any of its tokens, every later turn carries the same value and the first turn
differs from it by λ·Â_T, a one-turn batch is GRPO with eps 1e-4. Bad input is refused by name.

The rows are conversations the way the reference tokenises them: an assistant message (action tokens), then a
user message with the tool's ``<result>`` (observation tokens), then the answer; or the answer alone (the model
called no tool); right-padded. The turn reward sits on the first turn's last token, the outcome on the last turn's.
Measured: advantages ≤ 2.3e-16 abs from the transcription, loss and gradient ≤ 1.4e-17.
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
        {"advantage": {"name": "mt_grpo", **params}, "gates": ["ppo_clip"], "reduction": "token"}
    )


# ---------------------------------------------------------------------------------------------------------------------
# The reference, transcribed (float64, loops; groups are contiguous blocks of num_generations rows, as there)


def reference_normalized(rewards, num_generations):
    """``GRPOEnvTrainer._compute_normalized_advantages``: (r − mean) / (std + 1e-4) per block of the group size."""
    out = []
    for start in range(0, len(rewards), num_generations):
        block = rewards[start : start + num_generations]
        mean = sum(block) / len(block)
        std = (sum((r - mean) ** 2 for r in block) / (len(block) - 1)) ** 0.5  # torch's .std(): Bessel-corrected
        out += [(r - mean) / (std + 1e-4) for r in block]
    return out


def reference_result_positions(conversations):
    """``MTGRPOEnvTrainer._find_result_positions``: the index of the first user message with a ``<result>`` that
    follows an assistant message, or -1."""
    positions = []
    for messages in conversations:
        found = -1
        for j, msg in enumerate(messages):
            if msg["role"] == "assistant" and j + 1 < len(messages) and messages[j + 1]["role"] == "user":
                if "<result>" in messages[j + 1]["content"]:
                    found = j + 1
                    break
        positions.append(found)
    return positions


def reference_assign(mask, turn_adv, outcome_adv, combined_adv, result_positions, coef):
    """``MTGRPOEnvTrainer._assign_advantages``, loop by loop."""
    B, T = len(mask), len(mask[0])
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        row = mask[i]
        if result_positions[i] > 0:
            boundaries = [0] + [j for j in range(1, T) if row[j] != row[j - 1]] + [T]
            split = boundaries[result_positions[i]]
            for t in range(T):
                before = 1.0 if (t < split and row[t]) else 0.0
                out[i][t] = outcome_adv[i] + coef * turn_adv[i] * before
        else:
            for t in range(T):
                out[i][t] = combined_adv[i]
    return out


def reference_loss(logp, old_logp, advantages, mask, eps=0.2):
    """``MTGRPOEnvTrainer.compute_loss`` with beta 0 and num_iterations > 1 (the old log-probs are the rollout's)."""
    coef_1 = torch.exp(logp - old_logp)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    return (per_token_loss * mask).sum() / mask.sum()


# ---------------------------------------------------------------------------------------------------------------------
# Conversations, and the batch this plugin reads from them


def conversations(seed, groups=3, per_group=4):
    """Each row: (messages, token lengths per message, turn reward, outcome reward). A row that calls the tool has
    turn reward in {0, 0.1, 0.2} (the reference's tool-execution score) plus noise; one that answers at once has 0
    (the reference's turn functions give 0 without a tool call)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(groups * per_group):
        tool = bool(torch.rand(1, generator=gen) < 0.6)
        lengths = [int(torch.randint(1, 4, (1,), generator=gen)) for _ in range(3 if tool else 1)]
        if tool:
            messages = [
                {"role": "assistant", "content": "<tool>search</tool>"},
                {"role": "user", "content": "<result>…</result>"},
                {"role": "assistant", "content": "<answer>…</answer>"},
            ]
            turn = 0.1 * int(torch.randint(0, 3, (1,), generator=gen)) + 0.01 * float(torch.randn(1, generator=gen))
        else:
            messages = [{"role": "assistant", "content": "<answer>…</answer>"}]
            turn = 0.0
        outcome = float(torch.randint(0, 2, (1,), generator=gen)) + 0.1 * float(torch.rand(1, generator=gen))
        rows.append((messages, lengths, turn, outcome))
    return rows, per_group


def batch_of(rows, seed=0):
    masks, rewards = [], []
    for messages, lengths, turn, outcome in rows:
        m, r = [], []
        assistant_turns = [k for k, msg in enumerate(messages) if msg["role"] == "assistant"]
        for k, (msg, n) in enumerate(zip(messages, lengths)):
            m += [msg["role"] == "assistant"] * n
            value = 0.0
            if k == assistant_turns[-1]:
                value = outcome + (turn if len(assistant_turns) == 1 else 0.0)
            elif k == assistant_turns[0]:
                value = turn
            r += [0.0] * (n - 1) + [value if msg["role"] == "assistant" else 0.0]
        masks.append(m)
        rewards.append(r)
    T = max(len(m) for m in masks) + 1
    gen = torch.Generator().manual_seed(seed)
    B = len(rows)
    logp = -(0.1 + torch.rand(B, T, generator=gen, dtype=F64))
    return masks, lossplug.PolicyBatch(
        logp=logp,
        old_logp=(logp + 0.3 * torch.randn(B, T, generator=gen, dtype=F64)).clamp(
            max=0
        ),  # ratios in and out of the clip
        action_mask=torch.tensor([m + [False] * (T - len(m)) for m in masks]),
        reward=torch.tensor([r + [0.0] * (T - len(r)) for r in rewards], dtype=F64),
        group_id=torch.arange(B) // 4,
    )


def reference_advantages(rows, num_generations, mask, coef=1.0):
    turn = [t for _, _, t, _ in rows]
    outcome = [o for _, _, _, o in rows]
    combined = [t + o for t, o in zip(turn, outcome)]  # combined_reward_funcs = turn + outcome functions
    adv = reference_assign(
        mask.tolist(),
        reference_normalized(turn, num_generations),
        reference_normalized(outcome, num_generations),
        reference_normalized(combined, num_generations),
        reference_result_positions([messages for messages, *_ in rows]),
        coef,
    )
    return torch.tensor(adv, dtype=F64)


# ---------------------------------------------------------------------------------------------------------------------
# Against the reference


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("coef", [1.0, 0.5, 0.0, 2.0])
def test_matches_the_reference_assign_advantages(seed, coef):
    rows, G = conversations(seed)
    _, batch = batch_of(rows, seed)
    got = lossplug.compute_advantages(batch, recipe(turn_coef=coef))
    expected = reference_advantages(rows, G, batch.action_mask, coef)
    mask = batch.action_mask
    assert got.dtype == F64 and not got.requires_grad
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-14, rtol=0)
    assert bool((got[~mask] == 0).all())


def test_loss_and_gradient_through_ppo_clip_with_token_reduction():
    rows, G = conversations(11)
    _, batch = batch_of(rows, 11)
    adv = lossplug.compute_advantages(batch, recipe())
    logp = batch.logp.clone().requires_grad_()
    result = lossplug.policy_loss(batch.replace(logp=logp, advantage=adv), recipe())
    result.loss.backward()
    reference = batch.logp.clone().requires_grad_()
    mask = batch.action_mask.to(F64)
    # the reference's advantages are defined on every position; its loss multiplies by the completion mask
    expected = reference_loss(reference, batch.old_logp, reference_advantages(rows, G, batch.action_mask), mask)
    expected.backward()
    ratio = torch.exp(batch.logp - batch.old_logp)[batch.action_mask]
    assert bool(((ratio < 0.8) | (ratio > 1.2)).any()) and bool(((ratio > 0.8) & (ratio < 1.2)).any())
    torch.testing.assert_close(result.loss, expected, atol=1e-14, rtol=0)
    torch.testing.assert_close(logp.grad, reference.grad, atol=1e-14, rtol=0)


def test_the_worked_example():
    """Group: a tool call rewarded 0.2 then a right answer (1); a direct answer (0). R_T = [0.2, 0], R_O = [1, 0],
    R_C = [1.2, 0]: Â = ±0.1/(0.1414 + 1e-4), ±0.5/(0.7071 + 1e-4), ±0.6/(0.8485 + 1e-4)."""
    batch = lossplug.PolicyBatch(
        logp=torch.zeros(2, 5, dtype=F64),
        action_mask=torch.tensor([[1, 1, 0, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool),
        reward=torch.tensor([[0.0, 0.2, 0.0, 1.0, 0.0], [0.0] * 5], dtype=F64),
        group_id=torch.zeros(2, dtype=torch.long),
    )
    a_t = 0.1 / (0.02**0.5 + 1e-4)
    a_o = 0.5 / (0.5**0.5 + 1e-4)
    a_c = 0.6 / (0.72**0.5 + 1e-4)
    expected = torch.tensor([[a_o + a_t, a_o + a_t, 0, a_o, 0], [-a_c, -a_c, 0, 0, 0]], dtype=F64)
    torch.testing.assert_close(lossplug.compute_advantages(batch, recipe()), expected, atol=1e-15, rtol=0)


def test_stopping_selects_the_baseline_the_bias_rfc_7244_warns_of():
    """Two rows of the same rewards (no turn reward, outcome 1): the one that called a tool gets Â_O on its first
    turn, the one that answered at once Â_C — the turn count the policy chose picks the baseline (verl RFC #7244's
    action-dependent baseline). Group: tool, 1 | answer, 1 | tool with turn reward 0.2, 0 | answer, 0."""
    mask = torch.tensor([[1, 0, 1], [1, 0, 0], [1, 0, 1], [1, 0, 0]], dtype=torch.bool)
    reward = torch.tensor([[0, 0, 1.0], [1.0, 0, 0], [0.2, 0, 0], [0, 0, 0]], dtype=F64)
    batch = lossplug.PolicyBatch(
        logp=torch.zeros(4, 3, dtype=F64), action_mask=mask, reward=reward, group_id=torch.zeros(4, dtype=torch.long)
    )
    adv = lossplug.compute_advantages(batch, recipe())

    def norm(x, i):
        x = torch.tensor(x, dtype=F64)
        return float((x[i] - x.mean()) / (x.std() + 1e-4))

    turn, outcome, combined = [0, 0, 0.2, 0], [1, 1, 0, 0], [1, 1, 0.2, 0]
    assert float(adv[0, 0]) == pytest.approx(norm(outcome, 0) + norm(turn, 0), abs=1e-14)
    assert float(adv[1, 0]) == pytest.approx(norm(combined, 1), abs=1e-14)
    assert (
        abs(float(adv[0, 0]) - float(adv[1, 0])) > 0.4
    )  # same rewards, different advantage: only the stopping differs


# ---------------------------------------------------------------------------------------------------------------------
# Properties


def random_batch(seed, groups=2, per_group=3):
    rows, _ = conversations(seed, groups, per_group)
    _, batch = batch_of(rows, seed)
    return batch.replace(group_id=torch.arange(len(rows)) // per_group)


@settings(deadline=None)
@given(seed=st.integers(0, 2**20), coef=st.floats(0.0, 3.0), shift=st.floats(-5.0, 5.0))
def test_order_outcome_shift_and_turn_structure(seed, coef, shift):
    batch = random_batch(seed)
    params = {"turn_coef": coef}
    adv = lossplug.compute_advantages(batch, recipe(**params))
    mask, B = batch.action_mask, batch.action_mask.shape[0]
    assert_row_order_changes_nothing(batch, recipe(**params), adv, seed)
    # a constant added to every outcome of group 0 (on each row's last action token) changes nothing
    last = mask & (mask.flip(-1).cumsum(-1).flip(-1) == 1)
    shifted = batch.replace(reward=batch.reward + shift * (last & (batch.group_id == 0).unsqueeze(-1)))
    torch.testing.assert_close(
        lossplug.compute_advantages(shifted, recipe(**params)), adv, atol=1e-9 * (1 + abs(shift)), rtol=0
    )
    # the turn structure: every later turn carries one value; the first turn differs from it by λ·Â_T
    turn_only = []
    for b in range(B):
        starts = [t for t in range(mask.shape[1]) if mask[b, t] and (t == 0 or not mask[b, t - 1])]
        values = [float(adv[b, t]) for t in range(mask.shape[1]) if mask[b, t] and t >= starts[-1]]
        if len(starts) > 1:
            assert max(values) - min(values) <= 1e-12
            turn_only.append((b, float(adv[b, starts[0]]) - values[0]))
        else:
            first = [float(adv[b, t]) for t in range(mask.shape[1]) if mask[b, t]]
            assert max(first) - min(first) <= 1e-12
    if coef == 0:
        assert all(abs(d) <= 1e-12 for _, d in turn_only)


@settings(deadline=None)
@given(seed=st.integers(0, 2**20))
def test_a_turns_reward_may_sit_on_any_of_its_tokens(seed):
    batch = random_batch(seed)
    adv = lossplug.compute_advantages(batch, recipe())
    mask = batch.action_mask
    moved = batch.reward.clone()
    for b in range(mask.shape[0]):
        starts = [t for t in range(mask.shape[1]) if mask[b, t] and (t == 0 or not mask[b, t - 1])]
        for s in starts:  # the turn's reward moves from its last token to its first
            end = s
            while end + 1 < mask.shape[1] and mask[b, end + 1]:
                end += 1
            total = float(moved[b, s : end + 1].sum())
            moved[b, s : end + 1] = 0
            moved[b, s] = total
    torch.testing.assert_close(
        lossplug.compute_advantages(batch.replace(reward=moved), recipe()), adv, atol=1e-12, rtol=0
    )


@settings(deadline=None)
@given(seed=st.integers(0, 2**20))
def test_one_score_per_row_or_one_turn_per_row_is_grpo_with_eps_1e_4(seed):
    batch = random_batch(seed)
    grpo = lossplug.Recipe.model_validate(
        {"advantage": {"name": "grpo", "eps": 1e-4}, "gates": ["ppo_clip"], "reduction": "token"}
    )
    row_scores = batch.replace(reward=batch.reward.sum(-1))
    expected = lossplug.compute_advantages(row_scores, grpo)
    got = lossplug.compute_advantages(row_scores, recipe())
    mask = batch.action_mask
    torch.testing.assert_close(got[mask], expected.unsqueeze(-1).expand_as(got)[mask], atol=1e-12, rtol=0)
    first = mask & (mask.cumsum(-1) == torch.arange(1, mask.shape[1] + 1))  # each row's first turn only
    one_turn = batch.replace(action_mask=first, reward=torch.where(first, batch.reward, 0))
    got = lossplug.compute_advantages(one_turn, recipe())
    expected = lossplug.compute_advantages(one_turn.replace(reward=one_turn.reward.sum(-1)), grpo)
    m = one_turn.action_mask
    torch.testing.assert_close(got[m], expected.unsqueeze(-1).expand_as(got)[m], atol=1e-12, rtol=0)


def test_groups_of_equal_rewards_and_of_one_row_get_zero():
    """The reference: 0 / (0 + 1e-4) = 0 for equal rewards; NaN for a group of one row (torch's std of one value),
    0 here."""
    batch = random_batch(5)
    assert_equal_rewards_and_lone_rows_get_zero(batch, recipe())


# ---------------------------------------------------------------------------------------------------------------------
# Bad input, named


def test_bad_input_is_refused_by_name():
    batch = random_batch(3)
    assert_bad_turn_batches_are_refused_by_name(batch, recipe())
    for bad in ({"turn_coef": -1.0}, {"eps": -1e-4}, {"turns": 2}):
        with pytest.raises(lossplug.RecipeError, match="mt_grpo"):
            recipe(**bad)
