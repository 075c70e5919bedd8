"""PolicyBatch / PackedTransitions: every rule, with its message (field, rule, position)."""

import pytest
import torch

import lossplug
from lossplug import BatchValidationError, PackedTransitions, PolicyBatch

NAN, INF = float("nan"), float("inf")


# every rule twice: resolved on the host and as flag tensors with one synchronisation
pytestmark = pytest.mark.usefixtures("contract_flag_path")


def good(**over):
    fields = dict(
        logp=torch.full((3, 4), -1.0),
        action_mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool),
        old_logp=torch.full((3, 4), -1.1),
        advantage=torch.tensor([1.0, -1.0, 0.5]),
        group_id=torch.tensor([0, 0, 1]),
    )
    fields.update(over)
    return fields


def violations(**fields):
    with pytest.raises(BatchValidationError) as info:
        PolicyBatch(**fields)
    return info.value, str(info.value)


def test_valid_batch_passes_and_is_marked_validated():
    batch = PolicyBatch(**good())
    assert batch.validated
    assert batch.action_lengths.tolist() == [2, 4, 2]


def test_masked_positions_may_hold_nan_and_inf():
    logp = torch.full((3, 4), -1.0)
    logp[0, 2:] = NAN
    logp[2, 0] = INF
    PolicyBatch(**good(logp=logp))


def test_mask_must_be_bool():
    err, msg = violations(**good(action_mask=torch.ones(3, 4, dtype=torch.long)))
    assert "action_mask: must be a bool tensor, got torch.int64" in msg


def test_shapes_must_align_naming_the_field_and_shapes():
    err, msg = violations(**good(old_logp=torch.zeros(3, 5)))
    assert "old_logp: shape must align with logp [B=3, T=4]: expected [3, 4], got [3, 5]" in msg
    err, msg = violations(**good(advantage=torch.zeros(2)))
    assert "advantage" in msg and "expected [3] or [3, 4], got [2]" in msg


def test_logp_must_be_2d():
    err, msg = violations(logp=torch.zeros(4), action_mask=torch.ones(4, dtype=torch.bool))
    assert "logp: must be [B, T], got shape (4,)" in msg


def test_every_response_needs_an_action_naming_the_rows():
    mask = torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    err, msg = violations(**good(action_mask=mask))
    assert "action_mask: every response needs at least one action token — rows [0, 2]" in msg


def test_values_on_action_positions_must_be_finite_naming_positions():
    old = torch.full((3, 4), -1.0)
    old[1, 3] = NAN
    old[0, 1] = -INF
    err, msg = violations(**good(old_logp=old))
    assert "old_logp: must be finite on action positions — (row 0, pos 1), (row 1, pos 3)" in msg


def test_sequence_fields_must_be_finite():
    err, msg = violations(**good(advantage=torch.tensor([1.0, NAN, 0.0])))
    assert "advantage: must be finite — row [1]" in msg


def test_logprobs_must_not_be_positive_beyond_tolerance():
    logp = torch.full((3, 4), -1.0)
    logp[1, 0] = 0.5
    logp[0, 3] = 5.0  # masked: ignored
    err, msg = violations(**good(logp=logp))
    assert "logp: log-probs must be <= 0" in msg and "(row 1, pos 0)" in msg and "pos 3" not in msg
    logp[1, 0] = lossplug.contracts.LOGP_TOLERANCE / 2
    PolicyBatch(**good(logp=logp))


def test_all_violations_are_reported_together():
    err, msg = violations(
        **good(
            action_mask=torch.ones(3, 4, dtype=torch.long),
            group_id=torch.zeros(3),
            terminated=torch.zeros(3, dtype=torch.long),
        )
    )
    fields = {v.field for v in err.violations}
    assert fields == {"action_mask", "group_id", "terminated"}
    assert "failed 3 contract checks" in msg


def test_id_fields_must_be_integer():
    err, msg = violations(**good(group_id=torch.tensor([0.0, 0.0, 1.0])))
    assert "group_id: must be an int tensor, got torch.float32" in msg


def test_unknown_field_suggests_the_right_name():
    err, msg = violations(**good(), logps=torch.zeros(3, 4))
    assert "logps: unknown field (did you mean 'logp'?)" in msg


def test_non_tensor_field_and_missing_required():
    err, msg = violations(logp=[[0.0]], action_mask=None)
    assert "logp: must be a torch.Tensor, got list" in msg
    assert "action_mask: is required" in msg


def test_final_value_must_be_finite_only_where_truncated():
    fields = good(terminated=torch.tensor([True, False, True]), final_value=torch.tensor([NAN, 1.0, NAN]))
    PolicyBatch(**fields)
    err, msg = violations(
        **good(terminated=torch.tensor([True, False, True]), final_value=torch.tensor([0.0, NAN, 0.0]))
    )
    assert "final_value: must be finite for truncated (not terminated) responses — row [1]" in msg


def test_device_mismatch_is_named():
    meta = torch.zeros(3, 4, device="meta")
    err, msg = violations(**good(old_logp=meta))
    assert "old_logp: must be on logp's device cpu, got meta" in msg


def test_unchecked_skips_validation_and_check_runs_it_later():
    bad = PolicyBatch.unchecked(**good(action_mask=torch.zeros(3, 4, dtype=torch.bool)))
    assert not bad.validated
    with pytest.raises(BatchValidationError, match="every response needs at least one action"):
        bad.check()


def test_replace_revalidates():
    batch = PolicyBatch(**good())
    with pytest.raises(BatchValidationError, match="advantage"):
        batch.replace(advantage=torch.tensor([NAN, 0.0, 0.0]))
    assert batch.replace(advantage=torch.zeros(3)).advantage.sum() == 0


# ---- PackedTransitions -----------------------------------------------------------------------------------------


def packed(**over):
    fields = dict(  # the packed GAE worked example: NaN next_value at the terminal transition is allowed
        reward=torch.tensor([1.0, 2.0, 10.0]),
        value=torch.tensor([0.5, 1.0, 3.0]),
        next_value=torch.tensor([1.0, 4.0, NAN]),
        terminated=torch.tensor([False, False, True]),
        boundary=torch.tensor([False, True, True]),
    )
    fields.update(over)
    return fields


def packed_error(**fields):
    with pytest.raises(BatchValidationError) as info:
        PackedTransitions(**fields)
    return str(info.value)


def test_packed_worked_example_is_valid():
    assert PackedTransitions(**packed()).validated


def test_terminated_requires_boundary():
    msg = packed_error(**packed(terminated=torch.tensor([True, False, True])))
    assert "terminated: a terminal transition must close its trajectory (terminated ⇒ boundary) — position [0]" in msg


def test_fragments_must_be_closed_and_non_empty():
    msg = packed_error(
        **packed(boundary=torch.tensor([False, True, False]), terminated=torch.zeros(3, dtype=torch.bool))
    )
    assert "boundary: packed fragments must be closed" in msg and "position 2" in msg
    empty = torch.zeros(0)
    msg = packed_error(reward=empty, value=empty, next_value=empty, terminated=empty.bool(), boundary=empty.bool())
    assert "packed fragments must be non-empty and one-dimensional" in msg


def test_packed_alignment_and_dtypes():
    msg = packed_error(**packed(value=torch.zeros(4), boundary=torch.tensor([0, 1, 1])))
    assert "value: all transition tensors must align with reward [N=3], got [4]" in msg
    assert "boundary: must be a bool tensor" in msg


def test_next_value_must_be_finite_where_it_bootstraps():
    msg = packed_error(**packed(next_value=torch.tensor([NAN, 4.0, NAN])))
    assert "next_value: must be finite where the transition bootstraps (not terminated) — position [0]" in msg


def test_trajectory_id_may_change_only_after_a_boundary():
    PackedTransitions(**packed(trajectory_id=torch.tensor([7, 7, 8])))
    msg = packed_error(**packed(trajectory_id=torch.tensor([7, 8, 8])))
    assert "trajectory_id: a fragment must not mix trajectories" in msg and "position [0]" in msg


def test_final_value_needs_terminated():
    err, msg = violations(**good(final_value=torch.tensor([0.0, 1.0, 2.0])))
    assert "final_value: is only read for truncated responses: give terminated [B] bool with it" in msg


# ---- fields shared by the parity work: entropy, reward_baseline, reward_components -----------------------------------


def _parity_batch(**fields: torch.Tensor) -> PolicyBatch:
    mask = torch.tensor([[True, True, False], [True, False, True]])
    return PolicyBatch(logp=-torch.rand(2, 3), action_mask=mask, **fields)


def test_entropy_is_checked_on_actions_only() -> None:
    entropy = torch.tensor([[0.5, 0.0, float("nan")], [1.0, -7.0, 2.0]])  # garbage off the actions is allowed
    assert _parity_batch(entropy=entropy).entropy is entropy
    with pytest.raises(BatchValidationError, match=r"entropy: must be finite and >= 0.*row 1, pos 2"):
        _parity_batch(entropy=torch.tensor([[0.5, 0.1, 0.0], [1.0, 0.0, -0.5]]))
    with pytest.raises(BatchValidationError, match=r"entropy: must be finite"):
        _parity_batch(entropy=torch.tensor([[float("inf"), 0.1, 0.0], [1.0, 0.0, 0.5]]))


def test_reward_baseline_is_a_finite_row_field() -> None:
    assert _parity_batch(reward_baseline=torch.tensor([0.5, 1.0])).reward_baseline is not None
    with pytest.raises(BatchValidationError, match=r"reward_baseline: shape must align"):
        _parity_batch(reward_baseline=torch.zeros(2, 3))
    with pytest.raises(BatchValidationError, match=r"reward_baseline: must be finite"):
        _parity_batch(reward_baseline=torch.tensor([0.5, float("nan")]))


def test_reward_components_are_b_by_k() -> None:
    assert _parity_batch(reward_components=torch.rand(2, 4)).reward_components.shape == (2, 4)
    for bad in (torch.rand(2), torch.rand(2, 0), torch.rand(3, 2)):
        with pytest.raises(BatchValidationError, match=r"reward_components: must be \[B=2, K\]"):
            _parity_batch(reward_components=bad)
    with pytest.raises(BatchValidationError, match=r"reward_components: must be finite"):
        _parity_batch(reward_components=torch.tensor([[1.0, float("inf")], [0.0, 0.0]]))


def test_sum_pi_squared_is_a_probability_mass_on_actions() -> None:
    ok = torch.tensor([[0.5, 1.0, float("nan")], [0.2, 3.0, 0.9]])  # garbage off the actions is allowed
    assert _parity_batch(sum_pi_squared=ok).sum_pi_squared is ok
    for bad in (
        torch.tensor([[0.5, 1.2, 0.0], [0.2, 0.0, 0.9]]),
        torch.tensor([[0.5, 0.5, 0.0], [float("nan"), 0, 0.9]]),
    ):
        with pytest.raises(BatchValidationError, match=r"sum_pi_squared: must be in \[0, 1\]"):
            _parity_batch(sum_pi_squared=bad)
