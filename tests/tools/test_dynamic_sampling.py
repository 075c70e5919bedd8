"""DAPO dynamic sampling (arXiv:2503.14476): the mixed-group rule on scattered groups, and the full cost report."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lossplug import LossplugError
from lossplug.tools.dynamic_sampling import SamplingCost, difficulty_buckets, keep_mixed_groups

DAPO_REWARD = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])


def test_worked_example_prompt_rollout_layout():
    keep, report = keep_mixed_groups(DAPO_REWARD)
    assert keep.tolist() == [False, True, False, True]
    kept = DAPO_REWARD[keep]
    assert torch.all(kept.std(1, unbiased=False) > 0)
    assert kept.numel() < DAPO_REWARD.numel()
    assert (report.generated_groups, report.retained_groups) == (4, 2)
    assert (report.generated_sequences, report.retained_sequences) == (12, 6)
    assert report.generated_tokens is None and report.token_retention is None


def test_worked_example_scattered_by_group_id():
    perm = torch.tensor([7, 2, 10, 0, 5, 11, 3, 8, 1, 6, 4, 9])
    group_id = torch.arange(4).repeat_interleave(3)[perm] * 10 + 3  # arbitrary ids, rows shuffled
    reward = DAPO_REWARD.reshape(-1)[perm]
    keep, report = keep_mixed_groups(reward, group_id)
    expected_groups = {3 + 10 * g for g in (1, 3)}
    assert keep.tolist() == [int(g) in expected_groups for g in group_id]
    assert report.retained_sequences == 6


def test_unequal_groups_and_singletons():
    group_id = torch.tensor([5, 9, 5, 2, 9, 9, 7, 2])
    reward = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    lengths = torch.tensor([3, 4, 5, 6, 7, 8, 9, 10])
    keep, report = keep_mixed_groups(reward, group_id, lengths=lengths)
    # group 5: [1, 0] mixed; 9: [0, 0, 0] all wrong; 2: [1, 1] all right; 7: singleton, constant
    assert keep.tolist() == [True, False, True, False, False, False, False, False]
    assert report.generated_tokens == 52 and report.retained_tokens == 8 and report.rejected_tokens == 44
    assert report.token_retention == pytest.approx(8 / 52)
    b = report.by_difficulty
    assert list(b) == ["all_wrong", "mixed_0-25", "mixed_25-50", "mixed_50-75", "mixed_75-100", "all_right"]
    assert (b["all_wrong"].groups, b["all_wrong"].tokens, b["all_wrong"].retention) == (1, 19, 0.0)
    assert (b["all_right"].groups, b["all_right"].sequences, b["all_right"].tokens) == (2, 3, 25)  # 2 + singleton 7
    assert (b["mixed_25-50"].groups, b["mixed_25-50"].retained_groups, b["mixed_25-50"].retention) == (1, 1, 1.0)
    assert b["mixed_0-25"].retention is None  # empty bucket: no rate, not 0%


def test_action_mask_counts_tokens_like_lengths():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(6, 9, generator=g) < 0.5
    reward = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    group_id = torch.tensor([0, 0, 1, 1, 2, 2])
    a = keep_mixed_groups(reward, group_id, action_mask=mask).report
    b = keep_mixed_groups(reward, group_id, lengths=mask.sum(-1)).report
    assert a == b and a.generated_tokens == int(mask.sum())


def test_plus_minus_one_rewards_and_difficulty_bins():
    # 8 rollouts per prompt with pass counts 0, 1, 2, 3, 6, 8 under a {−1, 1} verifier
    passes = [0, 1, 2, 3, 6, 8]
    reward = torch.tensor([[1.0] * p + [-1.0] * (8 - p) for p in passes])
    keep, report = keep_mixed_groups(reward)
    assert keep.tolist() == [False, True, True, True, True, False]
    groups = {k: v.groups for k, v in report.by_difficulty.items()}
    assert groups == {
        "all_wrong": 1,
        "mixed_0-25": 2,
        "mixed_25-50": 1,
        "mixed_50-75": 1,
        "mixed_75-100": 0,
        "all_right": 1,
    }
    assert difficulty_buckets(2) == ["all_wrong", "mixed_0-50", "mixed_50-100", "all_right"]
    assert list(keep_mixed_groups(reward, bins=2).report.by_difficulty) == difficulty_buckets(2)


def test_graded_rewards_mixed_but_all_pass_is_kept_in_all_right():
    keep, report = keep_mixed_groups(torch.tensor([[0.6, 0.9], [0.7, 0.7]]))
    assert keep.tolist() == [True, False]
    assert report.by_difficulty["all_right"].retained_groups == 1


def test_integer_rewards():
    keep, _ = keep_mixed_groups(DAPO_REWARD.long())
    assert keep.tolist() == [False, True, False, True]


def test_merge_reports_the_cost_of_every_round():
    r1 = keep_mixed_groups(DAPO_REWARD, lengths=torch.full((4, 3), 10), generation_seconds=2.0).report
    r2 = keep_mixed_groups(
        torch.tensor([[0.0, 1.0], [1.0, 1.0]]), lengths=torch.full((2, 2), 5), generation_seconds=1.5
    ).report
    total = r1 + r2
    assert total.rounds == 2
    assert (total.generated_groups, total.retained_groups) == (6, 3)
    assert (total.generated_tokens, total.retained_tokens, total.rejected_tokens) == (140, 70, 70)
    assert total.generation_seconds == 3.5
    assert total.by_difficulty["all_right"].groups == 2
    assert sum(b.groups for b in total.by_difficulty.values()) == total.generated_groups
    no_tokens = keep_mixed_groups(DAPO_REWARD).report
    assert (r1 + no_tokens).generated_tokens is None  # unknown stays unknown, never silently partial
    with pytest.raises(LossplugError, match="by_difficulty: the reports use different buckets"):
        r1.merge(keep_mixed_groups(DAPO_REWARD, bins=2).report)


def test_report_round_trips_through_json_and_flattens_for_loggers():
    report = keep_mixed_groups(DAPO_REWARD, lengths=torch.ones(4, 3, dtype=torch.long)).report
    assert SamplingCost.model_validate_json(report.model_dump_json()) == report
    m = report.metrics()
    assert m["dynamic_sampling/rejected_tokens"] == 6.0
    assert m["dynamic_sampling/retention/all_wrong"] == 0.0
    assert "dynamic_sampling/retention/mixed_0-25" not in m  # empty bucket has no rate
    with pytest.raises(LossplugError, match="retained_groups: must be <= the generated count"):
        SamplingCost.model_validate({**report.model_dump(), "retained_groups": 99})


@given(st.lists(st.tuples(st.integers(0, 6), st.sampled_from([0.0, 1.0]), st.integers(0, 20)), min_size=1, max_size=40))
def test_property_matches_brute_force_and_accounts_for_everything(rows):
    group_id = torch.tensor([r[0] for r in rows])
    reward = torch.tensor([r[1] for r in rows])
    lengths = torch.tensor([r[2] for r in rows])
    keep, report = keep_mixed_groups(reward, group_id, lengths=lengths)
    by_group = {}
    for g, r, _ in rows:
        by_group.setdefault(g, set()).add(r)
    assert keep.tolist() == [len(by_group[g]) > 1 for g, _, _ in rows]
    assert report.generated_groups == len(by_group)
    assert report.retained_sequences == int(keep.sum())
    assert report.retained_tokens == int(lengths[keep].sum())
    assert report.generated_tokens == int(lengths.sum())
    for kind in ("groups", "sequences", "tokens"):
        assert sum(getattr(b, kind) for b in report.by_difficulty.values()) == getattr(report, f"generated_{kind}")
        assert sum(getattr(b, f"retained_{kind}") for b in report.by_difficulty.values()) == getattr(
            report, f"retained_{kind}"
        )
    # binary rewards: the mixed buckets are exactly the kept groups
    b = report.by_difficulty
    assert b["all_wrong"].retained_groups == b["all_right"].retained_groups == 0
    # invariant to the order of rows
    perm = torch.randperm(len(rows))
    keep_p, report_p = keep_mixed_groups(reward[perm], group_id[perm], lengths=lengths[perm])
    assert keep_p.tolist() == keep[perm].tolist() and report_p == report


# ---------------------------------------------------------------------------------------------------------------------
# errors


def test_errors_name_field_rule_and_place():
    reward = torch.tensor([0.0, 1.0, 1.0])
    gid = torch.tensor([0, 0, 1])
    with pytest.raises(LossplugError, match="group_id: is required with \\[B\\] rewards"):
        keep_mixed_groups(reward)
    with pytest.raises(LossplugError, match="group_id: must be omitted with \\[prompt, rollout\\] rewards"):
        keep_mixed_groups(DAPO_REWARD, torch.zeros(4, 3, dtype=torch.long))
    with pytest.raises(LossplugError, match="group_id: must be an int tensor, got torch.float32"):
        keep_mixed_groups(reward, gid.float())
    with pytest.raises(LossplugError, match=r"group_id: shape must match reward \[3\], got \[2\]"):
        keep_mixed_groups(reward, gid[:2])
    with pytest.raises(LossplugError, match=r"reward: must be finite — row \[1\]"):
        keep_mixed_groups(torch.tensor([0.0, float("nan"), 1.0]), gid)
    with pytest.raises(LossplugError, match=r"lengths: must be >= 0 — row \[2\]"):
        keep_mixed_groups(reward, gid, lengths=torch.tensor([1, 2, -1]))
    with pytest.raises(LossplugError, match="give either lengths or action_mask"):
        keep_mixed_groups(reward, gid, lengths=torch.ones(3, dtype=torch.long), action_mask=torch.ones(3, 4).bool())
    with pytest.raises(LossplugError, match="action_mask: must be a bool tensor"):
        keep_mixed_groups(reward, gid, action_mask=torch.ones(3, 4))
    with pytest.raises(
        LossplugError, match=r"action_mask: shape must match reward's shape \+ \[T\] \[3, 4\], got \[2, 4\]"
    ):
        keep_mixed_groups(reward, gid, action_mask=torch.ones(2, 4).bool())
    with pytest.raises(LossplugError, match="bins: must be >= 1"):
        keep_mixed_groups(reward, gid, bins=0)
    with pytest.raises(LossplugError, match="reward: needs at least one response"):
        keep_mixed_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    with pytest.raises(LossplugError, match="reward: must be 1-d or 2-d"):
        keep_mixed_groups(torch.zeros(2, 2, 2))
