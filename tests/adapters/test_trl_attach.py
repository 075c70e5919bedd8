"""``attach()`` leaves the trainer's class alone: its overrides live on the instance, hold it weakly, survive a deep
copy, never stack, and a refused attach leaves nothing behind. Builds small real GRPOTrainers on a tiny local model."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest

pytest.importorskip("trl")

import trl

from lossplug import LossplugError
from lossplug.adapters.trl import LossplugGRPOTrainer, attach
from lossplug.adapters.trl import trainer as trainer_module
from lossplug.testing import tiny


@pytest.fixture
def build(tmp_path):
    """A fresh trainer of ``cls`` (a plain GRPOTrainer by default, beta = 0) on a fresh tiny model."""

    def build(cls=trl.GRPOTrainer, **kw):
        tok = tiny.tiny_tokenizer()
        recipe = {"recipe": kw.pop("recipe")} if "recipe" in kw else {}
        return cls(
            model=tiny.tiny_model(tok),
            reward_funcs=[tiny.length_reward],
            args=tiny.tiny_grpo_config(tmp_path / "out", **kw),
            train_dataset=tiny.tiny_dataset(),
            processing_class=tok,
            **recipe,
        )

    return build


def test_attach_keeps_the_type_and_routes_trls_calls_through_the_recipe(build, monkeypatch):
    trainer = build()
    assert attach(trainer, "dapo") is trainer
    assert type(trainer) is trl.GRPOTrainer and isinstance(trainer, trl.GRPOTrainer)
    assert not isinstance(trainer, LossplugGRPOTrainer)
    assert set(trainer_module._OVERRIDES) <= set(vars(trainer))
    # TRL's compute_loss calls self._compute_loss: the instance's override, i.e. the adapter's loss
    calls = []
    monkeypatch.setattr(trainer_module, "compute_loss", lambda t, model, inputs: calls.append((t, inputs)) or 0.0)
    trainer.compute_loss(trainer.model, {"x": 1})
    assert calls == [(trainer, {"x": 1})]


def test_a_refused_attach_leaves_no_attribute_behind(build):
    trainer = build()
    before = dict(vars(trainer))
    with pytest.raises(LossplugError, match=r"advantage \(gae\) reads value"):
        attach(trainer, "ppo")
    assert vars(trainer).keys() == before.keys() and all(vars(trainer)[k] is v for k, v in before.items())
    assert type(trainer) is trl.GRPOTrainer


def test_attaching_twice_replaces_the_recipe_and_never_stacks(build):
    trainer = build()
    attach(trainer, "dapo")
    first = {name: vars(trainer)[name] for name in trainer_module._OVERRIDES}
    attach(trainer, {"preset": "dapo", "reduction": "response"})
    assert trainer._lossplug.recipe.reduction.name == "response"
    for name, override in first.items():  # each override calls the class's method, never the one it replaced
        assert vars(trainer)[name] is not override and vars(trainer)[name].name == name
    with pytest.raises(LossplugError):
        attach(trainer, "ppo")
    assert trainer._lossplug.recipe.reduction.name == "response"  # a refused re-attach keeps the recipe in force


def test_a_trainer_with_its_own_compute_loss_on_the_instance_is_refused(build):
    trainer = build()
    trainer._compute_loss = lambda model, inputs: 0.0
    with pytest.raises(LossplugError, match="its own _compute_loss"):
        attach(trainer, "grpo")
    assert not hasattr(trainer, "_lossplug")


def test_the_overrides_hold_the_trainer_weakly(build):
    """A dropped attached trainer is freed at once, like a plain one (no reference cycle through its overrides)."""
    trainer = attach(build(), "grpo")
    ref = weakref.ref(trainer)
    gc.disable()
    try:
        del trainer
        assert ref() is None
    finally:
        gc.enable()


def test_a_deep_copy_runs_the_recipe_on_itself(build):
    trainer = attach(build(), "grpo")
    twin = copy.deepcopy(trainer)
    assert type(twin) is trl.GRPOTrainer and twin._lossplug is not trainer._lossplug
    assert all(vars(twin)[name]._trainer() is twin for name in trainer_module._OVERRIDES)


def test_the_subclass_has_the_overrides_as_methods(build):
    """``LossplugGRPOTrainer`` (and a user's subclass of it) overrides on the class; attaching to one only replaces
    the recipe."""
    assert {n for n in vars(trainer_module._Mixin) if not n.startswith("__")} - {"_lossplug"} == set(
        trainer_module._OVERRIDES
    )
    ours = build(LossplugGRPOTrainer, recipe="grpo")
    attach(ours, "dapo")
    assert type(ours) is LossplugGRPOTrainer and not set(trainer_module._OVERRIDES) & set(vars(ours))
    assert ours._lossplug.recipe.reduction.name == "token" and not ours._lossplug.attached


def test_a_user_subclass_keeps_its_overrides_under_the_recipe(build):
    """The override chain is the subclass's: the adapter's override, then the user's method, then TRL's."""

    class CountingTrainer(trl.GRPOTrainer):
        scored = 0

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            self.scored += 1
            return output

    trainer = attach(build(CountingTrainer, max_steps=1), "grpo")
    assert type(trainer) is CountingTrainer and trainer._lossplug.trl_class == "CountingTrainer"
    trainer.train()
    assert trainer.scored == 1 and trainer._lossplug.rounds > 0
    assert trainer._lossplug.record_written
