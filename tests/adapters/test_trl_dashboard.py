"""TRL's dashboard is kept under lossplug: every key TRL's own ``GRPOTrainer`` logs appears in ``log_history`` with
TRL's value when ``attach(trainer, *trl_equivalent(args))`` takes over the loss.

For each TRL loss type (and with TRL's entropy bonus, which adds ``policy_loss``) a real ``GRPOTrainer`` trains two
optimizer steps natively and two with lossplug, from the same weights and the same rollouts (gradient accumulation
2, ``num_iterations`` 2: the second step re-uses the generation batch after an update, so ratios move and TRL's clip
ratios are non-zero; ``beta`` > 0, so TRL logs ``kl``; ``mask_truncated_completions`` empties some rows, which TRL's
sequence-level means still count). The keys TRL computes from the micro-batch (``kl``, ``entropy``, ``clip_ratio/*``,
``cispo_clip_ratio``, ``vespo/phi_seq_mean``, ``policy_loss``) are lossplug's, with TRL's definitions
(:mod:`lossplug.adapters.trl.dashboard`); the rest (rewards, lengths, loss, grad norm) come out of TRL unchanged.
Wall-clock keys are the only ones left out.

A second test calls TRL's ``_compute_loss`` and lossplug's on the same micro-batches for the settings the training
runs do not cover (``delta``, sequence-level cispo and sapo, a recipe whose gate TRL has no key for,
``metrics="off"``) and compares the values TRL appends, micro-batch by micro-batch.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch

pytest.importorskip("trl")

import trl
from transformers import AutoModelForCausalLM

from lossplug.adapters.trl import attach, trl_equivalent
from lossplug.testing import tiny

pytestmark = pytest.mark.slow

TOL = 1e-4
#: TRL's keys that measure wall-clock time, not the run
TIMING = frozenset({"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"})
#: the keys TRL computes from the micro-batch in ``_compute_loss`` (the ones lossplug must reproduce)
LOSS_KEYS = frozenset(
    {
        "kl",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
        "cispo_clip_ratio",
        "vespo/phi_seq_mean",
        "policy_loss",
    }
)
CLIP_KEYS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")

#: loss type → (GRPOConfig settings, the key of TRL's that shows the update gate acted)
CASES: dict[str, tuple[dict, str | None]] = {
    "grpo": ({"loss_type": "grpo"}, "clip_ratio/region_mean"),
    "bnpo": ({"loss_type": "bnpo"}, "clip_ratio/region_mean"),
    "dr_grpo": ({"loss_type": "dr_grpo"}, "clip_ratio/region_mean"),
    "dapo": ({"loss_type": "dapo", "epsilon_high": 0.28}, "clip_ratio/region_mean"),
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, "clip_ratio/region_mean"),
    # a cap near 1 so that some positive-advantage weights are capped (TRL recommends 5.0)
    "cispo": ({"loss_type": "cispo", "epsilon_high": 1.05}, "cispo_clip_ratio"),
    "sapo": ({"loss_type": "sapo"}, None),  # TRL logs no gate key for sapo
    "vespo": ({"loss_type": "vespo"}, "vespo/phi_seq_mean"),
    "gspo": (
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
        "clip_ratio/region_mean",
    ),
    # TRL's entropy bonus adds policy_loss (the loss before the bonus): the recipe's entropy regularizer (static,
    # adaptive) and the adapter's own bonus (top_entropy_quantile), with a loss type that divides by the
    # accumulation steps and one that does not
    "grpo_entropy": ({"loss_type": "grpo", "entropy_coef": 0.5}, "clip_ratio/region_mean"),
    "bnpo_adaptive_entropy": (
        {"loss_type": "bnpo", "entropy_coef": 0.5, "use_adaptive_entropy": True, "entropy_target": 10.0},
        "clip_ratio/region_mean",
    ),
    "dapo_entropy_top_entropy": (
        {"loss_type": "dapo", "epsilon_high": 0.28, "entropy_coef": 0.5, "top_entropy_quantile": 0.5},
        "clip_ratio/region_mean",
    ),
}


@pytest.fixture(scope="module", autouse=True)
def _quick_gc():
    """accelerate runs a full ``gc.collect()`` at every ``train()``: freeze what exists, so each walks new objects."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("trl_dashboard") / "model"
    tiny.tiny_model_and_tokenizer(path)  # saved: beta > 0 rebuilds the reference model from the folder
    return path


def build(model_dir, out, settings: dict) -> trl.GRPOTrainer:
    tok = tiny.tiny_tokenizer()
    args = tiny.tiny_grpo_config(
        out,
        gradient_accumulation_steps=2,
        num_iterations=2,
        beta=0.04,
        max_steps=2,
        optim="sgd",
        learning_rate=0.1,
        lr_scheduler_type="constant",
        mask_truncated_completions=True,
        **settings,
    )
    return trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32"),
        reward_funcs=[tiny.length_reward, tiny.digit_reward],
        args=args,
        train_dataset=tiny.tiny_dataset(),
        processing_class=tok,
        rollout_func=tiny.TinyRollout(tok, seed=3),
    )


def log_history(model_dir, out, settings: dict, ours: bool) -> list[dict]:
    trainer = build(model_dir, out, settings)
    if ours:
        recipe, population = trl_equivalent(trainer.args, sampling_logprobs=True)
        attach(trainer, recipe, population=population)
    torch.manual_seed(0)
    trainer.train()
    return trainer.state.log_history


def same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:  # TRL logs None for a key whose every value was NaN
        return a is b
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= TOL


@pytest.mark.parametrize("loss_type", list(CASES))
def test_every_native_key_is_logged_with_trls_value(model_dir, tmp_path, loss_type):
    settings, acted = CASES[loss_type]
    native = log_history(model_dir, tmp_path / "native", settings, ours=False)
    ours = log_history(model_dir, tmp_path / "ours", settings, ours=True)
    assert len(native) == len(ours) == 3  # two steps and the summary
    for step, (theirs, mine) in enumerate(zip(native, ours), start=1):
        missing = sorted(k for k in theirs if k not in mine)
        assert not missing, f"{loss_type} step {step}: TRL's keys {missing} are not logged under lossplug"
        wrong = {k: (v, mine[k]) for k, v in theirs.items() if k not in TIMING and not same(v, mine[k])}
        assert not wrong, f"{loss_type} step {step}: (TRL, lossplug) = {wrong}"
        assert any(k.startswith("lossplug/") for k in mine) or step == 3, "lossplug's own metrics are logged beside"
    second = native[1]
    logged = LOSS_KEYS & set(second)
    expected = (
        {"kl", "entropy"} | ({acted} if acted else set()) | ({"policy_loss"} if "entropy_coef" in settings else set())
    )
    if acted == "clip_ratio/region_mean":
        expected |= {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/low_min", "clip_ratio/high_max"}
    assert logged == expected, f"{loss_type}: TRL logged {sorted(logged)}"
    # not vacuous: at the second step the policy moved off the rollout policy, the KL and the gate acted
    assert second["kl"] > 1e-3
    if acted is not None:
        assert abs(second[acted] - (1.0 if acted == "vespo/phi_seq_mean" else 0.0)) > 1e-2, (loss_type, second)


# ---------------------------------------------------------------------------------------------------------------------
# micro-batch by micro-batch: TRL's _compute_loss and lossplug's on the same inputs


@pytest.fixture(scope="module")
def micro_batches(model_dir, tmp_path_factory):
    """A trainer and its micro-batches of one generation batch, the policy then moved off the one that scored them
    (so that ratios differ from 1)."""
    trainer = build(model_dir, tmp_path_factory.mktemp("micro"), {"loss_type": "grpo"})
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    batches = list(trainer._buffered_inputs)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return trainer, batches


def configure(trainer, **settings) -> None:
    """Set TRL's loss options on the trainer and its config (TRL reads both)."""
    args = trainer.args
    for key, value in settings.items():
        setattr(args, key, value)
    trainer.loss_type = args.loss_type
    trainer.importance_sampling_level = args.importance_sampling_level
    trainer.epsilon_low = args.epsilon
    trainer.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon


def appended(trainer, compute, batches) -> dict[str, list[float]]:
    """The values ``compute`` appends to TRL's metric lists over the micro-batches (lossplug's own left out)."""
    trainer._metrics["train"].clear()
    with torch.no_grad():
        for batch in batches:
            compute(batch)
    return {k: list(v) for k, v in trainer._metrics["train"].items() if not k.startswith("lossplug/")}


def native_and_ours(trainer, batches, recipe=None, **attach_options):
    native = appended(trainer, lambda b: trl.GRPOTrainer._compute_loss(trainer, trainer.model, b), batches)
    recipe, population = (recipe, "generation") if recipe is not None else trl_equivalent(trainer.args)
    attach(trainer, recipe, population=population, **attach_options)
    ours = appended(trainer, lambda b: trainer._compute_loss(trainer.model, b), batches)
    return native, ours


SETTINGS = {
    # TRL caps the ratio at delta before counting: with delta below 1 + epsilon_high no token is high-clipped
    "delta": {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "delta": 1.1},
    "gspo_delta": {
        "loss_type": "grpo",
        "importance_sampling_level": "sequence",
        "epsilon": 3e-4,
        "epsilon_high": 4e-4,
        "delta": 1.0002,
    },
    "cispo_sequence": {"loss_type": "cispo", "importance_sampling_level": "sequence", "epsilon_high": 1.02},
    "sapo_sequence": {"loss_type": "sapo", "importance_sampling_level": "sequence"},
}
DEFAULTS = {"importance_sampling_level": "token", "epsilon": 0.2, "epsilon_high": 0.2, "delta": None}


@pytest.mark.parametrize("case", list(SETTINGS))
def test_micro_batch_values_are_trls(micro_batches, case):
    trainer, batches = micro_batches
    configure(trainer, **{**DEFAULTS, **SETTINGS[case]})
    native, ours = native_and_ours(trainer, batches)
    dashboard = {k: v for k, v in native.items() if k in LOSS_KEYS}
    assert {"kl", "entropy"} <= set(dashboard)
    for key, values in dashboard.items():
        assert key in ours, f"{case}: {key} is not logged under lossplug"
        assert len(ours[key]) == len(values) == len(batches)
        assert all(same(a, b) for a, b in zip(values, ours[key])), f"{case} {key}: TRL {values}, lossplug {ours[key]}"
    if case == "delta":
        assert max(native["clip_ratio/high_mean"]) == 0 < max(native["clip_ratio/low_mean"])
    if case == "cispo_sequence":
        assert max(native["cispo_clip_ratio"]) > 0


def test_a_gate_trl_has_no_key_for_adds_none(micro_batches):
    trainer, batches = micro_batches
    configure(trainer, **{**DEFAULTS, "loss_type": "dapo"})
    recipe = {
        "advantage": {"name": "grpo"},
        "gates": [{"name": "gspo_token", "eps_low": 0.2, "eps_high": 0.2}],
        "reduction": {"name": "token"},
        "regularizers": [{"name": "kl", "coef": 0.04, "estimator": "k3", "ratio_weight": "token", "clamp": False}],
    }
    native, ours = native_and_ours(trainer, batches, recipe=recipe)
    assert set(CLIP_KEYS) <= set(native)
    assert not (LOSS_KEYS - {"kl", "entropy"}) & set(ours), sorted(ours)  # (its own cut fractions are lossplug's)
    for key in ("kl", "entropy"):  # the KL regularizer is TRL's term: its token mean is TRL's kl
        assert all(same(a, b) for a, b in zip(native[key], ours[key])), (key, native[key], ours[key])


def test_metrics_off_keeps_trls_entropy_only(micro_batches):
    trainer, batches = micro_batches
    configure(trainer, **{**DEFAULTS, "loss_type": "dapo"})
    native, ours = native_and_ours(trainer, batches, metrics="off")
    assert set(CLIP_KEYS) <= set(native)
    assert LOSS_KEYS & set(ours) == {"entropy"}  # clip keys and the recipe's KL come from lossplug's metrics
    assert all(same(a, b) for a, b in zip(native["entropy"], ours["entropy"]))
