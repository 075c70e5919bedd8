"""``lossplug.adapters.verl.check``: a verl config composed as verl's main_ppo composes it, checked on a CPU box —
unknown keys with the closest valid one, a KL counted twice, what the adapter refuses and recipe fields verl does
not provide — and the overrides that switch verl to a recipe, which load through the same composer."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("verl")

from lossplug.adapters.verl.check import ConfigError, check_config, compose_config, recipe_overrides

#: the one setting verl's ActorConfig requires that ppo_trainer.yaml leaves unset
RUN = "actor_rollout_ref:\n  actor:\n    ppo_micro_batch_size_per_gpu: 2\n"
DAPO_LINES = [
    "actor_rollout_ref.actor.policy_loss._target_=lossplug.adapters.verl.LossplugPolicyLossConfig",
    "actor_rollout_ref.actor.policy_loss.loss_mode=lossplug",
    "+actor_rollout_ref.actor.policy_loss.recipe=dapo",
    "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "actor_rollout_ref.actor.entropy_coeff=0.0",
    "actor_rollout_ref.actor.use_kl_loss=false",
    "algorithm.adv_estimator=lossplug",
    "+algorithm.lossplug=dapo",
]


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def kinds(report) -> list[tuple[str, str]]:
    return [(p.kind, p.where) for p in report.problems]


def test_a_clean_config_has_no_problem(tmp_path):
    report = check_config(write(tmp_path, RUN))
    assert report.ok and report.problems == []
    assert report.config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 2  # laid over verl's defaults
    assert report.config.algorithm.adv_estimator == "gae"


def test_a_hydra_config_with_a_defaults_list_composes_over_verls(tmp_path):
    path = write(tmp_path, "defaults:\n  - ppo_trainer\n  - _self_\n" + RUN + "algorithm:\n  gamma: 0.9\n")
    report = check_config(path, ["algorithm.lam=0.5"])
    assert report.ok, report.problems
    assert (report.config.algorithm.gamma, report.config.algorithm.lam) == (0.9, 0.5)


def test_misspelt_keys_are_named_with_the_closest_valid_key(tmp_path):
    path = write(tmp_path, RUN.replace("    ppo_micro", "    clip_ratio_hgh: 0.28\n    ppo_micro"))
    report = check_config(path, ["algorithm.gama=0.9", "+algorithm.adv_estimatr=grpo", "+trainr.x=1"])
    found = {p.where: p.message for p in report.problems}
    assert found["actor_rollout_ref.actor.clip_ratio_hgh"] == "did you mean clip_ratio_high?"
    assert found["algorithm.gama"] == "did you mean gamma?"  # an override Hydra would refuse: still named
    assert found["algorithm.adv_estimatr"] == "did you mean adv_estimator?"
    assert found["trainr"] == "did you mean trainer?"
    assert {p.kind for p in report.problems} == {"unknown key"}  # verl's own refusal of the actor is not repeated


def test_free_form_sections_and_lossplug_keys_are_not_unknown(tmp_path):
    overrides = [
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        *DAPO_LINES,
    ]
    assert check_config(write(tmp_path, RUN), overrides).ok


def test_a_kl_counted_twice(tmp_path):
    report = check_config(
        write(tmp_path, RUN), ["algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.use_kl_loss=true"]
    )
    assert kinds(report) == [("KL counted twice", "algorithm.use_kl_in_reward")]
    assert "use_kl_in_reward=false" in report.problems[0].message


def test_a_recipe_kl_regularizer_with_the_kl_in_the_reward(tmp_path):
    recipe = write(tmp_path, "gates: [ppo_clip]\nreduction: token\nregularizers: [{name: kl, coef: 0.05}]\n", "r.yaml")
    report = check_config(write(tmp_path, RUN), ["algorithm.use_kl_in_reward=true"], recipe=recipe)
    assert "actor_rollout_ref.actor.use_kl_loss=true" in report.overrides  # verl adds the recipe's KL loss
    assert "actor_rollout_ref.actor.kl_loss_coef=0.05" in report.overrides
    assert kinds(report) == [("KL counted twice", "algorithm.use_kl_in_reward")]


def test_the_adapter_refuses_a_kl_regularizer_verl_does_not_add(tmp_path):
    recipe = write(tmp_path, "gates: [ppo_clip]\nreduction: token\nregularizers: [{name: kl, coef: 0.05}]\n", "r.yaml")
    lines = [line for line in DAPO_LINES if "recipe=" not in line]
    report = check_config(write(tmp_path, RUN), [*lines, f"+actor_rollout_ref.actor.policy_loss.recipe={recipe}"])
    assert kinds(report) == [("lossplug", "actor_rollout_ref.actor.policy_loss.recipe")]
    assert "not what verl's ppo_loss adds" in report.problems[0].message


def test_a_recipe_field_verl_does_not_provide(tmp_path):
    # gdpo reads reward components, which verl hands only to its own gdpo estimator (with its reward keys)
    recipe = write(tmp_path, "advantage: gdpo\ngates: [ppo_clip]\nreduction: token\n", "r.yaml")
    report = check_config(write(tmp_path, RUN), recipe=recipe)
    assert kinds(report) == [("recipe field", "algorithm.lossplug")]
    assert "reward_components" in report.problems[0].message
    assert not any(line.startswith("algorithm.adv_estimator") for line in report.overrides)
    # the same recipe already selected in the config: the estimator's refusal, found before launch
    configured = check_config(
        write(tmp_path, RUN), ["algorithm.adv_estimator=lossplug", f"+algorithm.lossplug={recipe}"]
    )
    assert kinds(configured) == [("recipe field", "algorithm.lossplug")]


def test_a_critic_recipe_runs_as_verls_own_estimator(tmp_path):
    lines, problems, notes = recipe_overrides("ppo")
    assert problems == [] and any("verl's own adv_estimator=gae" in n for n in notes)
    assert lines[-4:] == [
        "algorithm.adv_estimator=gae",
        "algorithm.gamma=1.0",
        "algorithm.lam=0.95",
        "critic.enable=true",
    ]


@pytest.mark.parametrize(
    "advantage, extra",
    [
        ("{name: gae, lam: 0.95, critic_lam: 1.0}", ["critic.enable=true"]),  # no verl estimator has two λ
        ("ktae", []),
        ("{name: reinforce_plus_plus_baseline, kl_coef: 0.2}", []),
    ],
)
def test_a_recipe_reading_what_verl_does_not_pass_runs_as_lossplug_reading_its_dataproto(tmp_path, advantage, extra):
    recipe = write(tmp_path, f"advantage: {advantage}\ngates: [ppo_clip]\nreduction: token\n", "r.yaml")
    lines, problems, notes = recipe_overrides(recipe)
    assert problems == []
    assert lines[-2 - len(extra) :] == ["algorithm.adv_estimator=lossplug", f"+algorithm.lossplug={recipe}", *extra]
    if "kl_coef" in advantage:  # ref_log_prob is there only with a reference policy: the note says what to set
        assert any("reads ref_log_prob" in n and "use_kl_loss=true" in n for n in notes), notes


def test_the_overrides_of_a_preset_are_the_documented_lines():
    lines, problems, _ = recipe_overrides("dapo")
    assert (lines, problems) == (DAPO_LINES, [])
    docs = (Path(__file__).resolve().parents[2] / "docs" / "verl.md").read_text()
    assert all(line in docs for line in DAPO_LINES[:4] + DAPO_LINES[-2:])


@pytest.mark.parametrize(
    "recipe",
    [
        "gates: [{name: ppo_clip, eps_low: 0.2, eps_high: 0.28}]\nreduction: response\n",
        "gates: [ppo_clip, {name: tis, cap: 2.0}]\nreduction: token\nregularizers: [{name: entropy, coef: 0.01}]\n",
        "advantage: rloo\ngates: [cispo]\nreduction: {name: fixed, budget: 512}\n",
    ],
)
def test_the_printed_overrides_load_through_the_same_composer(tmp_path, recipe):
    """Round trip: the overrides, given as plain overrides, compose and pass the check — the config then runs the
    recipe (its file by absolute path)."""
    path = write(tmp_path, recipe, "r.yaml")
    config = write(tmp_path, RUN)
    switched = check_config(config, recipe=path)
    assert switched.ok, switched.problems
    again = check_config(config, switched.overrides)
    assert again.ok, again.problems
    policy = again.config.actor_rollout_ref.actor.policy_loss
    assert policy.loss_mode == "lossplug" and policy.recipe == str(path.resolve())


def test_a_recipe_path_hydra_would_misread_is_quoted(tmp_path):
    folder = tmp_path / "my recipes, v2"
    folder.mkdir()
    path = write(folder, "gates: [ppo_clip]\nreduction: token\n", "r=1.yaml")
    lines, _, _ = recipe_overrides(path)
    assert f"+actor_rollout_ref.actor.policy_loss.recipe='{path.resolve()}'" in lines
    config = compose_config(write(tmp_path, RUN), lines)
    assert config.actor_rollout_ref.actor.policy_loss.recipe == str(path.resolve())


def test_settings_that_take_lossplug_out_of_the_loop(tmp_path):
    config = write(tmp_path, RUN)
    bypass = check_config(config, [*DAPO_LINES, "algorithm.rollout_correction.bypass_mode=true"])
    assert kinds(bypass) == [("lossplug", "algorithm.rollout_correction.bypass_mode")]
    no_target = check_config(config, ["+actor_rollout_ref.actor.policy_loss.recipe=dapo"])
    assert kinds(no_target) == [("lossplug", "actor_rollout_ref.actor.policy_loss.recipe")]
    assert "_target_=lossplug.adapters.verl.LossplugPolicyLossConfig" in no_target.problems[0].message


def test_what_cannot_be_composed_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        check_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="cannot read it as YAML"):
        check_config(write(tmp_path, "actor_rollout_ref: [unclosed\n", "broken.yaml"))
    with pytest.raises(ConfigError, match="YAML mapping"):
        check_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="algorithm.gamma"):
        check_config(write(tmp_path, RUN), ["algorithm.gamma=[1,"])
