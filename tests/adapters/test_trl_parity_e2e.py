"""TRL parity, end to end: for every ``GRPOConfig`` loss option, a real ``GRPOTrainer`` trained natively and the same
trainer running ``trl_equivalent``'s recipe end with the same parameters.

Each case trains two optimizer steps (gradient accumulation 2, ``num_iterations`` 2 — the second step re-uses the
generation batch, so ratios differ from 1 and clipping, masking and the bias-corrected KL engage — ``beta`` > 0,
float32) twice from the same initial weights and the same rollouts: once with TRL's own ``_compute_loss``, once
with ``attach(trainer, *trl_equivalent(args))``. The optimizer is plain SGD so that a wrong gradient cannot hide
behind Adam's sign-like normalisation: the parameters after two steps must agree to float32 rounding, and each
option must move them measurably away from the run without it (the comparison is not vacuous).

vLLM does not run here. TRL's vLLM importance-sampling code (``_generate_and_score_completions``: the ratio
``exp(old − sampling)``, truncated or masked per ``vllm_importance_sampling_mode``, and ``_compute_loss``'s
multiplication by it) runs for real: the trainer is built without vLLM, given a ``rollout_func`` that returns
behaviour log-probs (as vLLM would), and its ``use_vllm`` switched on afterwards — TRL then computes and applies its
own correction from those log-probs, and only the engine call itself is skipped (the ``rollout_func`` path).
"""

from __future__ import annotations

import json
import time

import pytest
import torch

pytest.importorskip("trl")

import trl
from transformers import AutoModelForCausalLM

from lossplug.adapters.trl import CONTROLLER_STATE_FILE, attach, trl_equivalent
from lossplug.testing import tiny

pytestmark = pytest.mark.slow

#: parameters after two SGD steps: |Δ| ≤ TOL (float32 rounding of O(1) weights moved by O(lr · grad))
TOL = 2e-6
#: an option must move the parameters at least this far from the run without it
MIN_EFFECT = 100 * TOL
LR = 0.1

BASE = {"loss_type": "dapo", "epsilon_high": 0.28}
#: the bonus applies from the second step on (TRL: none in the first window), with a coefficient moved by the first
ADAPTIVE = {
    **BASE,
    "entropy_coef": 1.0,
    "use_adaptive_entropy": True,
    "entropy_target": 10.0,
    "entropy_coef_delta": 0.25,
    "entropy_coef_max": 2.0,
}
#: case: (GRPOConfig settings, rollouts, vLLM importance sampling (mode, clip_min, clip_max) or None)
CASES: dict[str, tuple[dict, str, tuple | None]] = {
    # loss options
    "vespo": ({"loss_type": "vespo"}, "tiny", None),
    "cispo_sequence": (
        {"loss_type": "cispo", "importance_sampling_level": "sequence", "epsilon_high": 5.0},
        "tiny",
        None,
    ),
    "sapo_sequence": ({"loss_type": "sapo", "importance_sampling_level": "sequence"}, "tiny", None),
    "gspo_delta": (
        {
            "loss_type": "grpo",
            "importance_sampling_level": "sequence",
            "epsilon": 3e-4,
            "epsilon_high": 4e-4,
            "delta": 1.0005,
        },
        "tiny",
        None,
    ),
    "off_policy_mask_sampling": ({**BASE, "off_policy_mask_threshold": 0.05}, "scored", None),
    "off_policy_mask_old": ({**BASE, "off_policy_mask_threshold": 1e-4}, "generate", None),
    "top_entropy": ({**BASE, "top_entropy_quantile": 0.4}, "tiny", None),
    "normalize_then_sum": ({**BASE, "multi_objective_aggregation": "normalize_then_sum"}, "tiny", None),
    # vLLM importance sampling (TRL's correction computed by TRL from the rollout's behaviour log-probs)
    # the tiny rollouts' engine ratios lie around 0.02–0.4: bounds there bind on some tokens and not on others
    "vllm_token_truncate": (BASE, "tiny", ("token_truncate", None, 0.2)),
    "vllm_token_mask": (BASE, "tiny", ("token_mask", 0.2, 5.0)),
    "vllm_sequence_truncate": (BASE, "tiny", ("sequence_truncate", None, 0.05)),
    "vllm_token_truncate_floor": (BASE, "tiny", ("token_truncate", 0.9, 1.1)),
    "vllm_sequence_mask": (BASE, "tiny", ("sequence_mask", 1e-3, 50.0)),
    "vllm_sequence_mask_no_low": ({"loss_type": "grpo"}, "tiny", ("sequence_mask", None, 3.0)),
    "vespo_vllm_token_truncate": ({"loss_type": "vespo"}, "tiny", ("token_truncate", None, 3.0)),
    "vespo_vllm_token_mask": ({"loss_type": "vespo"}, "tiny", ("token_mask", 0.2, 2.0)),
    # KL and entropy
    "kl_without_bias_correction": ({**BASE, "use_bias_correction_kl": False, "beta": 0.5}, "tiny", None),
    "kl_bias_corrected": ({**BASE, "beta": 0.5}, "tiny", None),
    # (rollouts without emptied rows: see test_micro_batch_regularizer_with_emptied_rows)
    "entropy_static": ({**BASE, "entropy_coef": 0.5}, "scored", None),
    "entropy_static_top_entropy": ({**BASE, "entropy_coef": 0.5, "top_entropy_quantile": 0.4}, "tiny", None),
    "entropy_adaptive": (ADAPTIVE, "scored", None),
}


@pytest.fixture(scope="module", autouse=True)
def _quick_gc(frozen_gc):
    """Every test of this module trains many real trainers."""


def fake_vllm(trainer, mode: str, clip_min: float | None, clip_max: float | None) -> None:
    """Switch TRL's vLLM importance sampling on for a trainer whose rollouts come from a ``rollout_func`` with
    behaviour log-probs: TRL then computes ``importance_sampling_ratio`` itself and applies it in its loss."""
    args = trainer.args
    for obj in (args, trainer):
        obj.use_vllm = True
        obj.vllm_importance_sampling_correction = True
        obj.vllm_importance_sampling_mode = mode
        obj.vllm_importance_sampling_clip_min = clip_min
        obj.vllm_importance_sampling_clip_max = clip_max
    trainer._last_loaded_step = 0  # the weights "are in sync": no engine to push them to


def build(model_dir, out, settings: dict, rollouts: str, vllm: tuple | None, **extra):
    tok = tiny.tiny_tokenizer()
    config = {
        "gradient_accumulation_steps": 2,
        "num_iterations": 2,
        "beta": 0.04,
        "max_steps": 2,
        "optim": "sgd",
        "learning_rate": LR,
        "lr_scheduler_type": "constant",
        **settings,
        **extra,
    }
    if rollouts == "tiny":
        config["mask_truncated_completions"] = True
    args = tiny.tiny_grpo_config(out, **config)
    rollout = None
    if rollouts != "generate":
        rollout = tiny.TinyRollout(tok, seed=3, unscored=rollouts == "tiny")
    trainer = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32"),
        reward_funcs=[tiny.length_reward, tiny.digit_reward],
        args=args,
        train_dataset=tiny.tiny_dataset(),
        processing_class=tok,
        rollout_func=rollout,
    )
    if vllm is not None:
        fake_vllm(trainer, *vllm)
    return trainer


def train(trainer, ours: bool):
    if ours:
        recipe, population = trl_equivalent(trainer.args, sampling_logprobs=trainer.rollout_func is not None)
        attach(trainer, recipe, population=population)
    torch.manual_seed(0)
    trainer.train()
    return [p.detach().clone() for p in trainer.model.parameters()]


def run(model_dir, out, settings, rollouts, vllm, ours):
    return train(build(model_dir, out, settings, rollouts, vllm), ours)


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def baselines(model_dir, tmp_path_factory):
    """TRL's native run without any of the options, per kind of rollouts: what each option must move away from."""
    out = tmp_path_factory.mktemp("baseline")
    cache: dict = {}

    def get(rollouts: str):
        if rollouts not in cache:
            cache[rollouts] = run(model_dir, out, BASE, rollouts, None, ours=False)
        return cache[rollouts]

    return get


@pytest.fixture(scope="module")
def initial(model_dir):
    return [p.detach().clone() for p in AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").parameters()]


@pytest.mark.parametrize("case", list(CASES))
def test_parameters_after_two_steps_match_trl(model_dir, baselines, initial, tmp_path, case):
    settings, rollouts, vllm = CASES[case]
    start = time.perf_counter()
    native = run(model_dir, tmp_path / "native", settings, rollouts, vllm, ours=False)
    ours = run(model_dir, tmp_path / "ours", settings, rollouts, vllm, ours=True)
    diff, effect, moved = max_diff(native, ours), max_diff(native, baselines(rollouts)), max_diff(native, initial)
    print(
        f"{case}: max|Δparam| = {diff:.2e} (option's effect {effect:.2e}, moved {moved:.2e}, "
        f"{time.perf_counter() - start:.1f} s)"
    )
    assert moved >= MIN_EFFECT, f"{case}: TRL's run does not train ({moved:.2e}): vacuous comparison"
    assert effect >= MIN_EFFECT, f"{case}: the option barely changes TRL's run ({effect:.2e}): vacuous comparison"
    assert diff <= TOL, f"{case}: max|Δparam| = {diff:.2e}"


def test_vllm_is_mapping_uses_trl_ratio_not_twice(model_dir, tmp_path):
    """The adapter never multiplies TRL's importance_sampling_ratio: with the recipe's correction gate removed the
    parameters differ from TRL's run, with it they match (the ratio is applied exactly once)."""
    settings, rollouts, vllm = CASES["vllm_token_mask"]
    native = run(model_dir, tmp_path / "native", settings, rollouts, vllm, ours=False)
    trainer = build(model_dir, tmp_path / "ours", settings, rollouts, vllm)
    recipe, population = trl_equivalent(trainer.args)
    assert [g.name for g in recipe.gates] == ["ppo_clip", "icepop"]
    assert {k: recipe.gates[1].params[k] for k in ("low", "high", "log_ratio_clamp")} == {
        "low": 0.2,
        "high": 5.0,
        "log_ratio_clamp": 80.0,
    }
    attach(trainer, recipe, population=population)
    torch.manual_seed(0)
    trainer.train()
    assert max_diff(native, [p.detach() for p in trainer.model.parameters()]) <= TOL
    # TRL's batch did carry its own ratio: the adapter read the behaviour log-probs instead
    assert "sampling/importance_sampling_ratio/mean" in {k for e in trainer.state.log_history for k in e}


def test_adaptive_entropy_state_is_saved_with_checkpoints_and_restored(model_dir, tmp_path):
    """The adaptive coefficient evolves like TRL's across optimizer steps, is written into every checkpoint folder
    next to TRL's own ``entropy_ctrl_state.json`` with the same values, and is restored on resume."""
    settings, rollouts, vllm = CASES["entropy_adaptive"]
    extra = {"save_strategy": "steps", "save_steps": 1}
    native = build(model_dir, tmp_path / "native", settings, rollouts, vllm, **extra)
    train(native, ours=False)
    trainer = build(model_dir, tmp_path / "ours", settings, rollouts, vllm, **extra)
    train(trainer, ours=True)

    def logged(t):
        return [e["entropy_coef"] for e in t.state.log_history if "entropy_coef" in e]

    assert logged(trainer) == pytest.approx(logged(native)) and len(logged(native)) == 2  # TRL's metric, same values
    for step in (1, 2):
        theirs = json.loads((tmp_path / "native" / f"checkpoint-{step}" / "entropy_ctrl_state.json").read_text())
        saved = json.loads((tmp_path / "ours" / f"checkpoint-{step}" / CONTROLLER_STATE_FILE).read_text())
        (state,) = saved.values()
        assert state["entropy_coef"] == pytest.approx(theirs["entropy_coef"], abs=1e-12)
        assert state["last_world_entropy"] == pytest.approx(theirs["last_world_entropy"], rel=1e-6)
    # resume: a fresh trainer loads the first checkpoint's state into its recipe's controller
    resumed = build(model_dir, tmp_path / "resumed", settings, rollouts, vllm)
    recipe, population = trl_equivalent(resumed.args)
    attach(resumed, recipe, population=population)
    resumed.create_optimizer_and_scheduler(num_training_steps=2)
    resumed._load_optimizer_and_scheduler(str(tmp_path / "ours" / "checkpoint-1"))
    from lossplug.control import controller_state

    (state,) = controller_state(resumed._lossplug.recipe).values()
    first = json.loads((tmp_path / "native" / "checkpoint-1" / "entropy_ctrl_state.json").read_text())
    assert state == pytest.approx(first, rel=1e-6)


def test_micro_batch_regularizer_with_emptied_rows(model_dir, tmp_path):
    """The adapter leaves rows without an action token (mask_truncated_completions) out of the batch; TRL's entropy
    bonus still weighs each micro-batch's token mean 1 / accumulation: the Normalizer's micro-batch count keeps the
    regularizer's weight exact."""
    settings = {**BASE, "entropy_coef": 0.5}
    native = run(model_dir, tmp_path / "native", settings, "tiny", None, ours=False)
    ours = run(model_dir, tmp_path / "ours", settings, "tiny", None, ours=True)
    assert max_diff(native, ours) <= TOL
