"""End to end: real ``train()`` runs of a few CPU steps on the tiny model, through both ways in."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

import trl

from lossplug import Provenance, Recipe
from lossplug.adapters.trl import LossplugGRPOTrainer, attach
from lossplug.testing import tiny

pytestmark = pytest.mark.slow


def lossplug_keys(trainer):
    return {k for entry in trainer.state.log_history for k in entry if k.startswith("lossplug/")}


def test_lossplug_trainer_trains_dapo_and_records_the_run(tmp_path):
    model, tok = tiny.tiny_model_and_tokenizer(tmp_path / "model")  # saved: beta > 0 rebuilds the reference
    args = tiny.tiny_grpo_config(
        tmp_path / "out", max_steps=3, gradient_accumulation_steps=2, num_iterations=2, beta=0.02
    )
    trainer = LossplugGRPOTrainer(
        model=model,
        reward_funcs=[tiny.length_reward],
        args=args,
        train_dataset=tiny.tiny_dataset(),
        processing_class=tok,
        recipe="dapo",
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 3
    keys = lossplug_keys(trainer)
    for key in (
        "lossplug/loss",
        "lossplug/kl",
        "lossplug/ppo_clip/clip_frac_high",
        "lossplug/ppo_clip/clip_frac_low",
        "lossplug/update/approx_kl",
        "lossplug/advantage/mean",
    ):
        assert key in keys, (key, sorted(keys))
    # metrics="basic" (the default): no ratio quantiles or effective-sample fractions on every micro-batch
    assert not {k for k in keys if k.startswith(("lossplug/ratio/", "lossplug/effective/"))}, sorted(keys)
    history = [e for e in trainer.state.log_history if "loss" in e]
    assert all("kl" in e and "entropy" in e for e in history)  # TRL's own metrics are still there
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in history)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    out = tmp_path / "out"
    assert Recipe.from_file(out / "recipe.yaml").to_dict() == Recipe.preset("dapo").to_dict()
    provenance = Provenance.model_validate_json((out / "provenance.json").read_text())
    assert provenance.reference is not None and provenance.behavior.engine.endswith(" generate")
    assert '"trl"' in (out / "versions.json").read_text()


def test_attach_to_an_already_built_grpo_trainer_and_train(tmp_path):
    tok = tiny.tiny_tokenizer()
    args = tiny.tiny_grpo_config(tmp_path / "out", max_steps=2, loss_type="bnpo")
    trainer = trl.GRPOTrainer(
        model=tiny.tiny_model(tok),
        reward_funcs=[tiny.length_reward, tiny.digit_reward],
        args=args,
        train_dataset=tiny.tiny_dataset(),
        processing_class=tok,
    )
    assert attach(trainer, "grpo") is trainer
    trainer.train()
    assert isinstance(trainer, trl.GRPOTrainer) and trainer.state.global_step == 2
    assert {"lossplug/loss", "lossplug/advantage/mean"} <= lossplug_keys(trainer)
    assert (tmp_path / "out" / "recipe.yaml").is_file()


def test_rollout_func_with_an_engine_correction_trains(tmp_path):
    tok = tiny.tiny_tokenizer()
    args = tiny.tiny_grpo_config(tmp_path / "out", max_steps=2, mask_truncated_completions=True)
    recipe = {"preset": "dapo", "gates": ["ppo_clip", {"name": "icepop", "low": 0.5, "high": 5.0}]}
    trainer = LossplugGRPOTrainer(
        model=tiny.tiny_model(tok),
        reward_funcs=[tiny.length_reward],
        args=args,
        train_dataset=tiny.tiny_dataset(),
        processing_class=tok,
        recipe=recipe,
        rollout_func=tiny.TinyRollout(tok),
        metrics="full",
    )
    trainer.train()
    keys = lossplug_keys(trainer)
    assert {
        "lossplug/ratio/engine/mean",
        "lossplug/ratio/update/p95",
        "lossplug/effective/token_frac",
        "lossplug/icepop/reject_frac_low",
        "lossplug/icepop/ratio/max",
        "lossplug/behavior_logp/unscored_frac",
    } <= keys
