"""Teachers and turns in TRL's GRPOTrainer (issue 'Teachers and turns', items 1 and 3).

* A teacher: two real ``GRPOTrainer`` steps of a recipe whose regularizer reads ``teacher_logp``; every
  micro-batch's ``teacher_logp`` equals the ``teacher_model``'s log-probs of the same completions computed here
  directly (a plain forward, ``log_softmax(logits / temperature)``, float32, 1e-6), or a rollout_func's
  ``teacher_logprobs`` exactly. Refused: another vocabulary size, a teacher nothing reads, two teachers; non-finite
  teacher log-probs, a rollout's ``teacher_logprobs`` of another length or missing are named with their rows.
* ``opd`` as TRL's advantage: two real steps (alone, with a ``grpo`` task, with a rollout's teacher and behaviour
  log-probs), each generation batch sliced into two micro-batches: the ``[B, T]`` advantages the loss reads equal
  ``coef·(teacher_logp − student) + grpo`` computed here by hand (plain forwards of the teacher and of the student
  before the update, or the rollout's own values; the group advantage written out), float32, 1e-6. Refused: no
  teacher, behaviour log-probs TRL does not have, no task with a filter, a ``mix`` with an ``opd`` component.
* Turns: ``gigpo`` and ``step_reinforce`` at TRL's advantage seam on the ``trajectory_id`` / ``anchor_id`` a
  ``rollout_func`` returns (strings and integers): the advantages TRL's batch carries equal
  ``lossplug.estimate_advantages`` on the same rewards with ids numbered by hand. Refused: no rollout_func; an id
  that is neither an integer nor a string, or missing, is named with its row.
"""

from __future__ import annotations

import math

import pytest
import torch

import lossplug
from lossplug.contracts import LossplugError

pytest.importorskip("trl")

from lossplug.adapters.trl import loss as trl_loss
from lossplug.testing import tiny

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TEMPERATURE = 0.7


# -- a regularizer that reads teacher_logp (the built-in one is written elsewhere: this test does not depend on it) --
@lossplug.regularizer("lpx_teacher_logp_gap", requires=("teacher_logp",))
def _teacher_gap(inp, p):
    """logp − teacher_logp: the sampled tokens' log-ratio to the teacher (a single-sample reverse-KL estimate)."""
    return lossplug.RegularizerOutput(term=inp.logp - inp.batch.teacher_logp)


class _TeacherReader:
    @lossplug.hookimpl
    def lossplug_register_regularizers(self, register):
        register(_teacher_gap)


@pytest.fixture
def teacher_reader():
    plugin = _TeacherReader()
    lossplug.register_plugin(plugin, "lpx-teacher-reader")
    yield
    lossplug.unregister_plugin(plugin)


TEACHER_RECIPE = {
    "advantage": "grpo",
    "gates": ["ppo_clip"],
    "reduction": "token",
    "regularizers": [{"name": "lpx_teacher_logp_gap", "coef": 0.1}],
}


def direct_teacher_logps(teacher, inputs):
    """The teacher's log-probs of the completions, written independently of TRL's fused head: a plain forward over
    prompt + completion, the logits of the completion positions divided by the temperature, log-softmax, gathered
    at the sampled ids."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    T = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        logits = teacher(input_ids=ids, attention_mask=mask).logits[:, -T - 1 : -1].float()
    logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    return logp.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)


def test_the_loss_sees_the_teachers_log_probs_of_the_completions_over_two_steps(tmp_path, teacher_reader, monkeypatch):
    tok = tiny.tiny_tokenizer()
    teacher = tiny.tiny_model(tok, seed=1)
    seen = []
    original = trl_loss.policy_batch

    def recording(trainer, st, inputs, *args, **kwargs):
        batch = original(trainer, st, inputs, *args, **kwargs)
        seen.append((dict(inputs), batch))
        return batch

    monkeypatch.setattr(trl_loss, "policy_batch", recording)
    trainer = tiny.tiny_grpo_trainer(
        TEACHER_RECIPE,
        tmp_path / "out",
        tokenizer=tok,
        temperature=TEMPERATURE,
        trainer_kwargs={"teacher_model": teacher},
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    teacher_before = [p.detach().clone() for p in teacher.parameters()]
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(teacher_before, teacher.parameters()))  # frozen: never trained
    assert not teacher.training
    assert len(seen) >= 2
    checked = 0
    for inputs, batch in seen:
        action = inputs["completion_mask"].bool()
        rows = action.any(-1)
        expected = direct_teacher_logps(teacher, inputs)[rows]
        assert batch.teacher_logp is not None and batch.teacher_logp.dtype == torch.float32
        assert batch.teacher_logp.shape == batch.logp.shape
        torch.testing.assert_close(
            torch.where(batch.action_mask, batch.teacher_logp, 0),
            torch.where(batch.action_mask, expected, 0),
            atol=1e-6,
            rtol=0,
        )
        # a teacher of its own: not the student's log-probs
        assert not torch.allclose(batch.teacher_logp[batch.action_mask], batch.logp.detach()[batch.action_mask])
        checked += int(batch.action_mask.sum())
    assert checked > 0
    losses = [e["lossplug/loss"] for e in trainer.state.log_history if "lossplug/loss" in e]
    assert losses and all(math.isfinite(v) for v in losses)


def test_attach_takes_the_teacher_too(tmp_path, teacher_reader):
    from trl import GRPOTrainer

    from lossplug.adapters.trl import attach

    tok = tiny.tiny_tokenizer()
    teacher = tiny.tiny_model(tok, seed=1)
    trainer = GRPOTrainer(
        model=tiny.tiny_model(tok),
        reward_funcs=[tiny.length_reward],
        args=tiny.tiny_grpo_config(tmp_path / "out", temperature=TEMPERATURE),
        train_dataset=tiny.tiny_dataset(),
        processing_class=tok,
    )
    attach(trainer, TEACHER_RECIPE, teacher_model=teacher)
    assert type(trainer) is GRPOTrainer
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    action = inputs["completion_mask"].bool()
    torch.testing.assert_close(
        torch.where(action, inputs["lossplug_teacher_logp"], 0),
        torch.where(action, direct_teacher_logps(teacher, inputs), 0),
        atol=1e-6,
        rtol=0,
    )


def test_a_teacher_with_another_vocabulary_is_refused_before_any_loss(tmp_path, teacher_reader):
    tok = tiny.tiny_tokenizer()
    teacher = tiny.tiny_model(tok, seed=1)
    teacher.resize_token_embeddings(len(tok) + 8)
    with pytest.raises(
        LossplugError,
        match=rf"teacher_model has a vocabulary of {len(tok) + 8} tokens and the "
        rf"student {len(tok)}.*Next step",
    ):
        tiny.tiny_grpo_trainer(
            TEACHER_RECIPE, tmp_path / "out", tokenizer=tok, trainer_kwargs={"teacher_model": teacher}
        )


def test_a_teacher_that_cannot_reach_the_trainers_device_is_refused(tmp_path, teacher_reader):
    tok = tiny.tiny_tokenizer()
    teacher = tiny.tiny_model(tok, seed=1).to("meta")  # weights that exist nowhere: cannot be moved
    with pytest.raises(LossplugError, match=r"teacher_model is on meta and could not be moved to the trainer's device"):
        tiny.tiny_grpo_trainer(
            TEACHER_RECIPE, tmp_path / "out", tokenizer=tok, trainer_kwargs={"teacher_model": teacher}
        )


def test_a_teacher_that_no_loss_stage_reads_is_refused(tmp_path):
    tok = tiny.tiny_tokenizer()
    with pytest.raises(
        LossplugError,
        match=r"neither the recipe's advantage \(opd\) nor a gate or regularizer reads teacher_logp.*Next step",
    ):
        tiny.tiny_grpo_trainer(
            "grpo", tmp_path / "out", tokenizer=tok, trainer_kwargs={"teacher_model": tiny.tiny_model(tok, seed=1)}
        )


def test_a_recipe_reading_teacher_logp_without_a_teacher_says_how(tmp_path, teacher_reader):
    with pytest.raises(LossplugError) as err:
        tiny.tiny_grpo_trainer(TEACHER_RECIPE, tmp_path / "out")
    assert "regularizers[0] (lpx_teacher_logp_gap) reads teacher_logp" in str(err.value)
    assert "Next step: pass attach(trainer, recipe, teacher_model=teacher)" in str(err.value)


def test_non_finite_teacher_log_probs_are_named_with_their_rows(tmp_path, teacher_reader):
    tok = tiny.tiny_tokenizer()
    teacher = tiny.tiny_model(tok, seed=1)
    with torch.no_grad():
        teacher.get_output_embeddings().weight[:, 0] = float("nan")  # every logit NaN
    trainer = tiny.tiny_grpo_trainer(
        TEACHER_RECIPE, tmp_path / "out", tokenizer=tok, trainer_kwargs={"teacher_model": teacher}
    )
    with pytest.raises(
        LossplugError, match=r"teacher_logp: the teacher's log-probs are not finite.* rows \[0, 1, 2, 3\]"
    ):
        trainer.train()


# -- the rollout's own teacher: a rollout_func's teacher_logprobs ----------------------------------------------------
class TeacherRollout(tiny.TinyRollout):
    """TinyRollout that also returns ``teacher_logprobs``: one negative float per completion token (``drop``: one
    value fewer on the rows given), recorded per call."""

    def __init__(self, tok, drop=(), **kwargs):
        super().__init__(tok, **kwargs)
        self.drop = drop
        self.teacher = []

    def __call__(self, prompts, trainer):
        out = super().__call__(prompts, trainer)
        g = torch.Generator().manual_seed(100 + self.calls)
        values = [(-4.0 * torch.rand(len(ids), generator=g) - 0.01).tolist() for ids in out["completion_ids"]]
        out["teacher_logprobs"] = [v[:-1] if i in self.drop else v for i, v in enumerate(values)]
        self.teacher.append(values)
        return out


def test_the_loss_sees_the_rollouts_teacher_logprobs(tmp_path, teacher_reader):
    tok = tiny.tiny_tokenizer()
    rollout = TeacherRollout(tok)
    trainer = tiny.tiny_grpo_trainer(
        TEACHER_RECIPE, tmp_path / "out", tokenizer=tok, trainer_kwargs={"rollout_func": rollout}
    )
    outputs = []
    generate = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: outputs.append(generate(inputs)) or outputs[-1]
    trainer.train()
    assert trainer.state.global_step == 2
    assert outputs and len(outputs) == len(rollout.teacher)
    for output, values in zip(outputs, rollout.teacher):
        got = output["lossplug_teacher_logp"]
        assert got.dtype == torch.float32 and got.shape == output["completion_ids"].shape
        for row, v in enumerate(values):
            assert torch.equal(got[row, : len(v)], torch.tensor(v, dtype=torch.float32))
            assert bool((got[row, len(v) :] == 0).all())


def test_a_rollouts_teacher_logprobs_of_another_length_are_named(tmp_path, teacher_reader):
    tok = tiny.tiny_tokenizer()
    trainer = tiny.tiny_grpo_trainer(
        TEACHER_RECIPE, tmp_path / "out", tokenizer=tok, trainer_kwargs={"rollout_func": TeacherRollout(tok, drop=(2,))}
    )
    with pytest.raises(LossplugError, match=r"'teacher_logprobs' has another length than the completion at rows \[2\]"):
        trainer.train()


def test_a_rollout_without_teacher_logprobs_and_no_teacher_model_is_named(tmp_path, teacher_reader):
    tok = tiny.tiny_tokenizer()
    trainer = tiny.tiny_grpo_trainer(
        TEACHER_RECIPE, tmp_path / "out", tokenizer=tok, trainer_kwargs={"rollout_func": tiny.TinyRollout(tok)}
    )
    with pytest.raises(LossplugError, match=r"result has no 'teacher_logprobs' and the trainer no teacher_model"):
        trainer.train()


def test_two_teachers_are_refused(tmp_path, teacher_reader):
    tok = tiny.tiny_tokenizer()
    trainer = tiny.tiny_grpo_trainer(
        TEACHER_RECIPE,
        tmp_path / "out",
        tokenizer=tok,
        trainer_kwargs={"rollout_func": TeacherRollout(tok), "teacher_model": tiny.tiny_model(tok, seed=1)},
    )
    with pytest.raises(LossplugError, match="teacher_logp has two sources"):
        trainer.train()


# -- opd as TRL's advantage: its task on the gathered rewards, its per-token signal per process ------------------------
def grpo_by_hand(reward, size=4, eps=1e-6):
    """lossplug's grpo defaults, written out: (r − group mean) / (Bessel std + eps), 0 for a group of equal rewards;
    groups are consecutive runs of ``size`` rows (TRL's sampler)."""
    out = torch.zeros_like(reward, dtype=torch.float64)
    r = reward.double()
    for start in range(0, r.shape[0], size):
        g = r[start : start + size]
        if bool((g == g[0]).all()):
            continue
        out[start : start + size] = (g - g.mean()) / (g.std(unbiased=True) + eps)
    return out


def direct_logps(model, inputs):
    """``model``'s log-probs of the completions: a plain forward, log-softmax of logits / temperature (as
    :func:`direct_teacher_logps`)."""
    return direct_teacher_logps(model, inputs)


class RecordingTeacherRollout(TeacherRollout):
    """TeacherRollout that also records the behaviour log-probs it returns (all scored)."""

    def __init__(self, tok, **kwargs):
        super().__init__(tok, unscored=False, **kwargs)
        self.behavior = []

    def __call__(self, prompts, trainer):
        out = super().__call__(prompts, trainer)
        self.behavior.append(out["logprobs"])
        return out


def padded(values, width):
    return torch.stack(
        [torch.nn.functional.pad(torch.tensor(v, dtype=torch.float32), (0, width - len(v))) for v in values]
    )


#: the task advantage divides float32 rewards' centred values by their group's std (0.02 here): float32 rounding of
#: the rewards, amplified, reaches 1e-6 on advantages of about 1.5 — a relative tolerance of 8 float32 ulps
RTOL = 1e-6

OPD_CASES = {
    # opd alone; TRL computes no old log-probs (accumulation aligned with generation): the adapter does; two
    # micro-batches per generation batch (steps_per_generation = gradient_accumulation_steps = 2)
    "alone_teacher_model": dict(
        advantage={"name": "opd", "coef": 0.5},
        config={"gradient_accumulation_steps": 2, "num_iterations": 1},
        source="teacher_model",
    ),
    # with grpo: TRL computes old_per_token_logps (steps_per_generation 2, accumulation 1), the batch sliced in two
    "grpo_task_teacher_model": dict(
        advantage={"name": "opd", "coef": 1.0, "task": "grpo"},
        config={"steps_per_generation": 2},
        source="teacher_model",
    ),
    # the rollout's own teacher and its behaviour log-probs as the student, tool tokens outside the actions
    "grpo_task_rollout_behavior": dict(
        advantage={"name": "opd", "coef": 0.7, "student": "behavior_logp", "task": "grpo"},
        config={"gradient_accumulation_steps": 2, "num_iterations": 1},
        source="rollout",
    ),
}


@pytest.mark.parametrize("case", sorted(OPD_CASES))
def test_opd_runs_as_trls_advantage_per_token(tmp_path, monkeypatch, case):
    spec = OPD_CASES[case]
    coef, student, task = (
        spec["advantage"]["coef"],
        spec["advantage"].get("student", "old_logp"),
        "task" in spec["advantage"],
    )
    tok = tiny.tiny_tokenizer()
    teacher = tiny.tiny_model(tok, seed=1)
    rollout = RecordingTeacherRollout(tok) if spec["source"] == "rollout" else None
    kwargs = {"teacher_model": teacher} if rollout is None else {"rollout_func": rollout}
    seen = []
    original = trl_loss.policy_batch

    def recording(trainer, st, inputs, *args, **kw):
        batch = original(trainer, st, inputs, *args, **kw)
        seen.append((dict(inputs), batch))
        return batch

    monkeypatch.setattr(trl_loss, "policy_batch", recording)
    recipe = {"advantage": spec["advantage"], "gates": ["ppo_clip"], "reduction": "token"}
    trainer = tiny.tiny_grpo_trainer(
        recipe, tmp_path / "out", tokenizer=tok, temperature=TEMPERATURE, trainer_kwargs=kwargs, **spec["config"]
    )
    generations = []  # per generation batch: the student's and teacher's log-probs and the task advantage, by hand
    generate = trainer._generate_and_score_completions

    def wrapped(inputs):
        out = generate(inputs)
        n, width = out["completion_ids"].shape
        call = len(generations)
        out["lpx_row"] = torch.arange(n) + 1000 * call  # a row's identity through TRL's shuffle and split
        if rollout is None:
            teacher_logp = direct_logps(teacher, out)
            # the student before any update of this generation batch (its optimizer step has not run yet)
            student_logp = direct_logps(trainer.model, out) if student == "old_logp" else None
        else:
            teacher_logp = padded(rollout.teacher[call], width)
            student_logp = padded(rollout.behavior[call], width)
        task_adv = grpo_by_hand(out["lossplug_reward"]) if task else torch.zeros(n, dtype=torch.float64)
        generations.append((teacher_logp, student_logp, task_adv))
        return out

    trainer._generate_and_score_completions = wrapped
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert generations and len(seen) == 2 * len(generations)  # every generation batch sliced into two micro-batches
    checked = 0
    for inputs, batch in seen:
        rows = inputs["lpx_row"]
        call = int(rows[0]) // 1000
        assert bool((rows // 1000 == call).all())
        teacher_logp, student_logp, task_adv = (t[rows % 1000] for t in generations[call])
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        action = mask.bool()
        expected = torch.where(
            action, coef * (teacher_logp.double() - student_logp.double()) + task_adv.unsqueeze(-1), 0
        ).float()
        assert inputs["advantages"].shape == action.shape and inputs["advantages"].dtype == torch.float32
        torch.testing.assert_close(inputs["advantages"], expected, atol=1e-6, rtol=RTOL)
        keep = action.any(-1)
        assert batch.advantage is not None and batch.advantage.shape == batch.logp.shape  # what the loss reads
        torch.testing.assert_close(
            torch.where(batch.action_mask, batch.advantage, 0), expected[keep], atol=1e-6, rtol=RTOL
        )
        if student == "old_logp":  # the loss's old_logp is the tensor the advantage read
            torch.testing.assert_close(
                torch.where(batch.action_mask, batch.old_logp, 0),
                torch.where(action, student_logp, 0)[keep],
                atol=1e-6,
                rtol=0,
            )
        # the teacher's signal is there: not the task advantage alone
        assert not torch.allclose(
            expected[action], task_adv.unsqueeze(-1).expand_as(expected)[action].float(), atol=1e-3
        )
        checked += int(action.sum())
    assert checked > 0
    losses = [e["lossplug/loss"] for e in trainer.state.log_history if "lossplug/loss" in e]
    assert losses and all(math.isfinite(v) for v in losses)
    gaps = [
        e["lossplug/advantage/opd/reverse_kl"]
        for e in trainer.state.log_history
        if "lossplug/advantage/opd/reverse_kl" in e
    ]
    assert len(gaps) == len(generations) and all(math.isfinite(v) and v != 0 for v in gaps)  # one per generation batch


def test_opd_without_a_teacher_says_how(tmp_path):
    with pytest.raises(LossplugError) as err:
        tiny.tiny_grpo_trainer(
            {"advantage": {"name": "opd", "task": "grpo"}, "gates": ["ppo_clip"], "reduction": "token"},
            tmp_path / "out",
        )
    message = str(err.value)
    assert "recipe.advantage (opd) reads teacher_logp" in message
    assert "Next step: pass attach(trainer, recipe, teacher_model=teacher)" in message


def test_opd_on_behaviour_log_probs_trl_does_not_have_is_refused(tmp_path):
    tok = tiny.tiny_tokenizer()
    with pytest.raises(LossplugError) as err:
        tiny.tiny_grpo_trainer(
            {"advantage": {"name": "opd", "student": "behavior_logp"}, "gates": ["ppo_clip"], "reduction": "token"},
            tmp_path / "out",
            tokenizer=tok,
            trainer_kwargs={"teacher_model": tiny.tiny_model(tok, seed=1)},
        )
    message = str(err.value)
    assert "recipe.advantage (opd) reads behavior_logp" in message and "teacher_logp" not in message
    assert "Next step: set use_vllm=True" in message


def test_opd_without_a_task_and_a_filter_is_refused(tmp_path):
    tok = tiny.tiny_tokenizer()
    with pytest.raises(
        LossplugError, match=r"recipe.advantage \(opd\) has no task, and the recipe has shapers or filters.*Next step"
    ):
        tiny.tiny_grpo_trainer(
            {"advantage": "opd", "filters": ["zero_variance"], "gates": ["ppo_clip"], "reduction": "token"},
            tmp_path / "out",
            tokenizer=tok,
            trainer_kwargs={"teacher_model": tiny.tiny_model(tok, seed=1)},
        )


def test_a_mix_with_an_opd_component_stays_refused_with_the_reason(tmp_path):
    tok = tiny.tiny_tokenizer()
    mix = {"name": "mix", "components": [{"name": "opd", "weight": 1.0}, {"name": "grpo", "weight": 0.5}]}
    with pytest.raises(LossplugError) as err:
        tiny.tiny_grpo_trainer(
            {"advantage": mix, "gates": ["ppo_clip"], "reduction": "token"},
            tmp_path / "out",
            tokenizer=tok,
            trainer_kwargs={"teacher_model": tiny.tiny_model(tok, seed=1)},
        )
    message = str(err.value)
    assert "recipe.advantage (mix) reads teacher_logp" in message and "one value per completion" in message
    assert "Next step: advantage: {name: opd, coef: ..., task: <estimator>}" in message


# -- turns ------------------------------------------------------------------------------------------------------------
class TurnRollout(tiny.TinyRollout):
    """TinyRollout whose rows are turns: in each group of 4 rows, rows 0–1 are the two turns of one episode and rows
    2–3 of another; ``trajectory_id`` a string unique over the batch (or ``ids`` given per row), ``anchor_id`` the
    turn (0, 1) as an integer. Records, per call, the hand-numbered trajectory and anchor of each row."""

    def __init__(self, tok, ids=None, **kwargs):
        super().__init__(tok, tools=False, **kwargs)
        self.ids = ids
        self.numbered = []

    def __call__(self, prompts, trainer):
        out = super().__call__(prompts, trainer)
        n = len(prompts)
        call = self.calls - 1
        trajectory = [i // 2 for i in range(n)]
        anchor = [i % 2 for i in range(n)]
        out["trajectory_id"] = self.ids if self.ids is not None else [f"episode-{call}-{t}" for t in trajectory]
        out["anchor_id"] = anchor
        self.numbered.append((torch.tensor(trajectory), torch.tensor(anchor)))
        return out


TURN_RECIPES = {
    "step_reinforce": {"name": "step_reinforce", "gamma": 0.5, "grouping": "group", "mean": "group", "std": "group"},
    "gigpo": {"name": "gigpo", "gamma": 0.9, "step_weight": 1.0},
}


@pytest.mark.parametrize("name", sorted(TURN_RECIPES))
def test_turn_estimators_run_at_trls_advantage_seam_on_the_rollouts_ids(tmp_path, name):
    tok = tiny.tiny_tokenizer()
    rollout = TurnRollout(tok)
    recipe = {"advantage": TURN_RECIPES[name], "gates": ["ppo_clip"], "reduction": "token"}
    trainer = tiny.tiny_grpo_trainer(
        recipe, tmp_path / "out", tokenizer=tok, per_device_train_batch_size=8, trainer_kwargs={"rollout_func": rollout}
    )
    outputs = []
    generate = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: outputs.append(generate(inputs)) or outputs[-1]
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert outputs and len(outputs) == len(rollout.numbered)
    for output, (trajectory, anchor) in zip(outputs, rollout.numbered):
        reward = output["lossplug_reward"].double()
        group = torch.arange(reward.shape[0]) // 4
        batch = lossplug.PolicyBatch(
            logp=torch.zeros(reward.shape[0], 1, dtype=torch.float64),
            action_mask=torch.ones(reward.shape[0], 1, dtype=torch.bool),
            reward=reward,
            group_id=group,
            trajectory_id=trajectory,
            anchor_id=anchor,
        )
        expected = lossplug.estimate_advantages(batch, recipe).advantage
        torch.testing.assert_close(output["advantages"].double(), expected, atol=1e-6, rtol=1e-6)
        # the turns matter: the plain group advantage of the same rewards is another
        plain = lossplug.estimate_advantages(
            batch, {"advantage": "grpo", "gates": ["ppo_clip"], "reduction": "token"}
        ).advantage
        assert not torch.allclose(expected, plain, atol=1e-3)


def test_turn_ids_without_a_rollout_func_are_refused_with_the_next_step(tmp_path):
    with pytest.raises(LossplugError) as err:
        tiny.tiny_grpo_trainer({"advantage": "gigpo", "gates": ["ppo_clip"], "reduction": "token"}, tmp_path / "out")
    message = str(err.value)
    assert (
        "recipe.advantage (gigpo) reads trajectory_id" in message
        and "recipe.advantage (gigpo) reads anchor_id" in message
    )
    assert "Next step: pass GRPOTrainer(rollout_func=...) whose result carries trajectory_id" in message


@pytest.mark.parametrize(
    "ids, match",
    [
        ([1.5] * 8, r"trajectory_id: the rollout_func's value at row 0 is float 1\.5: ids are integers or strings"),
        ([0, 0, 1, 1, [2], 2, 3, 3], r"trajectory_id: the rollout_func's value at row 4 is list \[2\]"),
        ([0, 0, 1, 1, True, 2, 3, 3], r"trajectory_id: the rollout_func's value at row 4 is a bool"),
    ],
    ids=["float", "list", "bool"],
)
def test_bad_turn_ids_are_named_with_their_row(tmp_path, ids, match):
    tok = tiny.tiny_tokenizer()
    trainer = tiny.tiny_grpo_trainer(
        {"advantage": TURN_RECIPES["step_reinforce"], "gates": ["ppo_clip"], "reduction": "token"},
        tmp_path / "out",
        tokenizer=tok,
        per_device_train_batch_size=8,
        trainer_kwargs={"rollout_func": TurnRollout(tok, ids=ids)},
    )
    with pytest.raises(LossplugError, match=match):
        trainer.train()


def test_a_rollout_without_the_ids_is_named(tmp_path):
    tok = tiny.tiny_tokenizer()
    trainer = tiny.tiny_grpo_trainer(
        {"advantage": TURN_RECIPES["step_reinforce"], "gates": ["ppo_clip"], "reduction": "token"},
        tmp_path / "out",
        tokenizer=tok,
        trainer_kwargs={"rollout_func": tiny.TinyRollout(tok)},
    )
    with pytest.raises(
        LossplugError, match=r"the rollout_func's result has no 'trajectory_id' for rows \[0, 1, 2, 3\]"
    ):
        trainer.train()


def test_string_ids_hash_the_same_everywhere():
    from lossplug.adapters.trl.teachers_and_turns import stable_id

    # BLAKE2b, not Python's salted hash(): a fixed value on every process and run
    assert stable_id("episode-0", "trajectory_id", 0) == stable_id("episode-0", "trajectory_id", 5)
    assert stable_id("episode-0", "trajectory_id", 0) != stable_id("episode-1", "trajectory_id", 0)
    assert stable_id("episode-0", "trajectory_id", 0) == 3929124345900328203  # pinned: the same on every machine
    assert stable_id(7, "anchor_id", 0) == 7 and stable_id(torch.tensor(7), "anchor_id", 0) == 7
