"""The verl adapter's field mapping names contract fields only."""

import pytest

pytest.importorskip("verl")

from lossplug import PolicyBatch
from lossplug.adapters.verl import advantage


def test_every_field_read_from_the_data_proto_is_a_contract_field():
    assert set(advantage._EXTRA_FIELDS) <= set(PolicyBatch.FIELD_NAMES)
    # each is read from one DataProto key of its own
    assert len(set(advantage._EXTRA_FIELDS.values())) == len(advantage._EXTRA_FIELDS)
