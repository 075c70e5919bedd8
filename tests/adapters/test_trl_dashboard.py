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
runs do not cover (``delta``, sequence-level cispo and sapo, evaluation, a recipe whose gate TRL has no key for,
``metrics="off"``) and compares the values TRL appends, micro-batch by micro-batch; the last tests check which gate
gets which keys, and the reductions over two processes against TRL's definitions on the pooled tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl")

import trl
from transformers import AutoModelForCausalLM

import lossplug
from lossplug.adapters.common import ActionRows
from lossplug.adapters.trl import attach, trl_equivalent
from lossplug.adapters.trl.dashboard import ClipRule, DashboardPlan, clip_rule, trl_dashboard
from lossplug.contracts import Recipe
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
def _quick_gc(frozen_gc):
    """Every test of this module trains many real trainers."""


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
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode].clear()
    with torch.no_grad():
        for batch in batches:
            compute(batch)
    return {k: list(v) for k, v in trainer._metrics[mode].items() if not k.startswith("lossplug/")}


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


def test_evaluation_logs_trls_values_too(micro_batches):
    trainer, batches = micro_batches
    configure(trainer, **{**DEFAULTS, "loss_type": "dapo", "epsilon_high": 0.28})
    trainer.model.eval()  # the micro-batches keep their old log-probs: ratios still differ from 1
    try:
        native, ours = native_and_ours(trainer, batches)
    finally:
        trainer.model.train()
    assert set(CLIP_KEYS) | {"kl", "entropy"} <= set(native) and max(native["clip_ratio/region_mean"]) > 0
    for key, values in native.items():
        assert all(same(a, b) for a, b in zip(values, ours[key])), (key, values, ours[key])


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


# ---------------------------------------------------------------------------------------------------------------------
# the rule (which gate gets which keys) and the reductions over processes, without a trainer


def rule_of(gate: dict):
    return clip_rule(lossplug.compile_recipe(Recipe.load({"advantage": "grpo", "gates": [gate], "reduction": "token"})))


def test_clip_keys_follow_the_update_gate_and_its_own_bounds():
    ppo = rule_of({"name": "ppo_clip", "eps_low": 0.1, "eps_high": 0.3})
    assert (ppo.family, ppo.sequence, ppo.low, ppo.high, ppo.cap) == ("ppo", False, 0.9, 1.3, None)
    # TRL caps the ratio at delta; a dual clip is TRL's delta only at c >= 1 + eps_high
    assert rule_of({"name": "ppo_clip", "delta": 1.1}).cap == 1.1
    assert rule_of({"name": "ppo_clip", "dual_clip_c": 3.0}).cap == 3.0
    assert rule_of({"name": "ppo_clip", "eps_high": 0.2, "dual_clip_c": 1.1}).cap is None
    gspo = rule_of({"name": "gspo", "eps_low": 3e-4, "eps_high": 4e-4, "delta": 1.0002})
    assert (gspo.family, gspo.sequence, gspo.cap) == ("ppo", True, 1.0002)
    cispo = rule_of({"name": "cispo", "eps_low": None, "ratio_max": 5.0, "log_ratio_clamp": None})
    assert (cispo.family, cispo.sequence, cispo.high) == ("cispo", False, 5.0)
    assert rule_of({"name": "cispo_seq", "eps_high": 0.2}).sequence and rule_of({"name": "cispo"}).high == 1.2
    # no TRL key: sapo (TRL logs none), verl's gates, plain policy gradient
    for name in ("sapo", "gspo_token", "dppo_tv", "reinforce"):
        assert rule_of({"name": name}) is None, name


class TwoProcesses:
    """An accelerator for process 0 of two whose peer's local values were recorded first: ``gather`` stacks them."""

    num_processes = 2

    def __init__(self) -> None:
        self.peer: torch.Tensor | None = None

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        if self.peer is None:  # the peer's call: record, and stand in for the gathered table
            self.peer = local
            return torch.cat([local, local])
        return torch.cat([local, self.peer])


def test_means_and_extremes_are_reduced_over_processes_as_trl_reduces_them():
    gen = torch.Generator().manual_seed(0)
    plan = DashboardPlan(clip=ClipRule("ppo", False, 0.8, 1.2), vespo=False, recipe_kl_metric=None)
    procs = []
    for rows, cols in ((4, 6), (3, 9)):  # different numbers of tokens: a mean of process means is not TRL's
        mask = (torch.rand(rows, cols, generator=gen) > 0.3).long()
        mask[0] = 0  # a row without action tokens: NaN in the per-response means, ignored by TRL's nanmin
        logps = -torch.rand(rows, cols, generator=gen)
        procs.append(
            {
                "mask": mask,
                "logps": logps,
                "old": logps + 0.3 * torch.randn(rows, cols, generator=gen),
                "advantages": torch.randn(rows, generator=gen),
                "entropies": torch.rand(rows, cols, generator=gen),
                "per_token_kl": torch.rand(rows, cols, generator=gen),
            }
        )
    accelerator = TwoProcesses()
    for p in (procs[1], procs[0]):  # the peer first, then process 0, which reads both
        out = trl_dashboard(accelerator, plan, **p, metrics={}, rows=ActionRows(p["mask"]))
    # TRL's definitions on the two processes' tokens together (grpo_trainer.py, _compute_loss's metric block)
    low, high, per_row_low, per_row_high = [], [], [], []
    for p in procs:
        ratio, adv = (p["logps"] - p["old"]).exp(), p["advantages"].unsqueeze(1)
        low.append(((ratio < 0.8) & (adv < 0)).float())
        high.append(((ratio > 1.2) & (adv > 0)).float())
        per_row_low.append((low[-1] * p["mask"]).sum(-1) / p["mask"].sum(-1))
        per_row_high.append((high[-1] * p["mask"]).sum(-1) / p["mask"].sum(-1))

    def global_mean(values):
        return float(sum((v * p["mask"]).sum() for v, p in zip(values, procs)) / sum(p["mask"].sum() for p in procs))

    gathered_low, gathered_high = torch.cat(per_row_low), torch.cat(per_row_high)
    expected = {
        "kl": global_mean([p["per_token_kl"] for p in procs]),
        "entropy": global_mean([p["entropies"] for p in procs]),
        "clip_ratio/low_mean": global_mean(low),
        "clip_ratio/high_mean": global_mean(high),
        "clip_ratio/region_mean": global_mean([torch.maximum(a, b) for a, b in zip(low, high)]),
        "clip_ratio/low_min": float(gathered_low[~gathered_low.isnan()].min()),
        "clip_ratio/high_max": float(gathered_high[~gathered_high.isnan()].max()),
    }
    assert out.keys() == expected.keys()
    for key, value in expected.items():
        assert out[key] == pytest.approx(value, abs=1e-6), key
    assert 0 < expected["clip_ratio/region_mean"] < 1 and expected["clip_ratio/high_max"] > 0
