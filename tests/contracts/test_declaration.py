"""The batch contracts are pydantic models whose fields are each declared once; everything else is derived."""

import json

import jsonschema
import pydantic
import pytest
import torch

import lossplug
from lossplug import BatchValidationError, PackedTransitions, PolicyBatch
from lossplug.contracts.batch import TensorField
from lossplug.contracts.schema import batch_json_schema
from lossplug.needs import FIELD_SHAPES

CONTRACTS = (PolicyBatch, PackedTransitions)


def good(**over):
    fields = {"logp": -torch.rand(3, 4), "action_mask": torch.ones(3, 4, dtype=torch.bool)}
    return {**fields, **over}


@pytest.mark.parametrize("contract", CONTRACTS)
def test_a_contract_is_a_frozen_pydantic_model_with_one_declaration_per_field(contract):
    assert issubclass(contract, pydantic.BaseModel)
    assert contract.model_config["frozen"] and contract.model_config["extra"] == "forbid"
    for name, info in contract.model_fields.items():
        declared = [m for m in info.metadata if isinstance(m, TensorField)]
        assert len(declared) == 1, name
        assert contract.SPECS[name] is declared[0]
    assert contract.FIELD_NAMES == tuple(contract.model_fields)


def test_a_field_without_its_declaration_is_refused_when_the_class_is_made():
    with pytest.raises(TypeError, match="exactly one TensorField"):

        class Broken(PolicyBatch):
            extra: torch.Tensor | None = None


def test_the_derived_tables_follow_the_declaration():
    assert PolicyBatch.LOGPROBS == ("logp", "old_logp", "behavior_logp", "ref_logp", "teacher_logp")
    assert {PolicyBatch.SPECS[n].source for n in PolicyBatch.LOGPROBS} == {
        "current",
        "old",
        "behavior",
        "ref",
        "teacher",
    }
    # every field of both contracts has a one-line shape (recipe explain, validate)
    assert set(FIELD_SHAPES) == set(PolicyBatch.FIELD_NAMES) | set(PackedTransitions.FIELD_NAMES)
    assert FIELD_SHAPES["anchor_id"].startswith("[B] int — ")
    assert FIELD_SHAPES["teacher_logp"].startswith("[B, T] float — ")
    assert FIELD_SHAPES["reward_components"].startswith("[B, K] float — ")
    assert FIELD_SHAPES["next_value"].startswith("[N] float — ")
    assert FIELD_SHAPES["behavior_version"].startswith("[B] or [B, T] int — ")
    # a field's rules come from the rule table, in its words
    assert "given only with group_id" in PolicyBatch.field_rules("anchor_id")
    assert any("0 off the actions" in r for r in PolicyBatch.field_rules("reward"))


def test_recipe_explain_prints_a_shape_for_every_field():
    from lossplug.cli.describe import recipe_fields

    opd = lossplug.Recipe.model_validate({"advantage": "opd", "gates": ["ppo_clip"], "reduction": "token"})
    for recipe in (opd, lossplug.Recipe.load("dapo")):
        rows = recipe_fields(recipe)
        assert rows and all(row["shape"] for row in rows), rows
    assert {row["field"]: row["shape"] for row in recipe_fields(opd)}["teacher_logp"] == FIELD_SHAPES["teacher_logp"]
    gigpo = lossplug.Recipe.model_validate({"advantage": "gigpo", "gates": ["ppo_clip"], "reduction": "token"})
    shapes = {row["field"]: row["shape"] for row in recipe_fields(gigpo)}
    assert shapes["anchor_id"] == FIELD_SHAPES["anchor_id"] and shapes["trajectory_id"].startswith("[B] int")


@pytest.mark.parametrize("contract", ["policy", "packed"])
def test_the_json_schema_describes_every_field_with_its_shape(contract):
    schema = batch_json_schema(contract)
    jsonschema.Draft202012Validator.check_schema(schema)
    cls = {"policy": PolicyBatch, "packed": PackedTransitions}[contract]
    assert set(schema["properties"]) == set(cls.FIELD_NAMES)
    assert set(schema["required"]) == {n for n, f in cls.model_fields.items() if f.is_required()}
    for name, prop in schema["properties"].items():
        meta = prop["x-lossplug"]
        assert prop["description"], name
        assert meta["shape"] == cls.SPECS[name].shape_text and meta["kind"] == cls.SPECS[name].kind
    if contract == "policy":
        assert schema["properties"]["ref_logp"]["x-lossplug"]["logprob_source"] == "ref"


def test_a_json_batch_file_is_checked_by_the_schema():
    validator = jsonschema.Draft202012Validator(batch_json_schema())
    ok = {
        "logp": [[-0.5, -1.0], [-0.1, 0.0]],
        "action_mask": [[True, True], [True, False]],
        "advantage": [1.0, -1.0],
        "group_id": {"data": [0, 0], "dtype": "int32"},
        "ref_logp": None,
    }
    assert validator.is_valid(ok)
    assert not validator.is_valid({**ok, "action_mask": [[1.5, 2.0]]})  # not booleans
    assert not validator.is_valid({**ok, "group_id": [0.5, 1.0]})  # not integers
    assert not validator.is_valid({**ok, "old_logps": [[0.0]]})  # not a field (of either contract)
    assert not validator.is_valid({"logp": [[-1.0]]})  # action_mask is required
    packed = {k: [0.0, 1.0] for k in ("reward", "value", "next_value")}
    assert validator.is_valid({**packed, "terminated": [False, True], "boundary": [False, True]})


def test_pydantic_errors_become_one_lossplug_error_naming_every_problem():
    with pytest.raises(BatchValidationError) as info:
        PolicyBatch(logp=[[0.0]], action_mask=None, old_lgp=torch.zeros(1), advantage=3)
    message = str(info.value)
    assert not isinstance(info.value, pydantic.ValidationError)
    for expected in (
        "logp: must be a torch.Tensor, got list",
        "action_mask: is required",
        "old_lgp: unknown field (did you mean 'old_logp'?)",
        "advantage: must be a torch.Tensor, got int",
    ):
        assert expected in message
    with pytest.raises(BatchValidationError, match="expected keyword fields"):
        PolicyBatch([1, 2])


def test_unchecked_checks_the_types_at_once_and_the_rules_later():
    with pytest.raises(BatchValidationError, match="must be a torch.Tensor"):
        PolicyBatch.unchecked(**good(old_logp=[[0.0]]))
    bad = PolicyBatch.unchecked(**good(logp=torch.ones(3, 4)))  # log-probs above 0: a rule, not a type
    assert not bad.validated
    with pytest.raises(BatchValidationError, match="log-probs must be <= 0"):
        bad.check()
    fine = PolicyBatch.unchecked(**good())
    assert fine.check() == () and fine.validated


def test_a_batch_is_frozen_equal_only_to_itself_and_hashable():
    batch = PolicyBatch(**good())
    with pytest.raises(BatchValidationError, match=r"frozen: build a new one with batch.replace\(logp=...\)"):
        batch.logp = torch.zeros(3, 4)
    twin = PolicyBatch(**batch.fields())
    assert batch == batch and batch != twin and len({batch, twin}) == 2
    replaced = batch.replace(advantage=torch.ones(3))
    assert replaced.advantage is not None and batch.advantage is None and replaced.validated


def test_the_schema_command_prints_and_writes_the_schema(tmp_path):
    from typer.testing import CliRunner

    from lossplug.cli import app

    out = CliRunner().invoke(app, ["schema"])
    assert out.exit_code == 0
    schema = json.loads(out.output)
    assert set(schema["$defs"]) == {"PolicyBatch", "PackedTransitions"}
    target = tmp_path / "policy.schema.json"
    out = CliRunner().invoke(app, ["schema", "policy", "--output", str(target)])
    assert out.exit_code == 0 and "wrote" in out.output
    assert json.loads(target.read_text())["title"] == "PolicyBatch"
    out = CliRunner().invoke(app, ["schema", "nonsense"])
    assert out.exit_code == 2
