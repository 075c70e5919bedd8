"""lossplug.cli.batch_files: reading batch dumps (never unpickling) and checking them against the contracts and a
recipe — what ``lossplug validate`` prints, as data. The refusal of pickles is also in
tests/reliability/test_bad_input.py; the command's output in tests/cli/test_app.py."""

import json

import pytest
import torch

import lossplug
from lossplug import PackedTransitions, PluginError, PolicyBatch, Recipe
from lossplug.cli.batch_files import (
    SWAP_RATIO,
    BatchWarning,
    UnreadableFile,
    check_batch,
    infer_contract,
    load_batch_file,
    logprob_swap_warnings,
    name_values,
    own_field_violations,
    read_batch_file,
    singleton_group_warning,
)
from lossplug.cli.json_batch import json_path


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
        ('{"logp": [[1.0], [1.0, 2.0]]}', r"logp: must be a rectangular array.* — \$\.logp\[1\] has 2 elements"),
        ('{"logp": ', "not valid JSON"),
    ],
)
def test_bad_json_says_what_is_wrong(tmp_path, content, phrase):
    path = tmp_path / "b.json"
    path.write_text(content)
    with pytest.raises(UnreadableFile, match=phrase):
        load_batch_file(path)


def test_load_batch_file_names_every_field_it_cannot_read_at_once(tmp_path):
    path = tmp_path / "b.json"
    path.write_text('{"logp": [[1.0], [1.0, 2.0]], "action_mask": [[true], [null]], "reward": [1, 2]}')
    with pytest.raises(UnreadableFile) as info:
        load_batch_file(path)
    assert str(info.value).splitlines()[1:] == [
        "  - logp: must be a rectangular array: every list at one depth has the same length — $.logp[1] has 2 "
        "elements where $.logp[0] has 1",
        "  - action_mask: elements must be numbers or booleans — $.action_mask[1][0] is null",
    ]


def test_read_batch_file_keeps_the_fields_it_can_read_beside_the_problems(tmp_path):
    path = tmp_path / "b.json"
    rows = [[-1.0, -1.0]] * 3
    path.write_text(json.dumps({"logp": rows, "action_mask": [[True, "yes"]] * 3, "grup_id": [[0], 1, 2]}))
    read = read_batch_file(path)
    assert set(read.tensors) == {"logp"} and read.field_names == {"logp", "action_mask", "grup_id"}
    result = check_batch(read.tensors, PolicyBatch, unreadable=read.problems)
    assert [(v.field, v.rule.split(":")[0]) for v in result.violations] == [
        ("action_mask", "elements must be numbers or booleans"),  # not "is required": the file holds it
        ("grup_id", "unknown field (did you mean 'group_id'?)"),  # its value does not matter
    ]
    assert result.violations[0].where == (
        "$.action_mask[0][1] is a string, $.action_mask[1][1] is a string, $.action_mask[2][1] is a string"
    )


def test_json_problems_list_a_few_places_and_count_the_rest(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"logp": [[-1.0, -1.0]] + [[-1.0]] * 7, "action_mask": {"data": [[1, 0]], "dtyp": 1}}))
    problems = read_batch_file(path).problems
    assert [(v.field, v.where) for v in problems] == [
        (
            "logp",
            "$.logp[1] has 1 element where $.logp[0] has 2, $.logp[2] has 1 element where $.logp[0] has 2, "
            "$.logp[3] has 1 element where $.logp[0] has 2, $.logp[4] has 1 element where $.logp[0] has 2, "
            "$.logp[5] has 1 element where $.logp[0] has 2, … and 2 more",
        ),
        ("action_mask", "$.action_mask"),
    ]
    assert problems[1].rule == "unknown key 'dtyp': an object holds 'data' and optionally 'dtype'"
    assert json_path("odd name") == '$["odd name"]' and json_path("logp") == "$.logp"


@pytest.mark.parametrize(
    "value,dtype,where",
    [
        ([0, 2, 1], "bool", "$.f.data[1] is 2"),
        ([[0, -1]], "uint8", "$.f.data[0][1] is -1"),
        ([1.0, float("nan")], "int64", "$.f.data[1] is NaN"),
    ],
)
def test_a_declared_integer_or_bool_dtype_refuses_what_it_would_change(tmp_path, value, dtype, where):
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"f": {"data": value, "dtype": dtype}}))
    (problem,) = read_batch_file(path).problems
    assert (problem.rule, problem.where) == (f"values must be representable as {dtype}", where)


def test_huge_integers_are_named_not_overflowed(tmp_path):
    path = tmp_path / "b.json"
    path.write_text('{"group_id": [0, 9223372036854775808]}')
    (problem,) = read_batch_file(path).problems
    assert (problem.rule, problem.where) == ("integers must fit in 64 bits", "$.group_id[1] is 9223372036854775808")


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


def test_each_field_rank_and_kind_on_its_own():
    fields = tensors(
        logp=torch.zeros(0, 3), action_mask=torch.ones(4), reward=torch.ones(4, 3, 1), group_id=torch.zeros(4)
    )
    assert [(v.field, v.rule) for v in own_field_violations(fields, PolicyBatch)] == [
        ("action_mask", "must be [B, T], got shape [4]"),
        (
            "action_mask",
            "must be a bool tensor, got torch.float32 (convert with .bool() once you know it holds only 0/1)",
        ),
        ("reward", "must be [B] or [B, T], got shape [4, 3, 1]"),
        ("group_id", "must be an int tensor, got torch.float32"),
    ]
    # an empty logp stops the contract's cross-field rules too: the fields' own problems are named beside it
    rules = [(v.field, v.rule) for v in check_batch(fields, PolicyBatch).violations]
    assert rules[0] == ("logp", "a batch needs at least one response, got shape [0, 3]")
    assert rules[1:] == [(v.field, v.rule) for v in own_field_violations(fields, PolicyBatch)]
    packed = {"reward": torch.ones(2, 2), "value": torch.ones(2, 2), "terminated": torch.ones(2).bool()}
    assert [(v.field, v.rule) for v in own_field_violations(packed, PackedTransitions)] == [
        ("value", "must be [N], got shape [2, 2]")
    ]


def test_with_a_usable_logp_the_contract_names_shapes_by_it_alone():
    result = check_batch(tensors(action_mask=torch.ones(4, dtype=torch.bool)), PolicyBatch)
    assert [(v.field, v.rule) for v in result.violations] == [
        ("action_mask", "shape must align with logp [B=4, T=3]: expected [4, 3], got [4]")
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Log-probs of one policy passed for another's


def logprobs(behavior=1e-3, ref=0.5, **overrides):
    old = -torch.linspace(0.5, 3.0, 12, dtype=torch.float64).reshape(4, 3)
    fields = dict(logp=old.clone(), old_logp=old, behavior_logp=old - behavior, ref_logp=old - ref)
    return tensors(**{**fields, **overrides})


def test_no_warning_for_log_probs_where_they_belong():
    assert logprob_swap_warnings(logprobs()) == []
    # one policy's log-probs may be equal: on-policy (old = logp) and without a separate rollout engine
    old = logprobs()["old_logp"]
    assert logprob_swap_warnings(logprobs(logp=old.clone(), behavior_logp=old.clone())) == []


def test_a_copy_of_another_policys_log_probs_warns_once_naming_every_field_it_equals():
    old = logprobs()["old_logp"]
    (w,) = logprob_swap_warnings(logprobs(ref_logp=old.clone(), logp=old - 0.01))
    assert w.field == "ref_logp" and w.message.startswith("bitwise equal to old_logp (the policy before this update)")
    assert w.message.endswith("(expected only at the first step, while the policy is still the reference)")
    assert logprob_swap_warnings(logprobs(ref_logp=old.clone(), logp=old - 0.01), reads={"old_logp"}) == []
    (w,) = logprob_swap_warnings(
        logprobs(teacher_logp=old.clone(), logp=old - 0.01), reads={"old_logp", "teacher_logp"}
    )
    assert w.field == "teacher_logp" and "the teacher's log-probs" in w.message and "first step" not in w.message


def test_only_the_action_positions_count_and_a_copy_in_a_coarser_dtype_is_a_copy():
    fields = logprobs(logp=logprobs()["old_logp"] - 0.01)
    ref = fields["old_logp"].clone()
    ref[:, 0] = 0.5  # off the actions anything goes
    mask = torch.ones(4, 3, dtype=torch.bool)
    mask[:, 0] = False
    assert [w.field for w in logprob_swap_warnings({**fields, "ref_logp": ref, "action_mask": mask})] == ["ref_logp"]
    for copy in (ref.float(), ref.bfloat16()):
        (w,) = logprob_swap_warnings({**fields, "ref_logp": copy, "action_mask": mask})
        assert w.field == "ref_logp" and w.message.startswith("bitwise equal to old_logp")
    assert logprob_swap_warnings({**fields, "ref_logp": (ref - 0.3).bfloat16(), "action_mask": mask}) == []


def test_swapped_log_probs_warn_by_their_distances():
    (w,) = logprob_swap_warnings(logprobs(behavior=0.5, ref=1e-3))
    assert w.field == "behavior_logp" and w.message.startswith("500× farther from old_logp than ref_logp is")
    assert "behavior_logp and ref_logp look swapped" in w.message
    # old and ref swapped: old far from logp while ref sits next to it
    right = logprobs()
    (w,) = logprob_swap_warnings({**right, "old_logp": right["ref_logp"], "ref_logp": right["old_logp"] - 2e-3})
    assert w.field == "old_logp" and "old_logp and ref_logp look swapped" in w.message
    # below two orders of magnitude, or a recipe that reads neither: no warning
    assert logprob_swap_warnings(logprobs(behavior=0.5, ref=0.5 / SWAP_RATIO * 1.01)) == []
    assert logprob_swap_warnings(logprobs(behavior=0.5, ref=1e-3), reads={"old_logp"}) == []


def test_unreadable_masks_and_shapes_give_no_log_prob_warning():
    old = logprobs()["old_logp"]
    for mask in (torch.ones(4, dtype=torch.bool), torch.full((4, 3), 2), torch.zeros(4, 3, dtype=torch.bool)):
        assert logprob_swap_warnings(logprobs(ref_logp=old.clone(), action_mask=mask)) == []
    assert logprob_swap_warnings(logprobs(ref_logp=old[:, :2].clone())) == []


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
