"""The example override files for a real GPU run, composed with verl's own Hydra config (no GPU needed): every key
exists in verl, the actor config instantiates lossplug's PolicyLossConfig with the recipe, verl's validate_config
accepts it, and the composed ``algorithm`` section drives the estimator."""

from __future__ import annotations

import os
import shlex
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")

import verl
from hydra import compose, initialize_config_dir
from verl.trainer.main_ppo import need_critic, need_reference_policy
from verl.trainer.ppo import core_algos
from verl.utils.config import omega_conf_to_dataclass, validate_config

import lossplug
from lossplug.adapters.verl import POLICY_RECIPE_KEY, LossplugPolicyLossConfig, load_recipe, verl_equivalent

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "verl"
VERL_CONFIG = Path(verl.__file__).parent / "trainer" / "config"
DOC = ROOT / "docs" / "verl.md"


def overrides(path: Path) -> list[str]:
    """What run_lossplug.sh passes: every non-blank, non-comment line, verbatim."""
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.strip().startswith("#")]


@pytest.fixture(scope="module")
def composer():
    with initialize_config_dir(config_dir=str(VERL_CONFIG), version_base=None):
        yield lambda lines: compose(config_name="ppo_trainer", overrides=lines)


@pytest.mark.parametrize(
    "name,preset,critic", [("dapo_lossplug.overrides", "dapo", False), ("ppo_lossplug.overrides", "ppo", True)]
)
def test_example_overrides_compose_with_verls_config(composer, name, preset, critic):
    cfg = composer(overrides(EXAMPLES / name))
    actor = cfg.actor_rollout_ref.actor
    assert actor.policy_loss._target_ == "lossplug.adapters.verl.LossplugPolicyLossConfig"
    assert actor.policy_loss.loss_mode == "lossplug" and actor.policy_loss.recipe == preset
    if critic:  # verl passes a registered estimator no critic values: GAE stays verl's own, equal to the recipe's
        assert cfg.algorithm.adv_estimator == "gae"
        advantage = verl_equivalent(algorithm_config=cfg.algorithm).advantage
        assert advantage is not None and advantage.to_dict() == lossplug.Recipe.preset(preset).advantage.to_dict()
    else:
        assert cfg.algorithm.adv_estimator == "lossplug" and cfg.algorithm.lossplug == preset

    # verl's own driver-side check instantiates the actor config, i.e. LossplugPolicyLossConfig (recipe validated);
    # its critic part would load the critic model's tokenizer, which needs the model files (not here)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Disabled critic")
        assert need_critic(cfg) is critic
        validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=False)
    built = omega_conf_to_dataclass(actor)
    assert isinstance(built.policy_loss, LossplugPolicyLossConfig)
    recipe = load_recipe(built.policy_loss.recipe, POLICY_RECIPE_KEY)
    assert recipe.to_dict() == lossplug.Recipe.preset(preset).to_dict()
    # the recipe's reduction and verl's loss_agg_mode (entropy / KL) agree
    assert lossplug.Recipe.preset(preset).reduction.name == "token" and actor.loss_agg_mode == "token-mean"

    # the composed algorithm section is exactly what verl hands the estimator
    B, T = 4, 5
    mask = torch.ones(B, T, dtype=torch.long)
    rewards = torch.zeros(B, T)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.5])
    index = __import__("numpy").array(["a", "a", "b", "b"], dtype=object)
    estimator = core_algos.get_adv_estimator_fn(cfg.algorithm.adv_estimator)
    if critic:  # verl's own gae (called by verl with gamma/lam, no index)
        adv, ret = estimator(
            token_level_rewards=rewards,
            values=torch.randn(B, T),
            response_mask=mask,
            gamma=cfg.algorithm.gamma,
            lam=cfg.algorithm.lam,
        )
    else:
        adv, ret = estimator(token_level_rewards=rewards, response_mask=mask, index=index, config=cfg.algorithm)
    assert adv.shape == ret.shape == (B, T) and torch.isfinite(adv).all()


def test_recipes_as_a_path_or_inline_through_hydra(composer, tmp_path):
    path = tmp_path / "my_recipe.yaml"
    path.write_text(lossplug.Recipe.preset("dapo", reduction="response").to_yaml())
    base = overrides(EXAMPLES / "dapo_lossplug.overrides")
    inline = "{gates: [{name: ppo_clip, eps_low: 0.2, eps_high: 0.28}], reduction: {name: token}}"
    for value, expect in ((str(path), "response"), (inline, "token")):
        lines = [line for line in base if not line.startswith("+actor_rollout_ref.actor.policy_loss.recipe=")]
        cfg = composer(lines + [f"+actor_rollout_ref.actor.policy_loss.recipe={value}"])
        built = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        assert load_recipe(built.policy_loss.recipe, POLICY_RECIPE_KEY).reduction.name == expect


def test_the_run_script_reads_the_override_file_line_by_line():
    script = (EXAMPLES / "run_lossplug.sh").read_text()
    assert os.access(EXAMPLES / "run_lossplug.sh", os.X_OK)
    assert "mapfile -t overrides" in script and "python3 -m verl.trainer.main_ppo" in script
    assert "dapo_lossplug.overrides" in script and "check_registration" in script
    assert all(shlex.split(line) for line in overrides(EXAMPLES / "dapo_lossplug.overrides"))


def test_the_doc_shows_the_same_override_lines():
    text = DOC.read_text()
    keys = (
        "actor_rollout_ref.actor.policy_loss.",
        "+actor_rollout_ref.actor.policy_loss.",
        "actor_rollout_ref.actor.loss_agg_mode=",
        "algorithm.adv_estimator=",
        "+algorithm.lossplug=",
    )
    shown = [line for line in overrides(EXAMPLES / "dapo_lossplug.overrides") if line.startswith(keys)]
    assert len(shown) == 6
    for line in shown:
        assert line in text, f"docs/verl.md lacks the override line {line!r}"
