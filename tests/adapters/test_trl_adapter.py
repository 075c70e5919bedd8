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
    assert adapter.LossplugGRPOTrainer.__module__ == "lossplug.adapters.trl.trainer"  # looked up lazily, importing trl


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


@pytest.mark.parametrize(
    "settings, gates",
    [
        # loss_type × importance_sampling_level (each proven end to end in test_trl_parity_e2e.py)
        (
            {"loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_neg": 2.5},
            [{"name": "vespo", "k_pos": 1.5, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.5}],
        ),
        (
            {"loss_type": "cispo", "importance_sampling_level": "sequence", "epsilon_high": 5.0},
            [{"name": "cispo_seq", "eps_low": None, "eps_high": None, "ratio_max": 5.0, "log_ratio_clamp": None}],
        ),
        (
            {"loss_type": "sapo", "importance_sampling_level": "sequence", "sapo_temperature_neg": 1.2},
            [{"name": "sapo_seq", "tau_pos": 1.0, "tau_neg": 1.2, "log_ratio_clamp": None}],
        ),
        (
            {"loss_type": "grpo", "importance_sampling_level": "sequence", "delta": 1.5},
            [{"name": "gspo", "eps_low": 0.2, "eps_high": 0.2, "log_ratio_clamp": 80.0, "delta": 1.5}],
        ),
        ({"loss_type": "grpo", "delta": 2.0}, [{"name": "ppo_clip", "delta": 2.0}]),
        # corrections: TRL multiplies the per-token policy loss by them
        (
            {"off_policy_mask_threshold": 0.3},
            [{"name": "ppo_clip"}, {"name": "off_policy_mask", "threshold": 0.3, "sampling_logp": "old_logp"}],
        ),
        ({"top_entropy_quantile": 0.2}, [{"name": "ppo_clip"}, {"name": "top_entropy", "quantile": 0.2}]),
        # vLLM importance sampling: every mode, with TRL's bounds (a missing bound: none)
        (
            {"use_vllm": True, "vllm_importance_sampling_mode": "token_truncate"},
            [{"name": "ppo_clip"}, {"name": "tis", "cap": 3.0, "log_ratio_clamp": None}],
        ),
        (
            {
                "use_vllm": True,
                "vllm_importance_sampling_mode": "sequence_truncate",
                "vllm_importance_sampling_clip_max": 2,
            },
            [{"name": "ppo_clip"}, {"name": "tis_seq", "cap": 2.0, "ratio": "product", "log_ratio_clamp": None}],
        ),
        (  # clip_min with a *_truncate mode: TRL raises ratios below it to it — tis' floor
            {
                "use_vllm": True,
                "vllm_importance_sampling_mode": "token_truncate",
                "vllm_importance_sampling_clip_min": 0.5,
            },
            [{"name": "ppo_clip"}, {"name": "tis", "cap": 3.0, "floor": 0.5, "log_ratio_clamp": None}],
        ),
        (
            {"use_vllm": True, "vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.5},
            [{"name": "ppo_clip"}, {"name": "icepop", "low": 0.5, "high": 3.0, "log_ratio_clamp": 80.0}],
        ),
        (
            {"use_vllm": True},  # TRL's default mode: sequence_mask, clip_max 3, no clip_min
            [{"name": "ppo_clip"}, {"name": "icepop_seq", "low": 1e-38, "high": 3.0, "ratio": "product"}],
        ),
        (
            {
                "use_vllm": True,
                "vllm_importance_sampling_mode": "sequence_mask",
                "vllm_importance_sampling_clip_min": 0.1,
                "vllm_importance_sampling_clip_max": None,
            },
            [{"name": "ppo_clip"}, {"name": "icepop_seq", "low": 0.1, "high": 1e38}],
        ),
        (
            {"use_vllm": True, "vllm_importance_sampling_correction": False},
            [{"name": "ppo_clip"}],  # no correction: TRL's loss has none either
        ),
        (  # vespo folds the truncated / masked token ratios into its weight: no separate correction gate
            {"loss_type": "vespo", "use_vllm": True, "vllm_importance_sampling_mode": "token_mask"},
            [{"name": "vespo", "engine_correction": "token_mask", "engine_ratio_min": None, "engine_ratio_max": 3.0}],
        ),
    ],
)
def test_trl_equivalent_maps_every_loss_option(tmp_module, settings, gates):
    recipe, _ = trl_equivalent(config(tmp_module, **settings))
    assert [g.name for g in recipe.gates] == [g["name"] for g in gates]
    for got, want in zip(recipe.gates, gates):
        assert {k: got.params[k] for k in want if k != "name"} == {k: v for k, v in want.items() if k != "name"}
    assert Recipe.from_yaml(recipe.to_yaml()) == recipe


def test_trl_equivalent_maps_the_other_settings(tmp_module):
    recipe, population = trl_equivalent(config(tmp_module, loss_type="vespo"))
    assert (recipe.reduction.name, population) == ("token", "generation")  # TRL reduces vespo like dapo
    # the off-policy mask reads the sampling log-probs when the trainer has them (vLLM, a rollout_func)
    for kw, source in (({}, "behavior_logp"), ({"use_vllm": True}, "behavior_logp")):
        args = config(tmp_module, off_policy_mask_threshold=0.1, vllm_importance_sampling_correction=False, **kw)
        recipe, _ = trl_equivalent(args, sampling_logprobs=True if not kw else None)
        assert recipe.gates[1].params["sampling_logp"] == source
    # normalize_then_sum: the per-function rewards, weighted after normalisation
    recipe, _ = trl_equivalent(
        config(tmp_module, multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0, 0.5])
    )
    assert recipe.advantage.name == "normalize_then_sum"
    assert tuple(recipe.advantage.params["weights"]) == (1.0, 0.5)
    # regularizers: beta (k3, × the update ratio per token / per sequence), the entropy bonus (TRL's reduction)
    recipe, _ = trl_equivalent(config(tmp_module, beta=0.04))
    kl = recipe.regularizers[0]
    assert kl.name == "kl"
    assert {k: kl.params[k] for k in ("coef", "estimator", "ratio_weight", "clamp")} == {
        "coef": 0.04,
        "estimator": "k3",
        "ratio_weight": "token",
        "clamp": False,  # TRL's plain exp(δ) − δ − 1
    }
    recipe, _ = trl_equivalent(config(tmp_module, beta=0.04, importance_sampling_level="sequence"))
    assert recipe.regularizers[0].params["ratio_weight"] == "sequence"
    recipe, _ = trl_equivalent(config(tmp_module, beta=0.04, use_bias_correction_kl=False))
    assert recipe.regularizers[0].params["ratio_weight"] == "none"
    recipe, _ = trl_equivalent(config(tmp_module, entropy_coef=0.01))
    entropy = recipe.regularizers[0]
    assert (entropy.name, entropy.params["coef"], entropy.params["population"]) == ("entropy", 0.01, "micro_batch")
    recipe, _ = trl_equivalent(
        config(tmp_module, use_adaptive_entropy=True, entropy_coef=0.1, entropy_target=0.3, entropy_coef_delta=0.01)
    )
    params = recipe.regularizers[0].params
    assert (params["adaptive"], params["target"], params["coef_delta"], params["coef_min"], params["coef_max"]) == (
        True,
        0.3,
        0.01,
        0.0,
        1.0,
    )
    # the static bonus with top_entropy_quantile < 1 acts on the high-entropy tokens: the adapter keeps TRL's own
    recipe, _ = trl_equivalent(config(tmp_module, entropy_coef=0.01, top_entropy_quantile=0.5))
    assert not recipe.regularizers


def test_trl_equivalent_refuses_what_has_no_equivalent(tmp_module):
    with pytest.raises(LossplugError, match="high-entropy tokens only"):
        trl_equivalent(config(tmp_module, use_adaptive_entropy=True, top_entropy_quantile=0.5))


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


def test_subclass_and_attach(plain):
    ours = plain(LossplugGRPOTrainer, recipe="grpo")
    assert isinstance(ours, trl.GRPOTrainer) and ours._lossplug.recipe.to_dict() == Recipe.preset("grpo").to_dict()
    trainer = plain()
    assert attach(trainer, "dapo") is trainer
    assert type(trainer) is trl.GRPOTrainer  # attach leaves the class alone (its overrides are on the instance)
    attach(trainer, {"preset": "dapo", "reduction": "response"})  # attaching again replaces the recipe
    assert trainer._lossplug.recipe.reduction.name == "response"


def test_attach_to_a_user_subclass_keeps_it(plain):
    class MyTrainer(trl.GRPOTrainer):
        def my_method(self):
            return 42

    trainer = attach(plain(MyTrainer), "grpo")
    assert type(trainer) is MyTrainer and trainer.my_method() == 42


def test_a_bad_recipe_fails_before_the_model_is_touched(plain):
    with pytest.raises(RecipeError, match="ppo_clp|did you mean"):
        plain(LossplugGRPOTrainer, recipe={"gates": ["ppo_clp"], "reduction": "token"})
    with pytest.raises(LossplugError, match="population"):
        plain(LossplugGRPOTrainer, recipe="grpo", population="step")


@pytest.mark.parametrize(
    "setting, value, message",
    [
        ("use_vllm", True, r"importance-sampling correction is a recipe gate.*icepop_seq.*correction=False"),
        ("off_policy_mask_threshold", 0.5, r"off-policy sequence mask is a recipe gate.*off_policy_mask"),
        ("top_entropy_quantile", 0.2, r"high-entropy token mask is a recipe gate.*top_entropy, quantile: 0.2"),
        ("use_adaptive_entropy", True, r"adaptive coefficient is a recipe regularizer.*adaptive: True"),
    ],
)
def test_refuses_trl_options_the_recipe_does_not_carry(plain, setting, value, message):
    """A TRL option that weights the loss must be in the recipe (trl_equivalent puts it there): the adapter never
    applies TRL's own, so a recipe without it would silently drop it."""
    trainer = plain()
    setattr(trainer.args, setting, value)
    with pytest.raises(LossplugError, match=message):
        attach(trainer, "dapo")
    assert type(trainer) is trl.GRPOTrainer and not hasattr(trainer, "_lossplug")  # a refused attach: as it was
    attach(trainer, trl_equivalent(trainer.args)[0])  # the equivalent recipe carries it


def test_refuses_a_recipe_option_of_other_settings_than_trl(plain):
    trainer = plain()
    trainer.args.top_entropy_quantile = 0.2
    with pytest.raises(LossplugError, match="quantile: 0.2"):
        attach(trainer, {"preset": "dapo", "gates": ["ppo_clip", {"name": "top_entropy", "quantile": 0.5}]})


def test_kl_and_entropy_are_never_counted_twice(plain, tmp_path):
    model, tok = tiny.tiny_model_and_tokenizer(tmp_path / "model")
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=[tiny.length_reward],
        args=config(tmp_path, beta=0.04, entropy_coef=0.01),
        train_dataset=tiny.tiny_dataset(),
        processing_class=tok,
    )
    kl = {"name": "kl", "coef": 0.1, "estimator": "k2"}
    with pytest.raises(LossplugError, match=r"KL regularizer \(coef 0.1\) and TRL's beta=0.04.*twice"):
        attach(trainer, {"preset": "dapo", "regularizers": [kl]})
    with pytest.raises(LossplugError, match="entropy regularizer and TRL's entropy bonus.*counted twice"):
        attach(trainer, {"preset": "dapo", "regularizers": [{"name": "entropy", "coef": 0.5}]})
    # the recipe's own KL replaces TRL's when beta names its coefficient (beta only switches the reference on)
    attach(trainer, {"preset": "dapo", "regularizers": [{**kl, "coef": 0.04}]})
    assert trainer._lossplug.recipe_kl and not trainer._lossplug.recipe_entropy
    # without beta TRL computes no reference log-probs
    trainer.beta = 0.0
    with pytest.raises(LossplugError, match="beta=0: TRL computes reference log-probs only when beta != 0"):
        attach(trainer, {"preset": "dapo", "regularizers": [kl]})


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


def test_a_recipe_advantage_replaces_normalize_then_sum(plain, tmp_path):
    """TRL's multi_objective_aggregation is a setting of TRL's advantage, which the recipe's replaces (recorded)."""
    trainer = plain()
    trainer.args.multi_objective_aggregation = "normalize_then_sum"
    attach(trainer, "grpo")
    versions = json.loads((adapter.write_record(trainer, tmp_path / "record") / "versions.json").read_text())
    assert versions["trl_settings_replaced"]["multi_objective_aggregation"] == "normalize_then_sum"


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
    args = config(tmp_module, gradient_accumulation_steps=2, num_iterations=1, mask_truncated_completions=True)
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


def test_rows_carry_the_per_function_rewards(rollout_trainer):
    """TRL's rewards_per_func (one column per reward function, unweighted) travel with the rows like the reward."""
    _, micro_batches = rollout_trainer
    for mb in micro_batches:
        components = mb["lossplug_reward_components"]
        assert components.shape == (mb["completion_ids"].shape[0], 1)
        assert torch.equal(components[:, 0], mb["lossplug_reward"])  # one function, weight 1


def test_per_function_rewards_must_all_be_scored(tmp_path):
    def sometimes_none(completions, **kwargs):
        return [None if i % 3 == 1 else 1.0 for i, _ in enumerate(completions)]

    tok = tiny.tiny_tokenizer()
    trainer = LossplugGRPOTrainer(
        model=tiny.tiny_model(tok),
        reward_funcs=[tiny.length_reward, sometimes_none],
        args=config(tmp_path, multi_objective_aggregation="normalize_then_sum"),
        train_dataset=tiny.tiny_dataset(),
        processing_class=tok,
        recipe=trl_equivalent(config(tmp_path, multi_objective_aggregation="normalize_then_sum"))[0],
    )
    trainer.model.train()
    with pytest.raises(LossplugError, match=r"reward function\(s\) \['sometimes_none'\] returned None"):
        trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


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
    assert "lossplug/tis/trunc_frac" in m
    assert "entropy" in m  # TRL's own metric: entropies are computed as TRL computes them
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
    assert (versions["adapter"]["trainer"], versions["adapter"]["trl_trainer"], versions["adapter"]["attached"]) == (
        "LossplugGRPOTrainer",
        "GRPOTrainer",
        False,
    )
    assert versions["trl_settings_replaced"]["loss_type"] == trainer.args.loss_type
