"""``opd`` (on-policy distillation), float64: against slime's ``apply_opd_kl_to_advantages`` transcribed here token
by token (slime is on no package index, and needs Megatron); with a task advantage (grpo, rloo, gae) the sum of that
estimator's advantage and the signal; hypothesis properties: a teacher equal to the student gives 0 (or exactly the
task advantage), the signal is linear in ``coef`` and odd in the log-ratio, padding never matters.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossplug
from lossplug import LossplugError, RecipeError

F64 = torch.float64
B, T = 6, 7


def recipe(**params):
    return lossplug.Recipe.model_validate(
        {"advantage": {"name": "opd", **params}, "gates": ["ppo_clip"], "reduction": "token"}
    )


def fields(seed=0, poison=True):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    mask[1, 0] = False  # an observation token inside a response
    mask[1, 1] = True
    old = -(0.05 + 3 * torch.rand(B, T, generator=g, dtype=F64))
    teacher = (old + torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-4)
    behavior = (old + 0.2 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-4)
    if poison:  # whatever sits off the actions is never read
        teacher = torch.where(mask, teacher, float("nan"))
        old = torch.where(mask, old, float("inf"))
    return dict(
        logp=old.clone(),
        old_logp=old,
        behavior_logp=behavior,
        teacher_logp=teacher,
        action_mask=mask,
        reward=torch.randn(B, generator=g, dtype=F64),
        group_id=torch.tensor([0, 0, 0, 1, 1, 1]),
        value=torch.randn(B, T, generator=g, dtype=F64),
    )


def transcribed(f, coef=1.0, student="old_logp"):
    out = torch.zeros(B, T, dtype=F64)
    for b in range(B):
        for t in range(T):
            if f["action_mask"][b, t]:
                out[b, t] = -coef * (float(f[student][b, t]) - float(f["teacher_logp"][b, t]))
    return out


@pytest.mark.parametrize("coef", [1.0, 0.3, -2.0])
@pytest.mark.parametrize("student", ["old_logp", "behavior_logp"])
def test_matches_the_transcribed_formula(coef, student):
    f = fields(1)
    adv = lossplug.compute_advantages(lossplug.PolicyBatch(**f), recipe(coef=coef, student=student))
    torch.testing.assert_close(adv, transcribed(f, coef, student), atol=1e-15, rtol=0)


def recipe_for(advantage):
    return lossplug.Recipe.model_validate({"advantage": advantage, "gates": ["ppo_clip"], "reduction": "token"})


@pytest.mark.parametrize(
    "task", ["grpo", {"name": "grpo", "scale": "none"}, "rloo", {"name": "gae", "gamma": 0.9}], ids=repr
)
def test_a_task_advantage_is_added_to_the_signal(task):
    f = fields(3)
    batch = lossplug.PolicyBatch(**f)
    base = lossplug.estimate_advantages(batch, recipe_for(task))
    result = lossplug.estimate_advantages(batch, recipe(coef=0.7, task=task))
    base_adv = base.advantage if base.advantage.ndim == 2 else base.advantage.unsqueeze(-1).expand(B, T)
    expected = torch.where(f["action_mask"], base_adv + transcribed(f, 0.7), 0)
    torch.testing.assert_close(result.advantage, expected, atol=1e-14, rtol=0)
    if base.returns is not None:  # a critic's target is the task's own
        torch.testing.assert_close(result.returns, base.returns, atol=0, rtol=0)


def test_the_task_and_its_fields_are_checked_at_recipe_time():
    stage = lossplug.compile_recipe(recipe(task="rloo")).advantage
    assert stage.plugin.required_fields(stage.params) == ("teacher_logp", "old_logp", "reward", "group_id")
    assert recipe(task="grpo").advantage.params["task"] == {"name": "grpo", **recipe_for("grpo").advantage.params}
    with pytest.raises(RecipeError, match="opd.task"):
        recipe(task="no_such_estimator")
    with pytest.raises((RecipeError, ValueError), match="opd itself"):
        recipe(task="opd")
    with pytest.raises(RecipeError, match="opd.task"):
        recipe(task={"name": "grpo", "no_such_param": 1})


def test_missing_teacher_logp_fails_validation_by_name():
    f = fields(0)
    del f["teacher_logp"]
    with pytest.raises(lossplug.BatchValidationError, match="teacher_logp"):
        lossplug.compute_advantages(lossplug.PolicyBatch(**f), recipe())


def test_a_task_needing_larger_groups_says_so():
    f = fields(0)
    f["group_id"] = torch.arange(B)
    with pytest.raises(LossplugError, match=r"opd.task \(rloo\) needs at least 2 rollouts"):
        lossplug.compute_advantages(lossplug.PolicyBatch(**f), recipe(task="rloo"))


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.floats(-3.0, 3.0, allow_nan=False), st.sampled_from([None, "grpo"]))
def test_properties(seed, coef, task):
    f = fields(seed)
    batch = lossplug.PolicyBatch(**f)
    r = recipe(coef=coef, task=task)
    adv = lossplug.compute_advantages(batch, r)
    base = torch.zeros(B, T, dtype=F64)
    if task is not None:
        base = torch.where(f["action_mask"], lossplug.compute_advantages(batch, recipe_for(task)).unsqueeze(-1), 0)
    # a teacher that agrees with the student: no distillation signal, only the task's advantage
    agree = lossplug.compute_advantages(batch.replace(teacher_logp=f["old_logp"]), r)
    assert torch.equal(agree, base)
    # the signal is linear in coef and changes sign with the log-ratio (teacher and student swapped)
    doubled = lossplug.compute_advantages(batch, recipe(coef=2 * coef, task=task))
    torch.testing.assert_close(doubled - base, 2 * (adv - base), atol=1e-12, rtol=1e-12)
    swapped = batch.replace(
        old_logp=torch.where(f["action_mask"], f["teacher_logp"], 0),
        teacher_logp=torch.where(f["action_mask"], f["old_logp"], 0),
    )
    torch.testing.assert_close(lossplug.compute_advantages(swapped, r) - base, -(adv - base), atol=1e-12, rtol=0)
    # zero off the actions
    assert bool((adv[~f["action_mask"]] == 0).all())
