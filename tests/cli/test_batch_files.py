"""lossplug.cli.batch_files: reading batch dumps (never unpickling) and checking them against the contracts and a
recipe — what ``lossplug validate`` prints, as data. The refusal of pickles is also in
tests/reliability/test_bad_input.py; the command's output in tests/cli/test_app.py."""

import json

import pytest
import torch

import lossplug
from lossplug import PackedTransitions, PluginError, PolicyBatch, Recipe
from lossplug.cli.batch_files import (
    BatchWarning,
    UnreadableFile,
    check_batch,
    infer_contract,
    load_batch_file,
    name_values,
    singleton_group_warning,
)


def tensors(b=4, t=3, **overrides):
    out = dict(
        logp=torch.full((b, t), -1.0),
        old_logp=torch.full((b, t), -1.1),
        action_mask=torch.ones(b, t, dtype=torch.bool),
        reward=torch.arange(b, dtype=torch.float32),
        group_id=torch.arange(b) // 2,
    )
    out.update(overrides)
    return {k: v for k, v in out.items() if v is not None}


def recipe(spec):
    return Recipe.load(spec) if isinstance(spec, str) else Recipe.model_validate(spec)


# ---------------------------------------------------------------------------------------------------------------------
# Reading


def test_safetensors_and_json_round_trip(tmp_path):
    pytest.importorskip("safetensors")  # writes the file (reading it needs no safetensors)
    from safetensors.torch import save_file

    save_file(tensors(), str(tmp_path / "b.safetensors"))
    loaded = load_batch_file(str(tmp_path / "b.safetensors"))  # a str path works too
    assert loaded.keys() == tensors().keys() and torch.equal(loaded["group_id"], tensors()["group_id"])
    small = tmp_path / "small.json"
    small.write_text(
        json.dumps(
            {
                "logp": [[-1.0, -2.0]],
                "action_mask": {"data": [[1, 0]], "dtype": "bool"},
                "advantage": {"data": [1], "dtype": "float64"},
                "value": None,
            }
        )
    )
    loaded = load_batch_file(small)
    assert loaded["action_mask"].dtype == torch.bool and loaded["advantage"].dtype == torch.float64
    assert "value" not in loaded  # null fields are absent fields


@pytest.mark.parametrize(
    "content,phrase",
    [
        ("[1, 2]", "expected a JSON object"),
        ('{"logp": {"dtype": "float32"}}', "needs 'data'"),
        ('{"logp": {"data": [1.0], "dtype": "float33"}}', "unknown dtype 'float33'"),
        ('{"logp": [[1.0], [1.0, 2.0]]}', "not a rectangular array"),
        ('{"logp": ', "not valid JSON"),
    ],
)
def test_bad_json_says_what_is_wrong(tmp_path, content, phrase):
    path = tmp_path / "b.json"
    path.write_text(content)
    with pytest.raises(UnreadableFile, match=phrase):
        load_batch_file(path)


def test_missing_files_directories_and_pickle_suffixes_are_unreadable(tmp_path):
    with pytest.raises(UnreadableFile, match="no such file"):
        load_batch_file(tmp_path / "nope.safetensors")
    with pytest.raises(UnreadableFile, match="is a directory"):
        load_batch_file(tmp_path)
    (tmp_path / "b.pt").write_bytes(b"anything")
    with pytest.raises(UnreadableFile, match="never unpickles"):
        load_batch_file(tmp_path / "b.pt")
    assert issubclass(UnreadableFile, lossplug.LossplugError)


# ---------------------------------------------------------------------------------------------------------------------
# Contracts


def test_infer_contract_from_the_field_names_or_the_choice():
    assert infer_contract({"logp", "action_mask"}) is PolicyBatch
    assert infer_contract({"reward", "value", "next_value", "boundary", "terminated"}) is PackedTransitions
    assert infer_contract({"next_value"}, "policy") is PolicyBatch
    assert infer_contract({"logp"}, "packed") is PackedTransitions
    with pytest.raises(UnreadableFile, match="--contract policy|packed"):
        infer_contract({"score"})
    with pytest.raises(ValueError, match="'auto'"):
        infer_contract({"logp"}, "padded")


def test_every_layer_of_contract_violations_is_reported_at_once():
    logp = torch.full((4, 3), -1.0)
    logp[2, 1] = float("nan")
    result = check_batch(
        tensors(logp=logp, action_mask=torch.ones(4, 3, dtype=torch.int8), extra=torch.zeros(4)), PolicyBatch
    )
    fields = [v.field for v in result.violations]
    assert {"extra", "action_mask", "logp"} <= set(fields) and len(fields) == len(set(fields))
    assert not result.valid and result.batch is None and result.contract is PolicyBatch
    good = check_batch(tensors(), PolicyBatch)
    assert good.valid and good.violations == [] and good.warnings == [] and good.batch.batch_size == 4


# ---------------------------------------------------------------------------------------------------------------------
# Recipes


def test_a_recipe_adds_the_fields_its_stages_need():
    result = check_batch(tensors(old_logp=None, reward=None), PolicyBatch, recipe("dapo"))
    rules = {v.field: v.rule for v in result.violations}
    assert set(rules) == {"old_logp", "reward"}
    assert rules == {
        "old_logp": "required by gates[0] 'ppo_clip', but the file has none (for a single on-policy step pass "
        "old_logp=logp.detach())",
        "reward": "required by advantage 'grpo', but the file has none",
    }


def test_packed_transitions_need_an_advantage_stage_that_takes_them():
    packed = dict(
        reward=torch.tensor([1.0, 0.0]),
        value=torch.tensor([0.1, 0.2]),
        next_value=torch.tensor([0.2, 0.0]),
        terminated=torch.tensor([False, True]),
        boundary=torch.tensor([False, True]),
    )
    assert check_batch(packed, PackedTransitions, recipe("ppo")).valid
    (v,) = check_batch(packed, PackedTransitions, recipe("dapo")).violations
    assert v.field == "<batch>" and "advantage 'grpo' works on padded batches" in v.rule
    no_value = check_batch({k: x for k, x in packed.items() if k != "value"}, PackedTransitions, recipe("ppo"))
    assert {v.field for v in no_value.violations} == {"value"}
    assert any("advantage 'gae'" in v.rule for v in no_value.violations)


def test_groups_of_one_rollout_warn_under_grpo_and_are_violations_under_rloo():
    lone = tensors(group_id=torch.tensor([5, 5, 8, 9]))
    result = check_batch(lone, PolicyBatch, recipe("dapo"))
    assert result.valid  # a warning is not a violation
    (w,) = result.warnings
    assert isinstance(w, BatchWarning) and w.field == "group_id" and w.values == (8, 9)
    assert w.where == "group_id 8, 9" and "2 of 3 groups" in w.message and "advantage 'grpo'" in w.message
    rloo = check_batch(lone, PolicyBatch, recipe({"advantage": "rloo", "gates": ["ppo_clip"], "reduction": "token"}))
    assert rloo.warnings == [] and [v.field for v in rloo.violations] == ["group_id"]
    assert check_batch(tensors(), PolicyBatch, recipe("dapo")).warnings == []  # groups of two
    assert check_batch(lone, PolicyBatch).warnings == []  # no recipe, no advantage to judge by


def test_the_lone_group_warning_survives_other_violations_and_ignores_malformed_ids():
    broken = tensors(group_id=torch.tensor([0, 1, 1, 2]), logp=torch.full((4, 2), -1.0))  # logp of the wrong shape
    result = check_batch(broken, PolicyBatch, recipe("dapo"))
    assert not result.valid and result.warnings[0].values == (0, 2)
    for odd in (torch.tensor([0.0, 1.0, 1.0, 2.0]), torch.zeros(4, 1, dtype=torch.int64), torch.ones(4).bool()):
        assert check_batch(tensors(group_id=odd), PolicyBatch, recipe("dapo")).warnings == []


def test_singleton_group_warning_only_for_estimators_that_read_groups():
    reg = lossplug.registry()
    ids = torch.tensor([0, 1, 1])
    assert singleton_group_warning(ids, reg.plugins["advantage"]["grpo"]).values == (0,)
    assert singleton_group_warning(ids, reg.plugins["advantage"]["gae"]) is None  # no groups at all
    assert singleton_group_warning(ids, reg.plugins["advantage"]["rloo"]) is None  # refuses them instead
    assert singleton_group_warning(torch.tensor([0, 0, 1, 1]), reg.plugins["advantage"]["grpo"]) is None


def test_name_values_keeps_warnings_to_one_line():
    assert name_values([3, 7]) == "3, 7"
    assert name_values(list(range(25)), shown=3) == "0, 1, 2 … and 22 more"
    assert name_values(list(range(10))) == "0, 1, 2, 3, 4, 5, 6, 7, 8, 9"


class WordyValidator:
    @staticmethod
    @lossplug.hookimpl
    def lossplug_validate_batch(batch, recipe):
        return ["the batch looks odd"]


class Objecting:
    @staticmethod
    @lossplug.hookimpl
    def lossplug_validate_batch(batch, recipe):
        return [lossplug.Violation("reward", "must be at most 1", "row 3")]


def test_plugin_validators_run_when_the_recipe_checks_pass_and_are_blamed_when_malformed():
    lossplug.register_plugin(Objecting, name="objecting-checks")
    try:
        (v,) = check_batch(tensors(), PolicyBatch, recipe("dapo")).violations
        assert (v.field, v.where) == ("reward", "row 3")
        assert check_batch(tensors(), PolicyBatch).valid  # no recipe: the plugins are not asked
    finally:
        lossplug.unregister_plugin(Objecting)
    lossplug.register_plugin(WordyValidator, name="wordy-checks")
    try:
        with pytest.raises(PluginError, match="in-process plugin 'wordy-checks'.*Violation.*got a list of str"):
            check_batch(tensors(), PolicyBatch, recipe("dapo"))
    finally:
        lossplug.unregister_plugin(WordyValidator)
