"""Every refusal of the TRL adapter names the next step, and a field TRL cannot feed is refused in the words of one
table (``refusals.UNFED``, ``refusals.UNFED_AT_ADVANTAGE``) that docs/trl.md's "What TRL cannot feed" is generated
from. Enumerated over every built-in plugin — with its defaults, and with each setting that changes the fields it
reads — through ``attach`` on a real ``GRPOTrainer`` (beta = 0, no vLLM, no rollout_func: the plainest trainer)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("trl")

import trl

from lossplug import LossplugError, PolicyBatch
from lossplug.adapters.trl import attach, refusals
from lossplug.adapters.trl.loss import TRL_FIELDS
from lossplug.adapters.unfed import variants
from lossplug.needs import ALWAYS
from lossplug.testing import tiny

FIELD_LINE = re.compile(r"^(?P<where>recipe\.[\w\[\]]+) \((?P<plugin>\w+)\) reads (?P<field>\w+): ")


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    tok = tiny.tiny_tokenizer()
    return trl.GRPOTrainer(
        model=tiny.tiny_model(tok),
        reward_funcs=[tiny.length_reward],
        args=tiny.tiny_grpo_config(tmp_path_factory.mktemp("refusals") / "out"),
        train_dataset=tiny.tiny_dataset(),
        processing_class=tok,
    )


def refusal_lines(trainer, recipe) -> list[str]:
    try:
        attach(trainer, recipe)
    except LossplugError as err:
        head, *lines = str(err).split("\n  - ")
        assert head == "lossplug cannot run this recipe in this TRL trainer without changing its meaning:"
        return lines
    return []


@pytest.fixture(scope="module")
def refused(trainer) -> dict[str, list[str]]:
    """Each built-in variant TRL refuses → its refusal lines."""
    out = {}
    for variant in variants():
        lines = refusal_lines(trainer, variant.recipe())
        if lines:
            out[variant.label] = lines
    return out


def expected_row(line: str):
    """The table row a field refusal must quote (None: not a field refusal)."""
    m = FIELD_LINE.match(line)
    if m is None or m["where"].startswith(("recipe.shapers", "recipe.filters")):
        return None  # (the rollout stages' refusals: refusals.ROLLOUT_UNFED, one position per completion)
    name = m["field"]
    if m["where"] == "recipe.advantage" and m["plugin"] not in refusals.PER_PROCESS_ADVANTAGES:
        return refusals.UNFED_AT_ADVANTAGE.get(name) or refusals.UNFED[name]
    return refusals.UNFED[name]


def test_the_enumeration_reaches_the_refusals_a_newcomer_meets(refused):
    for label in ("opd", "gigpo", "gae", "remax", "optimal_token_baseline", "kl", "top_entropy"):
        assert (label in refused) == (label != "top_entropy"), label  # TRL's forward pass gives the entropies


def test_every_refusal_of_a_built_in_names_its_next_step(refused):
    without = [(label, line) for label, lines in refused.items() for line in lines if "Next step: " not in line]
    assert not without, "refusals without a next step:\n" + "\n".join(f"{label}: {line}" for label, line in without)


def test_a_field_refusal_quotes_its_row_of_the_table(refused):
    for label, lines in refused.items():
        for line in lines:
            row = expected_row(line)
            if row is not None:
                assert line.endswith(f": {row.why}. Next step: {row.next_step}"), (label, line)


def test_opd_without_a_teacher_is_refused_with_how_to_give_it_one(refused):
    """opd runs as TRL's advantage (issue 'Teachers and turns': its task on the gathered rewards, its per-token signal
    per process); in the plainest trainer it lacks only a teacher, and the refusal says how to give it one. Its
    student, old_logp, is never refused (the adapter computes it where TRL does not)."""
    assert len(refused["opd"]) == 1
    teacher = refused["opd"][0]
    assert teacher.startswith("recipe.advantage (opd) reads teacher_logp")
    assert "Next step: pass attach(trainer, recipe, teacher_model=teacher)" in teacher
    behaviour = refused["opd (student: behavior_logp)"]
    assert any(line.startswith("recipe.advantage (opd) reads behavior_logp") for line in behaviour)


def test_every_field_trl_lacks_has_a_row():
    """A new contract field TRL does not fill cannot be refused without a next step: it needs a row first."""
    assert set(PolicyBatch.FIELD_NAMES) - refusals.PROVIDED == set(refusals.UNFED)
    # the advantage stage: every batch has logp and action_mask (placeholders there), and it computes the advantage
    at_advantage = set(PolicyBatch.FIELD_NAMES) - refusals.ADVANTAGE_PROVIDED - {*ALWAYS, "advantage"}
    assert at_advantage - set(refusals.UNFED) <= set(refusals.UNFED_AT_ADVANTAGE)
    assert set(refusals.UNFED_AT_ADVANTAGE) <= set(TRL_FIELDS)  # only what the loss stage has, at least sometimes


def test_the_docs_table_has_a_row_per_field_with_its_readers_and_next_step():
    table = refusals.unfed_markdown()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == len(refusals.UNFED) + len(refusals.UNFED_AT_ADVANTAGE)
    # the loss stage and opd (fed per process after generation): teacher_model=
    teacher = next(row for row in rows if row.startswith("| `teacher_logp` |"))
    assert "teacher_model=teacher" in teacher and "`opd`" in teacher and "`distillation`" in teacher
    at_advantage = next(row for row in rows if row.startswith("| `teacher_logp` (advantage stage)"))
    assert "`opd`" not in at_advantage and "one value per completion" in at_advantage
    turns = next(row for row in rows if row.startswith("| `trajectory_id`"))
    assert "`gigpo`" in turns and "`step_reinforce`" in turns and "rollout_func=" in turns
    for row in rows:
        assert row.count(" | ") == 3, row  # field, the plugins that read it, why, next step
