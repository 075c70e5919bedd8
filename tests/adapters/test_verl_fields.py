"""The verl adapter's field mapping names contract fields only."""

import pytest

pytest.importorskip("verl")

from lossplug import PolicyBatch
from lossplug.adapters.verl import advantage


def test_every_field_read_from_the_data_proto_is_a_contract_field():
    assert set(advantage._EXTRA_FIELDS) <= set(PolicyBatch.FIELD_NAMES)
    # each is read from one DataProto key of its own
    assert len(set(advantage._EXTRA_FIELDS.values())) == len(advantage._EXTRA_FIELDS)


def test_the_estimator_reads_from_verls_data_proto_every_field_verl_does_not_pass_it():
    """Under adv_estimator=lossplug the estimator reads from the DataProto of verl's compute_advantage every field the
    adapter maps to a DataProto key, but reward_baselines (which verl passes it); called any other way, each such field
    is refused by a row that says so and names the way through verl's compute_advantage."""
    from lossplug.adapters.verl import unfed

    passed = {name for name, key in advantage._EXTRA_FIELDS.items() if key in advantage._PASSED_BY_VERL}
    assert passed == {"reward_baseline"}
    expected = (set(advantage._EXTRA_FIELDS) - passed) | set(advantage._DRIVER_FIELDS)
    assert unfed.ADVANTAGE_FROM_THE_DATAPROTO == expected
    for name in unfed.ADVANTAGE_FROM_THE_DATAPROTO:
        row = unfed.ADVANTAGE_UNFED[name]
        assert "this call did not come from it" in row.why, (name, row.why)
        assert "algorithm.adv_estimator=lossplug" in row.next_step, (name, row.next_step)
