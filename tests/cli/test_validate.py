"""``lossplug validate``'s report, line by line: one line per problem — field, rule, where — naming every stage that
needs a missing field once, without the recipe's name repeated in each rule (the title names it). The batches are
what a user dumps: a DAPO/GRPO/RLOO/GSPO batch and a verl recipe's, each broken one way. The Python API's missing-field
errors share the wording (the last tests)."""

import json

import pytest
import torch
from typer.testing import CliRunner

import lossplug
from lossplug import BatchValidationError, PolicyBatch
from lossplug.cli import app
from lossplug.contracts.batch_rules import OFF_ACTION_REWARD

B, T = 4, 3
ON_POLICY = " (for a single on-policy step pass old_logp=logp.detach())"


def tensors(**overrides):
    fields = dict(
        logp=torch.full((B, T), -1.0),
        old_logp=torch.full((B, T), -1.1),
        action_mask=torch.ones(B, T, dtype=torch.bool),
        reward=torch.arange(B, dtype=torch.float32),
        group_id=torch.arange(B) // 2,
    )
    fields.update(overrides)
    return {k: v for k, v in fields.items() if v is not None}


def validate(tmp_path, fields, *recipe):
    """``(exit code, [(field, rule, where)], human output)`` of ``lossplug validate FILE [--recipe R]``."""
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    path = tmp_path / "batch.safetensors"
    save_file({k: v.contiguous() for k, v in fields.items()}, str(path))
    args = ["validate", str(path), *(("--recipe", recipe[0]) if recipe else ())]
    runner = CliRunner()
    env = {"COLUMNS": "250", "NO_COLOR": "1"}
    data = json.loads(runner.invoke(app, [*args, "--json"], env=env).stdout)
    human = runner.invoke(app, args, env=env)
    lines = [(v["field"], v["rule"], v["where"]) for v in data["violations"]]
    return human.exit_code, lines, human.output


@pytest.mark.parametrize("recipe", ["dapo", "grpo", "rloo", "gspo", None])
def test_a_missing_logp_is_one_line(tmp_path, recipe):
    code, lines, output = validate(tmp_path, tensors(logp=None), *([recipe] if recipe else []))
    assert code == 1 and lines == [("logp", "is required", "")]
    assert "✗ 1 violation of PolicyBatch" in output and output.count("logp ") == 2  # the field table and the line


def test_rloo_without_group_ids_is_one_line_naming_its_group_size_once(tmp_path):
    code, lines, output = validate(tmp_path, tensors(group_id=None), "rloo")
    assert code == 1
    assert lines == [("group_id", "required by advantage 'rloo' (≥ 2 rollouts per group), but the file has none", "")]
    assert output.count("rloo") == 2  # the title ("recipe 'rloo'") and the line
    _, lines, _ = validate(tmp_path, tensors(group_id=None), "dapo")
    assert lines == [("group_id", "required by advantage 'grpo', but the file has none", "")]


def test_one_rollout_per_group_under_rloo_names_the_groups(tmp_path):
    code, lines, _ = validate(tmp_path, tensors(group_id=torch.tensor([0, 0, 1, 2])), "rloo")
    assert code == 1
    assert lines == [
        (
            "group_id",
            "recipe.advantage (rloo) needs at least 2 rollouts per group",
            "groups [1, 2] have fewer (sizes [1, 1])",
        )
    ]


def test_many_small_groups_are_one_line_that_counts_the_rest(tmp_path):
    n = 11
    fields = {k: v.repeat(3, *([1] * (v.ndim - 1)))[:n] for k, v in tensors().items()}
    fields["group_id"] = torch.arange(n)
    _, lines, _ = validate(tmp_path, fields, "rloo")
    where = "groups [0, 1, 2, 3, 4, 5, 6, 7] have fewer (sizes [1, 1, 1, 1, 1, 1, 1, 1]), and 3 more groups"
    assert lines == [("group_id", "recipe.advantage (rloo) needs at least 2 rollouts per group", where)]


@pytest.mark.parametrize("recipe", ["dapo", "gspo", "rloo"])
def test_a_missing_old_logp_is_one_line_with_the_way_out(tmp_path, recipe):
    code, lines, _ = validate(tmp_path, tensors(old_logp=None), recipe)
    gate = lossplug.Recipe.load(recipe).gates[0].name
    assert code == 1 and lines == [("old_logp", f"required by gates[0] '{gate}', but the file has none{ON_POLICY}", "")]


def test_a_field_several_stages_need_is_one_line_naming_them_all(tmp_path):
    """A verl recipe: ``verl_equivalent`` of the vanilla loss (clip_ratio 0.2, token-mean) with rloo and token-level
    importance sampling (``rollout_is: token, rollout_is_threshold: 2.0``), written as the file a user saves of it
    (spelt out here: importing verl costs seconds). Three gates read old_logp, two behavior_logp."""
    recipe = {
        "name": "verl-vanilla+rloo",
        "advantage": {"name": "rloo"},
        "gates": [
            {"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2, "dual_clip_c": 3.0},
            {"name": "tis", "cap": 2.0},
            {"name": "offpolicy_metrics"},
        ],
        "reduction": {"name": "token"},
    }
    path = tmp_path / "verl.json"
    path.write_text(json.dumps(recipe))
    code, lines, output = validate(tmp_path, tensors(old_logp=None), str(path))
    gates = "gates[0] 'ppo_clip', gates[1] 'tis', gates[2] 'offpolicy_metrics'"
    assert code == 1
    assert lines == [
        ("old_logp", f"required by {gates}, but the file has none{ON_POLICY}", ""),
        ("behavior_logp", "required by gates[1] 'tis', gates[2] 'offpolicy_metrics', but the file has none", ""),
    ]
    assert "✗ 2 violations of PolicyBatch and recipe 'verl-vanilla+rloo'" in output


def test_values_and_shapes_are_one_line_each_with_the_position(tmp_path):
    logp = torch.full((B, T), -1.0)
    logp[1, 2] = float("nan")
    _, lines, _ = validate(tmp_path, tensors(logp=logp), "dapo")
    assert lines == [("logp", "must be finite on action positions", "(row 1, pos 2)")]
    _, lines, _ = validate(tmp_path, tensors(old_logp=torch.full((B, T + 1), -1.0)), "dapo")
    assert lines == [("old_logp", "shape must align with logp [B=4, T=3]: expected [4, 3], got [4, 4]", "")]


@pytest.mark.parametrize("recipe", ["dapo", "rloo", None])
def test_a_token_reward_on_a_prompt_position_is_one_line_with_its_position_and_value(tmp_path, recipe):
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, 0] = False  # the prompt's last token
    reward = torch.zeros(B, T)
    reward[:, -1] = 1.0
    reward[2, 0] = 0.5
    code, lines, _ = validate(tmp_path, tensors(action_mask=mask, reward=reward), *([recipe] if recipe else []))
    assert code == 1 and lines == [("reward", OFF_ACTION_REWARD, "(row 2, pos 0); the first is 0.5")]
    reward[2, 0] = 0.0
    code, lines, _ = validate(tmp_path, tensors(action_mask=mask, reward=reward), *([recipe] if recipe else []))
    assert code == 0 and lines == []


# ---------------------------------------------------------------------------------------------------------------------
# The Python API: the same wording, one line per missing field


def test_policy_loss_names_a_field_several_gates_need_once():
    batch = PolicyBatch(
        logp=torch.full((2, 2), -1.0), action_mask=torch.ones(2, 2, dtype=torch.bool), advantage=torch.ones(2)
    )
    recipe = lossplug.Recipe.load({"gates": ["ppo_clip", "icepop"], "reduction": "token"})
    with pytest.raises(BatchValidationError) as info:
        lossplug.policy_loss(batch, recipe)
    assert [str(v) for v in info.value.violations] == [
        f"old_logp: required by recipe.gates[0] (ppo_clip), recipe.gates[1] (icepop), but this PolicyBatch has none"
        f"{ON_POLICY}",
        "behavior_logp: required by recipe.gates[1] (icepop), but this PolicyBatch has none",
    ]


def test_estimate_advantages_refuses_a_token_reward_off_the_actions():
    mask = torch.tensor([[False, True, True], [False, True, True]])
    reward = torch.tensor([[0.0, 0.0, 1.0], [2.0, 0.0, 0.0]])
    batch = PolicyBatch.unchecked(
        logp=torch.zeros(2, 3), action_mask=mask, reward=reward, group_id=torch.tensor([0, 0])
    )
    with pytest.raises(BatchValidationError) as info:
        lossplug.compute_advantages(batch, "grpo")
    assert [str(v) for v in info.value.violations] == [f"reward: {OFF_ACTION_REWARD} — (row 1, pos 0); the first is 2"]


# ---------------------------------------------------------------------------------------------------------------------
# Every problem in one run: each field's rank on its own, a JSON file's nesting in lossplug's words


def run_validate(path, *args):
    """``(exit code, JSON report, human output, human stderr)`` of ``lossplug validate PATH ARGS``."""
    runner = CliRunner()
    env = {"COLUMNS": "250", "NO_COLOR": "1"}
    data = json.loads(runner.invoke(app, ["validate", str(path), *args, "--json"], env=env).stdout)
    human = runner.invoke(app, ["validate", str(path), *args], env=env)
    return human.exit_code, data, human.stdout, human.stderr


def test_a_3d_logp_does_not_hide_a_1d_mask(tmp_path):
    fields = tensors(logp=torch.full((B, T, 2), -1.0), action_mask=torch.ones(B, dtype=torch.bool))
    code, lines, _ = validate(tmp_path, fields)
    assert code == 1
    assert lines[:2] == [
        ("logp", "must be [B, T], got shape (4, 3, 2)", ""),
        ("action_mask", "must be [B, T], got shape [4]", ""),
    ]


def test_without_a_usable_logp_every_other_field_is_checked_on_its_own(tmp_path):
    fields = tensors(
        logp=torch.full((B, T, 2), -1.0),
        action_mask=torch.ones(B, T, dtype=torch.int8),  # right rank, wrong kind
        old_logp=torch.full((B,), -1.0),  # per token, given per row
        advantage=torch.ones(B, T, 2),  # [B] or [B, T]
        group_id=torch.zeros(B, 1, dtype=torch.int64),
    )
    _, lines, _ = validate(tmp_path, fields)
    assert lines == [
        ("logp", "must be [B, T], got shape (4, 3, 2)", ""),
        (
            "action_mask",
            "must be a bool tensor, got torch.int8 (convert with .bool() once you know it holds only 0/1)",
            "",
        ),
        ("old_logp", "must be [B, T], got shape [4]", ""),
        ("advantage", "must be [B] or [B, T], got shape [4, 3, 2]", ""),
        ("group_id", "must be [B], got shape [4, 1]", ""),
    ]


def test_a_ragged_json_file_names_every_problem_with_its_json_path(tmp_path):
    path = tmp_path / "batch.json"
    path.write_text(
        json.dumps(
            {
                "logp": [[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0]],  # row 3 is short
                "old_logp": [[-1.0, "x"], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]],  # a string
                "action_mask": [[True, True], [True, [True]], [True, True], True],  # nesting differs
                "reward": {"data": [1.0, 0.0, 1.0, 0.0], "dtype": "float33"},
                "group_id": [0, 0, 1, 1],
            }
        )
    )
    code, data, out, err = run_validate(path)
    assert code == 1 and data["error"] is None and not data["valid"]
    assert [(v["field"], v["where"]) for v in data["violations"]] == [
        ("logp", "$.logp[3] has 1 element where $.logp[0] has 2"),
        ("old_logp", "$.old_logp[0][1] is a string"),
        (
            "action_mask",
            "$.action_mask[1][1] is a list where $.action_mask[0][0] is a boolean, "
            "$.action_mask[3] is a boolean where $.action_mask[0] is a list",
        ),
        ("reward", "$.reward.dtype"),
    ]
    rules = [v["rule"] for v in data["violations"]]
    assert rules[:3] == [
        "must be a rectangular array: every list at one depth has the same length",
        "elements must be numbers or booleans",
        "must nest evenly: every element at one depth a list, or every one a value",
    ]
    assert rules[3].startswith("unknown dtype 'float33' (did you mean 'float32'?)")
    for text in (out + err, json.dumps(data)):
        assert "expected sequence" not in text and "dim 1" not in text and "invalid data type" not in text
    assert "✗ 4 violations of PolicyBatch" in out
    assert out.count("not read (below)") == 4  # the field table lists what the file holds, read or not


def test_a_list_torch_would_silently_truncate_is_ragged(tmp_path):
    """``torch.tensor([[], [1.0]])`` is a [2, 0] tensor: the 1.0 would be dropped without a word."""
    path = tmp_path / "batch.json"
    path.write_text(json.dumps({"logp": [[], [-1.0]], "action_mask": [[], [True]]}))
    _, data, _, _ = run_validate(path)
    assert [(v["field"], v["where"]) for v in data["violations"]] == [
        ("logp", "$.logp[1] has 1 element where $.logp[0] has 0"),
        ("action_mask", "$.action_mask[1] has 1 element where $.action_mask[0] has 0"),
    ]


def test_a_declared_integer_dtype_refuses_values_it_would_change(tmp_path):
    path = tmp_path / "batch.json"
    fields = {k: v.tolist() for k, v in tensors().items()}
    fields["group_id"] = {"data": [0, 0, 1.5, 1], "dtype": "int64"}
    path.write_text(json.dumps(fields))
    _, data, _, _ = run_validate(path)
    assert [(v["field"], v["rule"], v["where"]) for v in data["violations"]] == [
        ("group_id", "values must be representable as int64", "$.group_id.data[2] is 1.5")
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Log-probs of one policy passed for another's: warnings, not violations (unless --strict)

KL_RECIPE = {"advantage": "grpo", "gates": ["ppo_clip", "tis"], "regularizers": ["kl"], "reduction": "token"}


def logprob_tensors(*, behavior_shift, ref_shift):
    """old_logp with behavior_logp and ref_logp at the given distances (mean |Δ| on the actions)."""
    old = -torch.rand(B, T, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3 - 1
    return tensors(logp=old.clone(), old_logp=old, behavior_logp=old - behavior_shift, ref_logp=old - ref_shift)


def save_recipe(tmp_path, recipe):
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    return str(path)


def test_ref_logp_bitwise_equal_to_old_logp_warns_naming_both_when_the_recipe_reads_both(tmp_path):
    fields = logprob_tensors(behavior_shift=1e-3, ref_shift=0.5)
    fields["ref_logp"] = fields["old_logp"].clone()
    path = tmp_path / "batch.safetensors"
    from safetensors.torch import save_file

    save_file(fields, str(path))
    code, data, out, err = run_validate(path, "--recipe", save_recipe(tmp_path, KL_RECIPE))
    assert code == 0 and data["valid"] and data["violations"] == []
    (warning,) = data["warnings"]
    assert warning["field"] == "ref_logp"
    assert warning["message"].startswith(
        "bitwise equal to logp (the current policy) and old_logp (the policy before this update) on every action "
        "position (12 tokens), yet it should hold the frozen reference's log-probs: one was probably passed for the "
        "other"
    )
    assert "warning: ref_logp: bitwise equal to logp" in err and "passed for the other" not in out
    assert "✓ valid against PolicyBatch and recipe" in out and "1 warning (on stderr)" in out
    code, data, out, _ = run_validate(path, "--recipe", save_recipe(tmp_path, KL_RECIPE), "--strict")
    assert code == 1 and data["valid"] and "✗ 1 warning (on stderr) under --strict: the batch is valid against" in out
    # dapo reads old_logp but never ref_logp: the copy is harmless there
    _, data, _, _ = run_validate(path, "--recipe", "dapo")
    assert data["warnings"] == []


def test_behavior_logp_orders_of_magnitude_farther_from_old_than_ref_warns(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "batch.safetensors"
    recipe = save_recipe(tmp_path, KL_RECIPE)
    save_file(logprob_tensors(behavior_shift=1e-3, ref_shift=0.5), str(path))  # as it should be
    code, data, _, _ = run_validate(path, "--recipe", recipe)
    assert code == 0 and data["warnings"] == []
    save_file(logprob_tensors(behavior_shift=0.5, ref_shift=1e-3), str(path))  # the two swapped
    code, data, _, err = run_validate(path, "--recipe", recipe)
    assert code == 0
    (warning,) = data["warnings"]
    assert warning["field"] == "behavior_logp"
    assert warning["message"].startswith("500× farther from old_logp than ref_logp is (mean |Δ| on the actions 0.5 ")
    assert "look swapped" in warning["message"] and "look swapped" in err
