"""What the multi-turn advantage tests share: ``step_reinforce`` and ``gigpo`` draw the same interleaved episodes
(one row per step), ``step_reinforce`` and ``agentic_reinforce`` check the loss and gradient of a REINFORCE recipe
against their transcribed advantage; ``igpo`` and ``mt_grpo`` check that the rows' order changes nothing, that equal rewards and lone rows get 0, and that
bad batches are refused by name."""

from __future__ import annotations

import pytest
import torch

import lossplug


def episode_rows(gen: torch.Generator, groups: int, per_group: int, anchors: bool = False) -> list[tuple]:
    """Rows ``(group, trajectory, step, anchor, reward)``, episode after episode: ``per_group`` episodes of 1–4 steps
    per prompt group, the last step's reward 0 or 1 (p 0.5), an earlier step's 0.1·N(0, 1). With ``anchors`` a step
    after the first shares the anchor state of its step index with p 0.6 and has one of its own otherwise; without,
    every anchor is the step index and no draw is spent on it."""
    rows: list[tuple] = []
    trajectory = 0
    for g in range(groups):
        for _ in range(per_group):
            length = int(torch.randint(1, 5, (1,), generator=gen))
            for t in range(length):
                shared = not anchors or t == 0 or float(torch.rand(1, generator=gen)) < 0.6
                anchor = t if shared else 1000 + len(rows)
                last = t == length - 1
                r = float(torch.rand(1, generator=gen) < 0.5) if last else 0.1 * float(torch.randn(1, generator=gen))
                rows.append((g, trajectory, t, anchor, r))
            trajectory += 1
    return rows


def interleave(rows: list[tuple], keys: torch.Tensor) -> list[tuple]:
    """The rows sorted by step index, then by ``keys`` (one random key per row): the episodes interleaved, the time
    order within each trajectory kept."""
    order = sorted(range(len(rows)), key=lambda i: (rows[i][2], float(keys[i])))
    return [rows[i] for i in order]


def split_last_trajectory_over_two_groups(batch: lossplug.PolicyBatch) -> torch.Tensor:
    """The batch's ``group_id`` with the first step of its last row's trajectory moved into the next of three
    groups, so that this trajectory spans two groups."""
    group = batch.group_id.clone()
    first = int((batch.trajectory_id == batch.trajectory_id[-1]).nonzero()[0])
    group[first] = (group[first] + 1) % 3
    return group


def assert_reinforce_loss_and_gradient(
    batch: lossplug.PolicyBatch, recipe: lossplug.Recipe, expected_advantage: torch.Tensor
) -> None:
    """lossplug's loss and gradient of ``recipe`` (its advantage, the ``reinforce`` gate, the token reduction) on
    ``batch`` equal REINFORCE's −Σ A·log π / Σ mask with the transcribed ``[B, T]`` advantage (1e-12)."""
    adv = lossplug.compute_advantages(batch, recipe)
    logp = batch.logp.clone().requires_grad_()
    result = lossplug.policy_loss(batch.replace(logp=logp, advantage=adv), recipe)
    result.loss.backward()
    reference = batch.logp.clone().requires_grad_()
    expected = -(expected_advantage * reference * batch.action_mask).sum() / batch.action_mask.sum()
    expected.backward()
    torch.testing.assert_close(result.loss, expected, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(logp.grad, reference.grad, atol=1e-12, rtol=1e-12)


def assert_row_order_changes_nothing(
    batch: lossplug.PolicyBatch, recipe: lossplug.Recipe, adv: torch.Tensor, seed: int
) -> None:
    """The advantages of ``batch``'s rows shuffled (a permutation drawn from ``seed``) are ``adv`` shuffled alike
    (1e-12): the estimator reads no row order."""
    perm = torch.randperm(batch.action_mask.shape[0], generator=torch.Generator().manual_seed(seed))
    shuffled = batch.replace(
        logp=batch.logp[perm],
        old_logp=batch.old_logp[perm],
        action_mask=batch.action_mask[perm],
        reward=batch.reward[perm],
        group_id=batch.group_id[perm],
    )
    torch.testing.assert_close(lossplug.compute_advantages(shuffled, recipe), adv[perm], atol=1e-12, rtol=0)


def assert_equal_rewards_and_lone_rows_get_zero(batch: lossplug.PolicyBatch, recipe: lossplug.Recipe) -> None:
    """Every reward 0 (equal in each group, no turn reward): every advantage exactly 0; every row its own group: every
    advantage exactly 0."""
    equal = batch.replace(reward=torch.where(batch.action_mask, 0.0, 0.0).to(torch.float64))
    assert bool((lossplug.compute_advantages(equal, recipe) == 0).all())
    alone = batch.replace(group_id=torch.arange(batch.action_mask.shape[0]))
    assert bool((lossplug.compute_advantages(alone, recipe) == 0).all())


def assert_bad_turn_batches_are_refused_by_name(batch: lossplug.PolicyBatch, recipe: lossplug.Recipe) -> None:
    """A turn reward on an observation or padding token (the error names the field, the rule and the position), a
    row without an action token, and a batch without ``group_id`` are refused."""
    mask = batch.action_mask
    row, col = 0, int((~mask[0]).nonzero()[0])  # an observation or padding position of row 0
    off = batch.reward.clone()
    off[row, col] = 0.5  # a turn reward put on an observation token
    with pytest.raises(lossplug.BatchValidationError, match=r"reward.*0 off the action positions") as err:
        lossplug.compute_advantages(batch.replace(reward=off), recipe)
    assert f"(row {row}, pos {col})" in str(err.value)
    no_turns = mask.clone()
    no_turns[1] = False
    with pytest.raises(lossplug.BatchValidationError, match="at least one action token"):
        lossplug.compute_advantages(
            batch.replace(action_mask=no_turns, reward=torch.where(no_turns, batch.reward, 0)), recipe
        )
    with pytest.raises(lossplug.BatchValidationError, match="group_id"):
        lossplug.compute_advantages(batch.replace(group_id=None), recipe)
