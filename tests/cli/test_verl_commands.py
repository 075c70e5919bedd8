"""`lossplug verl check` and `lossplug verl overrides`: the report, the exit codes (0 clean, 1 problems, 2 unreadable
input or no verl) and the overrides printed alone, ready for an .overrides file."""

from __future__ import annotations

import shlex
import sys

import pytest
from typer.testing import CliRunner

from lossplug.cli import app

WIDE = {"COLUMNS": "200", "NO_COLOR": "1"}
RUN = "actor_rollout_ref:\n  actor:\n    ppo_micro_batch_size_per_gpu: 2\n"


def run(*args):
    result = CliRunner().invoke(app, ["verl", *args], env=WIDE)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"lossplug verl {' '.join(args)} raised instead of reporting") from result.exception
    assert "Traceback" not in result.output
    return result


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(RUN)
    return path


def test_help_lists_both_commands():
    result = run("--help")
    assert result.exit_code == 0 and "check" in result.output and "overrides" in result.output


def test_a_clean_config_exits_0(config):
    pytest.importorskip("verl")
    result = run("check", str(config))
    assert result.exit_code == 0, result.output
    assert "no problem found" in result.output


def test_a_misspelt_key_exits_1_with_the_closest_key(config):
    pytest.importorskip("verl")
    result = run("check", str(config), "actor_rollout_ref.actor.clip_ratio_hgh=0.28", "algorithm.use_kl_in_reward=true")
    assert result.exit_code == 1, result.output
    assert "actor_rollout_ref.actor.clip_ratio_hgh — did you mean clip_ratio_high?" in result.output
    assert "2 problems" not in result.output  # use_kl_in_reward alone counts the KL once


def test_a_kl_counted_twice_exits_1(config):
    pytest.importorskip("verl")
    result = run("check", str(config), "algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.use_kl_loss=true")
    assert result.exit_code == 1 and "KL counted twice: algorithm.use_kl_in_reward" in result.output


def test_check_with_a_recipe_prints_its_overrides_and_what_they_change(config):
    pytest.importorskip("verl")
    result = run("check", str(config), "--recipe", "grpo")
    assert result.exit_code == 0, result.output
    assert "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean" in result.stdout
    assert "actor_rollout_ref.actor.loss_agg_mode: 'token-mean' → 'seq-mean-token-mean'" in result.stdout


def test_a_recipe_field_verl_does_not_provide_exits_1(config, tmp_path):
    pytest.importorskip("verl")
    recipe = tmp_path / "gdpo.yaml"
    recipe.write_text("advantage: gdpo\ngates: [ppo_clip]\nreduction: token\n")
    result = run("check", str(config), "--recipe", str(recipe))
    assert result.exit_code == 1 and "recipe field: algorithm.lossplug" in result.output
    overrides = run("overrides", str(recipe))
    assert overrides.exit_code == 1 and "reward_components" in overrides.output


def test_overrides_prints_the_lines_alone_and_they_load_back(config, tmp_path):
    pytest.importorskip("verl")
    from lossplug.adapters.verl.check import check_config

    result = run("overrides", "dapo")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[:3] == [
        "actor_rollout_ref.actor.policy_loss._target_=lossplug.adapters.verl.LossplugPolicyLossConfig",
        "actor_rollout_ref.actor.policy_loss.loss_mode=lossplug",
        "+actor_rollout_ref.actor.policy_loss.recipe=dapo",
    ]
    assert "+algorithm.lossplug=dapo" in lines
    # what an .overrides file holds (run_lossplug.sh passes each line verbatim): the same composer accepts it
    assert check_config(config, lines).ok
    assert run("check", str(config), *lines).exit_code == 0


def test_overrides_for_the_shell_are_one_quoted_command_line(tmp_path):
    pytest.importorskip("verl")
    recipe = tmp_path / "tis.yaml"
    recipe.write_text("gates: [ppo_clip, {name: tis, cap: 2.0}]\nreduction: token\n")
    lines = run("overrides", str(recipe)).stdout.splitlines()
    result = run("overrides", str(recipe), "--shell")
    assert result.exit_code == 0, result.output
    assert "'+actor_rollout_ref.actor.policy_loss.rollout_correction=${algorithm.rollout_correction}'" in result.stdout
    # the shell hands Hydra exactly the lines of the .overrides form
    assert shlex.split(result.stdout.replace("\\\n", " ")) == lines


def test_unreadable_input_exits_2(tmp_path, config):
    pytest.importorskip("verl")
    assert run("check", str(tmp_path / "nope.yaml")).exit_code == 2
    bad = run("check", str(config), "algorithm.gamma=[1,")
    assert bad.exit_code == 2 and "the override 'algorithm.gamma=[1,'" in bad.output
    assert run("overrides", "no_such_preset").exit_code == 2


def test_without_verl_one_line_names_the_extra(monkeypatch, config):
    for name in [m for m in sys.modules if m == "verl" or m.startswith(("verl.", "lossplug.adapters.verl"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "verl", None)  # import verl → ModuleNotFoundError
    for args in (("check", str(config)), ("overrides", "dapo")):
        result = run(*args)
        assert result.exit_code == 2
        assert result.output.strip().splitlines()[-1].endswith("pip install 'lossplug[verl]'")
