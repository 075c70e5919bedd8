"""The TRL adapter's one list of the fields it fills: contract fields, and exactly what policy_batch passes."""

import ast
import inspect
import textwrap

import pytest

pytest.importorskip("trl")

from lossplug import PolicyBatch
from lossplug.adapters.trl import loss, refusals


def test_every_field_the_adapter_fills_is_a_contract_field():
    assert set(loss.TRL_FIELDS) <= set(PolicyBatch.FIELD_NAMES)
    assert set(loss.TRL_CONDITIONAL_FIELDS) <= set(loss.TRL_FIELDS)
    assert refusals.PROVIDED == set(loss.TRL_FIELDS) - set(loss.TRL_CONDITIONAL_FIELDS)


def test_the_list_is_what_policy_batch_passes():
    tree = ast.parse(textwrap.dedent(inspect.getsource(loss.policy_batch)))
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "unchecked"
    ]
    assert len(calls) == 1
    assert {keyword.arg for keyword in calls[0].keywords} == set(loss.TRL_FIELDS)
