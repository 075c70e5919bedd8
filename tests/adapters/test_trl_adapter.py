"""lossplug.adapters.trl: import hygiene, version gate, TRL-config mapping, refusals, validation, behaviour log-probs,
records. Builds small real GRPOTrainers on a tiny local model (no hub)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl")

import trl

import lossplug
from lossplug import BatchValidationError, LogProbSource, LossplugError, Provenance, Recipe, RecipeError
from lossplug.adapters import trl as adapter
from lossplug.adapters.trl import LossplugGRPOTrainer, attach, trl_equivalent
from lossplug.testing import tiny


def test_importing_lossplug_or_the_adapter_module_does_not_import_trl():
    code = (
        "import sys, lossplug, lossplug.adapters, lossplug.adapters.trl, lossplug.testing.tiny\n"
        "bad = [m for m in ('trl', 'transformers', 'datasets', 'vllm') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert adapter.LossplugGRPOTrainer.__module__ == "lossplug.adapters.trl"  # looked up lazily, importing trl


def test_version_gate():
    adapter.check_trl_version(trl.__version__)
    adapter.check_trl_version("1.16.5")
    for version in ("1.13.0", "1.15.2", "1.17.0", "2.0.0"):
        with pytest.raises(LossplugError, match=r"tested with TRL 1\.16"):
            adapter.check_trl_version(version)


def test_version_gate_escape_hatch_warns(monkeypatch):
    monkeypatch.setenv(adapter.ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(UserWarning, match="continuing"):
        adapter.check_trl_version("1.17.0")


# ---------------------------------------------------------------------------------------------------------------------
# TRL config → recipe


@pytest.fixture(scope="module")
def tmp_module(tmp_path_factory):
    return tmp_path_factory.mktemp("trl_adapter")


def config(tmp, **kw):
    return tiny.tiny_grpo_config(tmp / "out", **kw)


@pytest.mark.parametrize(
    "loss_type, gate, reduction, population",
    [
        ("grpo", "ppo_clip", "response", "generation"),
        ("bnpo", "ppo_clip", "token", "micro_batch"),
        ("dr_grpo", "ppo_clip", "fixed", "generation"),
        ("dapo", "ppo_clip", "token", "generation"),
        ("cispo", "cispo", "token", "generation"),
        ("sapo", "sapo", "response", "generation"),
        ("luspo", "ppo_clip", "sequence_sum", "generation"),
    ],
)
def test_trl_equivalent_mapping(tmp_module, loss_type, gate, reduction, population):
    args = config(
        tmp_module, loss_type=loss_type, epsilon_high=5.0 if loss_type == "cispo" else 0.28, scale_rewards="batch"
    )
    recipe, pop = trl_equivalent(args)
    assert (recipe.gates[0].name, recipe.reduction.name, pop) == (gate, reduction, population)
    assert recipe.advantage.to_dict() == {
        "name": "grpo",
        "scale": "batch",
        "std": "sample",
        "eps": 1e-4,
        "eps_mode": "add",
    }
    if loss_type == "cispo":
        assert recipe.gates[0].params["ratio_max"] == 5.0 and recipe.gates[0].params["eps_low"] is None
    if loss_type == "dr_grpo":
        assert recipe.reduction.params["budget"] == args.max_completion_length
    assert Recipe.from_yaml(recipe.to_yaml()) == recipe


def test_trl_equivalent_refuses_what_has_no_equivalent(tmp_module):
    with pytest.raises(LossplugError, match="vespo"):
        trl_equivalent(config(tmp_module, loss_type="vespo"))
    with pytest.raises(LossplugError, match="sequence"):
        trl_equivalent(config(tmp_module, loss_type="sapo", importance_sampling_level="sequence"))
    with pytest.raises(LossplugError, match="normalize_then_sum"):
        trl_equivalent(config(tmp_module, multi_objective_aggregation="normalize_then_sum"))
    recipe, _ = trl_equivalent(config(tmp_module, loss_type="grpo", delta=2.0))
    assert recipe.gates[0].params["dual_clip_c"] == 2.0


# ---------------------------------------------------------------------------------------------------------------------
# Building and attaching


@pytest.fixture
def plain(tmp_path):
    """A fresh, plain GRPOTrainer (beta = 0) on a fresh tiny model."""

    def build(cls=trl.GRPOTrainer, **kw):
        tok = tiny.tiny_tokenizer()
        model = tiny.tiny_model(tok)
        extra = {k: kw.pop(k) for k in ("recipe", "validate", "population", "rollout_func", "provenance") if k in kw}
        return cls(
            model=model,
            reward_funcs=[tiny.length_reward],
            args=config(tmp_path, **kw),
            train_dataset=tiny.tiny_dataset(),
            processing_class=tok,
            **extra,
        )

    return build


def test_subclass_and_attach_give_the_same_class(plain):
    ours = plain(LossplugGRPOTrainer, recipe="grpo")
    assert isinstance(ours, trl.GRPOTrainer) and ours._lossplug.recipe.to_dict() == Recipe.preset("grpo").to_dict()
    trainer = plain()
    assert attach(trainer, "dapo") is trainer
    assert type(trainer) is LossplugGRPOTrainer and type(trainer) is type(ours)
    attach(trainer, {"preset": "dapo", "reduction": "response"})  # attaching again replaces the recipe
    assert trainer._lossplug.recipe.reduction.name == "response"


def test_attach_to_a_user_subclass_keeps_it(plain):
    class MyTrainer(trl.GRPOTrainer):
        def my_method(self):
            return 42

    trainer = attach(plain(MyTrainer), "grpo")
    assert isinstance(trainer, MyTrainer) and trainer.my_method() == 42
    assert type(trainer).__name__ == "LossplugMyTrainer"


def test_a_bad_recipe_fails_before_the_model_is_touched(plain):
    with pytest.raises(RecipeError, match="ppo_clp|did you mean"):
        plain(LossplugGRPOTrainer, recipe={"gates": ["ppo_clp"], "reduction": "token"})
    with pytest.raises(LossplugError, match="population"):
        plain(LossplugGRPOTrainer, recipe="grpo", population="step")


@pytest.mark.parametrize(
    "setting, value, message",
    [
        ("use_vllm", True, "vllm_importance_sampling_correction=False"),
        ("off_policy_mask_threshold", 0.5, "off_policy_mask_threshold"),
        ("top_entropy_quantile", 0.2, "top_entropy_quantile"),
        ("use_adaptive_entropy", True, "adaptive entropy"),
    ],
)
def test_refuses_trl_options_it_would_silently_drop(plain, setting, value, message):
    trainer = plain()
    setattr(trainer.args, setting, value)
    with pytest.raises(LossplugError, match=message):
        attach(trainer, "dapo")
    assert type(trainer) is trl.GRPOTrainer  # a refused attach leaves the trainer as it was


@pytest.mark.parametrize(
    "recipe, message",
    [
        ({"preset": "dapo", "gates": ["ppo_clip", "tis"]}, r"behavior_logp: TRL has rollout log-probs only"),
        ("ppo", r"recipe.advantage \(gae\) reads value"),
        ({"preset": "grpo", "advantage": {"name": "gae", "kl_coef": 0.1}}, "ref_logp"),
    ],
)
def test_refuses_recipes_reading_fields_trl_does_not_have(plain, recipe, message):
    with pytest.raises(LossplugError, match=message):
        attach(plain(), recipe)


def test_refuses_normalize_then_sum_with_a_recipe_advantage(plain):
    trainer = plain()
    trainer.args.multi_objective_aggregation = "normalize_then_sum"
    with pytest.raises(LossplugError, match="normalize_then_sum"):
        attach(trainer, "grpo")
    attach(trainer, {"gates": ["ppo_clip"], "reduction": "token"})  # no advantage stage: TRL's is kept


def test_refuses_a_class_that_overrides_compute_loss(plain):
    class Custom(trl.GRPOTrainer):
        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, inputs)

    with pytest.raises(LossplugError, match="Custom overrides _compute_loss"):
        attach(plain(Custom), "grpo")


def test_refuses_rloo_trainer_and_other_objects(tmp_path):
    tok = tiny.tiny_tokenizer()
    args = trl.RLOOConfig(
        output_dir=str(tmp_path),
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        gradient_checkpointing=False,
        beta=0.0,
    )
    rloo = trl.RLOOTrainer(
        model=tiny.tiny_model(tok),
        reward_funcs=[tiny.length_reward],
        args=args,
        train_dataset=tiny.tiny_dataset(),
        processing_class=tok,
    )
    with pytest.raises(LossplugError, match="RLOOTrainer is not supported.*recipe 'rloo'"):
        attach(rloo, "rloo")
    with pytest.raises(LossplugError, match="supports GRPOTrainer"):
        attach(object(), "grpo")


# ---------------------------------------------------------------------------------------------------------------------
# Batches: validation, behaviour log-probs, tool tokens


@pytest.fixture(scope="module")
def rollout_trainer(tmp_module):
    """A LossplugGRPOTrainer fed by a rollout_func (behaviour log-probs, tool tokens, truncated rows masked out),
    with one generation batch prepared."""
    tok = tiny.tiny_tokenizer()
    args = config(tmp_module, gradient_accumulation_steps=2, mask_truncated_completions=True)
    trainer = LossplugGRPOTrainer(
        model=tiny.tiny_model(tok),
        reward_funcs=[tiny.length_reward],
        args=args,
        train_dataset=tiny.tiny_dataset(),
        processing_class=tok,
        rollout_func=tiny.TinyRollout(tok, seed=5),
        metrics="full",
        recipe={"preset": "dapo", "gates": ["ppo_clip", {"name": "tis", "cap": 2.0}]},
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    return trainer, list(trainer._buffered_inputs)


def test_rows_carry_group_ids_and_rewards_through_the_shuffle(rollout_trainer):
    trainer, micro_batches = rollout_trainer
    ids = torch.cat([mb["lossplug_group_id"] for mb in micro_batches])
    rewards = torch.cat([mb["lossplug_reward"] for mb in micro_batches])
    adv = torch.cat([mb["advantages"] for mb in micro_batches])
    assert sorted(torch.bincount(ids - ids.min()).tolist()) == [4, 4]
    for g in ids.unique():  # the advantage is a function of the row's own group: grpo with group std
        r, a = rewards[ids == g], adv[ids == g]
        expected = (r - r.mean()) / (r.std() + 1e-6)
        assert torch.allclose(a, torch.where(r.max() == r.min(), 0.0, expected), atol=1e-5)


def test_behaviour_logprobs_feed_the_engine_ratio(rollout_trainer):
    trainer, micro_batches = rollout_trainer
    mb = micro_batches[0]
    trainer._metrics["train"].clear()
    with torch.no_grad():
        trainer._compute_loss(trainer.model, mb)
    m = trainer._metrics["train"]
    action = (mb["completion_mask"] * mb["tool_mask"]).bool()
    with torch.no_grad():  # num_iterations 1, aligned accumulation: TRL's old log-probs are logp.detach()
        old = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1),
            torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1),
            mb["completion_ids"].shape[1],
        )[0]
    behavior = mb["sampling_per_token_logps"]
    assert (torch.isnan(behavior) & action).any()  # unscored tokens exist...
    ratio = torch.where(torch.isnan(behavior), 1.0, (old - behavior).exp())  # ...and get engine ratio 1 (TRL)
    assert m["lossplug/ratio/engine/mean"][0] == pytest.approx(float(ratio[action].mean()), rel=1e-5)
    assert m["lossplug/behavior_logp/unscored_frac"][0] > 0
    assert "lossplug/tis/trunc_frac" in m and "entropy" in m
    assert trainer._lossplug.provenance.behavior.engine.startswith("rollout_func TinyRollout")


def test_tool_tokens_and_masked_rows_are_not_actions(rollout_trainer):
    """Tool tokens (tool_mask 0) and rows TRL masked out (truncated) carry no gradient."""
    trainer, micro_batches = rollout_trainer
    mb = micro_batches[0]
    assert (mb["tool_mask"] == 0).any() and (mb["completion_mask"].sum(-1) == 0).any()
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
    att = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
    captured = {}
    original = trainer._get_per_token_logps_and_entropies

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        out[0].retain_grad()
        captured["logp"] = out[0]
        return out

    trainer._get_per_token_logps_and_entropies = spy
    try:
        trainer._compute_loss(trainer.model, mb).backward()
    finally:
        del trainer._get_per_token_logps_and_entropies
        trainer.model.zero_grad(set_to_none=True)
    grad = captured["logp"].grad
    action = (mb["completion_mask"] * mb["tool_mask"]).bool()
    assert ids.shape[0] == grad.shape[0] and att.shape == ids.shape
    assert (grad[~action] == 0).all() and (grad[action] != 0).any()


def test_validation_full_refuses_a_bad_batch_off_does_not(rollout_trainer):
    trainer, micro_batches = rollout_trainer
    bad = dict(micro_batches[0])
    adv = bad["advantages"].clone()
    adv[0] = float("inf")
    bad["advantages"] = adv
    with torch.no_grad():
        with pytest.raises(BatchValidationError, match="advantage.*finite"):
            trainer._compute_loss(trainer.model, bad)
        trainer._lossplug.validate = "off"
        try:
            trainer._compute_loss(trainer.model, bad)
        finally:
            trainer._lossplug.validate = "full"


def test_mixed_logprob_conventions_are_refused(plain):
    hot = LogProbSource(engine="vllm", temperature=0.7)
    cold = LogProbSource(engine="transformers", temperature=1.0)
    with pytest.raises(LossplugError, match="engine ratio"):
        plain(
            LossplugGRPOTrainer,
            recipe={"preset": "dapo", "gates": ["ppo_clip", "tis"]},
            rollout_func=tiny.TinyRollout(tiny.tiny_tokenizer()),
            provenance=Provenance(behavior=hot, old=cold, current=cold),
        )
    # a recipe that does not read behaviour log-probs only records them
    plain(
        LossplugGRPOTrainer,
        recipe="dapo",
        rollout_func=tiny.TinyRollout(tiny.tiny_tokenizer()),
        provenance=Provenance(behavior=hot, old=cold, current=cold),
    )


def test_write_record(plain, tmp_path):
    trainer = plain(LossplugGRPOTrainer, recipe="sapo")
    path = adapter.write_record(trainer, tmp_path / "record")
    assert Recipe.from_file(path / "recipe.yaml").to_dict() == Recipe.preset("sapo").to_dict()
    provenance = Provenance.model_validate_json((path / "provenance.json").read_text())
    assert provenance.current.temperature == trainer.args.temperature
    # plain transformers generation: the old policy samples, recorded as the behaviour source
    assert provenance.behavior.engine.endswith(" generate") and "old policy samples" in provenance.behavior.checkpoint
    versions = json.loads((path / "versions.json").read_text())
    assert versions["versions"]["trl"] == trl.__version__
    assert versions["versions"]["lossplug"] == lossplug.__version__
    assert versions["adapter"]["population"] == "generation"
    assert (versions["adapter"]["trainer"], versions["adapter"]["trl_trainer"]) == (
        "LossplugGRPOTrainer",
        "GRPOTrainer",
    )
    assert versions["trl_settings_replaced"]["loss_type"] == trainer.args.loss_type
