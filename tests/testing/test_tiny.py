"""lossplug.testing.tiny: a plugin author tests a gate inside a real TRL ``GRPOTrainer``, offline, with public names
only — the module docstring's example and the tutorial's (docs/write-a-gate.md) are run as written, and the default
trainer goes off-policy at its second step, so that a clip acts."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import lossplug
import lossplug.testing
from lossplug.testing import tiny

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_kit_or_the_tiny_helpers_imports_no_trainer_and_no_torch():
    code = (
        "import sys, lossplug.testing, lossplug.testing.tiny; "
        "print([m for m in ('torch', 'transformers', 'tokenizers', 'datasets', 'trl') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
    assert lossplug.testing.tiny is tiny and "tiny" in lossplug.testing.__all__


def test_every_public_name_is_documented():
    for name in tiny.__all__:
        value = getattr(tiny, name)
        if callable(value):
            assert inspect.getdoc(value), f"lossplug.testing.tiny.{name} has no docstring"


def test_the_tokenizer_and_model_are_built_locally_and_deterministic():
    pytest.importorskip("transformers")
    import torch

    tok = tiny.tiny_tokenizer()
    assert len(tok) == len(tiny.VOCAB) and tok.padding_side == "left"
    assert tok.decode(tok("what is 1 plus 2")["input_ids"]) == "what is 1 plus 2"
    a, b = tiny.tiny_model(tok, seed=3), tiny.tiny_model(tok, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert a.config.vocab_size == len(tok) and a.generation_config.eos_token_id == tok.eos_token_id


def docstring_example() -> str:
    """The module docstring's example (a doctest, run as one by tests/plugins/test_docstring_examples.py), as code."""
    import doctest

    return "".join(example.source for example in doctest.DocTestParser().get_examples(tiny.__doc__))


@pytest.mark.slow
def test_the_module_docstring_example_runs_a_third_party_gate_inside_grpo_trainer(tmp_path):
    pytest.importorskip("trl")
    import lossplug

    namespace: dict = {}
    exec(compile(docstring_example(), "lossplug.testing.tiny (docstring)", "exec"), namespace)
    namespace["test_soft_cut_runs_inside_trl"](tmp_path)  # asserts two logged steps carrying the gate's metric
    with pytest.raises(lossplug.RecipeError, match="soft_cut"):  # the example unregisters its gate again
        lossplug.registry().lookup("gate", "soft_cut")


@pytest.mark.slow
def test_tiny_grpo_trainer_runs_a_recipe_with_gradient_accumulation(tmp_path):
    pytest.importorskip("trl")
    rollout = tiny.TinyRollout(tiny.tiny_tokenizer())
    trainer = tiny.tiny_grpo_trainer(
        "dapo",
        tmp_path,
        max_steps=2,
        gradient_accumulation_steps=2,
        metrics="full",
        trainer_kwargs={"rollout_func": rollout},
    )
    assert trainer.args.max_steps == 2 and trainer.args.gradient_accumulation_steps == 2
    trainer.train()
    logs = [row for row in trainer.state.log_history if "loss" in row]
    assert len(logs) == 2
    for row in logs:
        assert {"lossplug/ppo_clip/clip_frac_high", "lossplug/effective/token_frac"} <= set(row)


def test_the_default_schedule_is_off_policy_and_a_callers_own_schedule_wins(tmp_path):
    pytest.importorskip("trl")

    def old_logps_computed(args):  # TRL 1.16's rule (GRPOTrainer._generate_and_score_completions), without vLLM
        return args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations) != 0

    for accumulation in (1, 2, 3):
        args = tiny.tiny_grpo_config(tmp_path, gradient_accumulation_steps=accumulation)
        assert (args.num_iterations, args.steps_per_generation) == (2, accumulation)  # a step is one generation
        assert old_logps_computed(args)
    on_policy = tiny.tiny_grpo_config(tmp_path, num_iterations=1)
    assert on_policy.num_iterations == 1 and not old_logps_computed(on_policy)
    own = tiny.tiny_grpo_config(tmp_path, steps_per_generation=2)  # the demo's schedule: TRL's num_iterations
    assert (own.num_iterations, own.steps_per_generation) == (1, 2) and old_logps_computed(own)
    assert tiny.tiny_grpo_config(tmp_path, generation_batch_size=8).num_iterations == 1


class LogRatioProbe:
    """Records, per policy-loss call (one micro-batch), the largest |logp − old_logp| over action tokens."""

    def __init__(self):
        self.largest = []

    @lossplug.hookimpl
    def lossplug_extra_metrics(self, batch, objective, recipe):
        self.largest.append(float((batch.logp - batch.old_logp).abs()[batch.action_mask].max()))


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_default_trainer_goes_off_policy_at_its_second_step_and_ppo_clip_clips(tmp_path, accumulation):
    pytest.importorskip("trl")
    probe = LogRatioProbe()
    lossplug.register_plugin(probe, "log_ratio_probe")
    try:
        trainer = tiny.tiny_grpo_trainer("dapo", tmp_path, gradient_accumulation_steps=accumulation)
        trainer.train()
    finally:
        lossplug.unregister_plugin(probe)
    first, second = probe.largest[:accumulation], probe.largest[accumulation:]
    assert len(second) == accumulation  # two optimizer steps, each of `accumulation` micro-batches
    assert all(gap < 1e-5 for gap in first), first  # fresh rollouts: ratio 1 (up to rounding)
    assert all(gap > 0.05 for gap in second), second  # the same rollouts after an update: some ratio ≠ 1
    logs = [row for row in trainer.state.log_history if "loss" in row]
    clipped = [row["lossplug/ppo_clip/clip_frac_low"] + row["lossplug/ppo_clip/clip_frac_high"] for row in logs]
    assert clipped[0] == 0 and clipped[1] > 0, clipped  # PPO's ε = 0.2 / 0.28 clips at the second step


def tutorial_trl_test() -> str:
    """The Python block of docs/write-a-gate.md's section "Test it inside TRL, offline"."""
    section = (ROOT / "docs" / "write-a-gate.md").read_text().split("## Test it inside TRL, offline", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_tutorials_trl_test_runs_the_example_gate_and_sees_it_act(tmp_path, monkeypatch):
    """The tutorial's test as written, with the example plugin (examples/lossplug-example-plugin) registered
    in-process where it is not installed; the test itself asserts that tanh_clip saturated some token."""
    pytest.importorskip("trl")
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "lossplug-example-plugin"))
    import lossplug_example_plugin

    installed = "tanh_clip" in lossplug.registry().plugins["gate"]
    if not installed:
        lossplug.register_plugin(lossplug_example_plugin, "tanh_clip")
    try:
        namespace: dict = {}
        exec(compile(tutorial_trl_test(), "docs/write-a-gate.md", "exec"), namespace)
        namespace["test_tanh_clip_in_grpo_trainer"](tmp_path)
    finally:
        if not installed:
            lossplug.unregister_plugin(lossplug_example_plugin)
        sys.modules.pop("lossplug_example_plugin", None)
