"""lossplug.testing.tiny: a plugin author tests a gate inside a real TRL ``GRPOTrainer``, offline, with public names
only — the module docstring's example is run as written."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest

import lossplug.testing
from lossplug.testing import tiny


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
    """The indented block after "A plugin author's test" in the module docstring."""
    doc = tiny.__doc__
    start = doc.index("A plugin author's test")
    block = doc[doc.index("::\n", start) + 3 :]
    lines = []
    for line in block.splitlines():
        if line and not line.startswith("    "):
            break
        lines.append(line)
    return textwrap.dedent("\n".join(lines))


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
