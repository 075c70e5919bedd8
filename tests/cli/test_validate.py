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
