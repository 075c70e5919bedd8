"""MOPD (arXiv:2606.30406) inside verl 0.9.1: two domain teachers, each row scored by its own domain's teacher.

The step is laid out as verl's agent loop lays it out with its teacher loop on and two teachers configured
(``distillation.teacher_models`` keyed ``math`` and ``code``, ``distillation.teacher_key: data_source``): each
sample is routed by verl's own ``AsyncTeacherLLMServerManager._resolve_teacher_key`` to its domain's teacher, whose
``prompt_logprobs`` over prompt + response are padded by verl's own ``_pad_teacher_outputs`` into the one
``teacher_logprobs`` tensor of the batch. Then:

* verl's ``ray_trainer.compute_advantage(adv_estimator=lossplug)`` with MOPD's advantage stage gives, token by
  token, Eq. 9 of the MiMo-V2-Flash report (arXiv:2601.02780, §4.4): ``(log π_domain − log π_θ) + α·Â_GRPO``;
* verl's policy-loss seam at 2 ranks × micro-batches with MOPD's gates and reduction gives Eq. 7's loss and
  gradient, ``−(1/B) Σ_b (1/|y_b|) Σ_t w_t Â_t log π_θ`` with IcePop's ``w_t`` (Eq. 8), at θ = θ_old.

The oracle is ``tests/plugins/advantages/test_mopd.py``'s transcription of Eqs. 7–9, here on verl's fields.
TRL's GRPOTrainer refuses the recipe before any step: its advantage seam holds one value per completion, MOPD's
advantage is per token (``opd``'s refusal, as in ``tests/adapters/test_trl_teachers_and_turns.py``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

import numpy as np
import torch
from verl import DataProto
from verl.experimental.teacher_loop.teacher_manager import AsyncTeacherLLMServerManager, _pad_teacher_outputs

from ..plugins.advantages.test_mopd import mopd_recipe
from ._field_trainers import B, T, verl_inputs, verl_seam_over_step
from .test_verl_teachers_and_turns import PAD, P, through_verl

F64 = torch.float64
SOURCES = ["math"] * 4 + ["code"] * 4  # one prompt (4 rollouts) per domain
ALPHA, LOW, HIGH = 0.5, 0.5, 2.0


def verls_router():
    """verl's teacher manager's routing, without servers: two teachers keyed by their data_source."""
    manager = object.__new__(AsyncTeacherLLMServerManager)
    manager.teacher_model_configs = {"math": object(), "code": object()}
    manager.teacher_key = "data_source"
    return manager._resolve_teacher_key


def two_teacher_proto(seed=11):
    """verl_inputs' step (at θ = θ_old, a rollout engine far enough off for IcePop to drop tokens) as verl's agent
    loop builds it with two teachers. Returns the DataProto, the step and each teacher's log-probs ``[B, T]``."""
    x = verl_inputs(seed=seed, update_noise=0.0, rollout_noise=0.6)
    mask, lengths = x["response_mask"], x["lengths"]
    g = torch.Generator().manual_seed(seed)
    teachers = {key: -3 * torch.rand(B, T, generator=g, dtype=F64) - 0.01 for key in ("math", "code")}
    route = verls_router()
    prompt_lengths = torch.randint(1, P + 1, (B,), generator=g)
    responses = torch.randint(10, 100, (B, T), generator=g)
    prompts = torch.full((B, P), PAD)
    ids, logprobs = [], []
    for b in range(B):
        p, r = int(prompt_lengths[b]), int(lengths[b])
        prompt = torch.randint(10, 100, (p,), generator=g)
        prompts[b, P - p :] = prompt
        sequence = torch.cat([prompt, responses[b, :r]])
        teacher = teachers[route(SOURCES[b])]  # the sample's own domain teacher scores its sequence
        per_token = torch.cat([-3 * torch.rand(p - 1, generator=g, dtype=F64), teacher[b, :r], torch.zeros(1)])
        shifted_ids = torch.cat([sequence[1:], torch.zeros(1, dtype=torch.long)])[:, None]
        i, lp = _pad_teacher_outputs(shifted_ids, per_token[:, None].to(F64), P, T, p, r, PAD)
        ids.append(i)
        logprobs.append(lp)
    last = lengths - 1
    rewards = torch.zeros(B, T, dtype=F64)
    rewards[torch.arange(B), last] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0], dtype=F64)
    tensors = {
        "prompts": prompts,
        "responses": torch.where(torch.arange(T) < lengths[:, None], responses, PAD),
        "response_mask": mask.long(),
        "token_level_rewards": rewards,
        "old_log_probs": x["old_log_prob"],
        "rollout_log_probs": x["rollout_log_probs"],
        "teacher_logprobs": torch.cat(logprobs),
        "teacher_ids": torch.cat(ids),
    }
    non_tensors = {
        "uid": np.array([f"prompt-{b // 4}" for b in range(B)], dtype=object),
        "data_source": np.array(SOURCES, dtype=object),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors), x, teachers


def mopd_advantage_transcribed(x, teachers, reward):
    """Eq. 9 token by token: sg[log π_domain(x) − log π_θ] + α · GRPO(r), on the action tokens."""
    mask, old = x["response_mask"], x["old_log_prob"]
    out = torch.zeros(B, T, dtype=F64)
    for b in range(B):
        group = [float(reward[j]) for j in range(B) if j // 4 == b // 4]
        a_orm = (float(reward[b]) - np.mean(group)) / (np.std(group, ddof=1) + 1e-6)
        for t in range(T):
            if mask[b, t]:
                out[b, t] = (float(teachers[SOURCES[b]][b, t]) - float(old[b, t])) + ALPHA * a_orm
    return out


def mopd_loss_transcribed(x, advantage):
    """Eqs. 7–8 token by token: −(1/B) Σ_b (1/|y_b|) Σ_t w_t Â_t log π_θ, w_t = π_θ/μ inside [LOW, HIGH], else 0;
    and ∂/∂ log π_θ. |y_b|: the row's action tokens (the loss's tokens)."""
    mask, logp, behavior = x["response_mask"], x["log_prob"], x["rollout_log_probs"]
    loss, grad = 0.0, torch.zeros(B, T, dtype=F64)
    for b in range(B):
        tokens = [t for t in range(T) if mask[b, t]]
        for t in tokens:
            ratio = float(np.exp(float(x["old_log_prob"][b, t]) - float(behavior[b, t])))
            w = ratio if LOW <= ratio <= HIGH else 0.0
            loss -= w * float(advantage[b, t]) * float(logp[b, t]) / len(tokens) / B
            grad[b, t] = -w * float(advantage[b, t]) / len(tokens) / B
    return loss, grad


def test_mopd_with_two_routed_teachers_through_verls_estimator_and_policy_loss_seam():
    data, x, teachers = two_teacher_proto()
    assert data.batch["teacher_logprobs"].shape == (B, P + T, 1)  # one tensor, each row its own teacher's
    recipe = mopd_recipe(ALPHA, LOW, HIGH)
    out = through_verl(data, recipe)
    reward = data.batch["token_level_rewards"].sum(-1)
    expected = mopd_advantage_transcribed(x, teachers, reward)
    advantages = out.batch["advantages"].to(F64)
    mask = x["response_mask"]
    torch.testing.assert_close(torch.where(mask, advantages, 0), expected, atol=1e-12, rtol=0)
    # verl's one tensor holds, at response token t (position P − 1 + t), each row's own domain teacher's log-prob
    held = data.batch["teacher_logprobs"][:, P - 1 : P - 1 + T, 0]
    for b in range(B):
        own, other = teachers[SOURCES[b]][b], teachers["code" if SOURCES[b] == "math" else "math"][b]
        assert torch.equal(held[b][mask[b]], own[mask[b]])
        assert not torch.allclose(held[b][mask[b]], other[mask[b]])

    step = {**x, "advantages": torch.where(mask, advantages, x["advantages"])}
    ratio = (x["old_log_prob"] - x["rollout_log_probs"]).exp()[mask]
    assert bool(((ratio < LOW) | (ratio > HIGH)).any()), "IcePop must drop some tokens here"
    total, grad, _ = verl_seam_over_step({k: v for k, v in recipe.items() if k != "advantage"}, step)
    expected_loss, expected_grad = mopd_loss_transcribed(x, expected)
    assert abs(float(total) - expected_loss) < 1e-12, (float(total), expected_loss)
    torch.testing.assert_close(torch.where(mask, grad, 0), expected_grad, atol=1e-14, rtol=0)
    assert float(expected_grad.abs().max()) > 1e-3


def test_mopd_as_trls_advantage_is_refused_with_the_reason(tmp_path):
    """TRL's advantage seam holds one value per completion; MOPD's advantage is per token (and TRL takes one
    teacher_model): the trainer is refused before any step, naming the stage and the reason."""
    pytest.importorskip("trl")
    from lossplug.contracts import LossplugError
    from lossplug.testing import tiny

    tok = tiny.tiny_tokenizer()
    with pytest.raises(LossplugError) as err:
        tiny.tiny_grpo_trainer(
            mopd_recipe(ALPHA, LOW, HIGH),
            tmp_path / "out",
            tokenizer=tok,
            trainer_kwargs={"teacher_model": tiny.tiny_model(tok, seed=1)},
        )
    message = str(err.value)
    assert "reads teacher_logp" in message, message
    assert "one value per completion" in message and "a teacher's signal is per token" in message, message
