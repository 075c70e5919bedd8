"""TRL parity under data parallelism: for every ``GRPOConfig`` option :func:`trl_equivalent` maps, a real
``GRPOTrainer`` on two processes (torchrun, gloo on CPU) trained natively and the same trainer running
``attach(trainer, *trl_equivalent(args))`` end with the same parameters.

The setting is TRL's usual data-parallel one: gradient accumulation 2, ``num_iterations`` 2 (the second optimizer step
re-uses the generation batch, so the update ratios are no longer 1 and clips and masks act), ``beta`` 0.04, float32,
plain SGD (a wrong gradient cannot hide behind Adam's normalisation). Each process generates its own prompts' rollouts
(different on each process); TRL gathers rewards, token counts and — for ``top_entropy_quantile`` — entropies over
both processes, and DDP averages the gradients. For each option both runs start from the same weights and the same
rollouts and train two optimizer steps; the parameters must agree to float32 rounding on every process.

Not vacuous: every option's run moves the parameters, the option itself changes TRL's run (against a named
baseline run without it), the second step is off-policy (``lossplug/update/approx_kl`` ≠ 0) and, where the option
clips or masks, lossplug's metric says it did (a fraction > 0 at some step). The settings are chosen for that: the
tiny rollouts' behaviour log-probs put TRL's engine ratio at 0.02–0.4, so the truncation caps sit inside that range;
GSPO's clip range is widened to the sequence ratios one SGD step makes.

One torchrun invocation runs every case (each builds its trainers afresh: ~0.1 s; the training is what costs).
"""

from __future__ import annotations

import json
import textwrap
import time

import pytest

from .._torchrun import run_on_two_processes

pytest.importorskip("trl")

pytestmark = pytest.mark.slow

#: parameters after two SGD steps (lr 0.1): |Δ| ≤ TOL — float32 rounding of O(0.1–1) weights that moved by O(0.01)
#: (measured: ≤ 1.2e-8 wherever the mapping is exact)
TOL = 1e-6
#: each run must move the parameters at least this far from where they started
MIN_MOVE = 500 * TOL
#: an option must move the parameters at least this far from its baseline run (the same run without the option)
MIN_EFFECT = 50 * TOL

BASE = {"loss_type": "dapo", "epsilon_high": 0.28}
ADAPTIVE = {
    **BASE,
    "entropy_coef": 1.0,
    "use_adaptive_entropy": True,
    "entropy_target": 10.0,
    "entropy_coef_delta": 0.25,
    "entropy_coef_max": 2.0,
}
GRPO_SPG4 = {"loss_type": "grpo", "epsilon": 0.01, "epsilon_high": 0.01, "steps_per_generation": 4}
#: GSPO's own 3e-4 / 4e-4 would clip every sequence here (the first SGD step moves the sequence ratios by 5–50 %)
GSPO = {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 0.06, "epsilon_high": 0.3}


def case(settings, baseline="dapo", rollouts="tiny", vllm=None, acted=()):
    """One option's run. ``settings``: the ``GRPOConfig`` fields; ``baseline``: the case whose native run lacks only
    this option (None: the option is the baseline itself); ``rollouts``: ``tiny`` (a ``rollout_func``, some tokens
    unscored, ``mask_truncated_completions``), ``scored`` (every token scored, truncated rows kept) or ``generate``
    (TRL's own generation, no behaviour log-probs); ``vllm``: TRL's importance sampling ``(mode, clip_min,
    clip_max)``, computed by TRL from the rollout's log-probs; ``acted``: lossplug metric prefixes of which some
    logged value must be > 0 (the option's clip or mask did act)."""
    return {"settings": settings, "baseline": baseline, "rollouts": rollouts, "vllm": vllm, "acted": list(acted)}


PPO_CLIP = ("lossplug/ppo_clip/clip_frac",)
CASES = {
    # loss_type × importance_sampling_level × delta
    "dapo": case(BASE, baseline=None, acted=PPO_CLIP),
    "grpo": case({"loss_type": "grpo", "epsilon_high": 0.28}, acted=PPO_CLIP),
    "bnpo": case({"loss_type": "bnpo", "epsilon_high": 0.28}, acted=PPO_CLIP),
    "dr_grpo": case({"loss_type": "dr_grpo", "epsilon": 0.05}, acted=PPO_CLIP),
    "cispo": case({"loss_type": "cispo", "epsilon_high": 1.05}, acted=("lossplug/cispo/clip_frac",)),
    "sapo": case({"loss_type": "sapo"}),
    "vespo": case({"loss_type": "vespo"}),
    "luspo": case({**GSPO, "loss_type": "luspo"}, baseline="gspo", acted=("lossplug/gspo/clip_frac",)),
    # delta ≥ 1 + epsilon_high (TRL's recommendation) binds on negative-advantage tokens whose ratio rose: with
    # steps_per_generation 4 the second step's micro-batches were moved only by the first step's update of the
    # others, not along their own advantages, so some do. delta inside the clip range: TRL accepts it too
    "grpo_steps_per_generation_4": case(GRPO_SPG4, baseline="grpo", acted=PPO_CLIP),
    "grpo_delta": case(
        {**GRPO_SPG4, "delta": 1.02},
        baseline="grpo_steps_per_generation_4",
        acted=("lossplug/ppo_clip/delta_frac",),
    ),
    "grpo_delta_inside_clip_range": case(
        {"loss_type": "grpo", "epsilon_high": 0.28, "delta": 1.1},
        baseline="grpo",
        acted=("lossplug/ppo_clip/delta_frac",),
    ),
    "gspo": case(GSPO, baseline="grpo", acted=("lossplug/gspo/clip_frac",)),
    # gspo's delta: a positive-advantage sequence whose ratio rose past delta but not past 1 + epsilon_high takes
    # the constant delta·A (TRL clamps the unclipped branch whatever the advantage's sign; the gate does the same)
    "gspo_delta": case({**GSPO, "delta": 1.1}, baseline="gspo"),
    "cispo_sequence": case(
        {"loss_type": "cispo", "importance_sampling_level": "sequence", "epsilon_high": 1.05},
        baseline="cispo",
        acted=("lossplug/cispo_seq/clip_frac",),
    ),
    "sapo_sequence": case({"loss_type": "sapo", "importance_sampling_level": "sequence"}, baseline="sapo"),
    # the off-policy mask: against the behaviour log-probs (a rollout_func) or the old ones (TRL's generation)
    "off_policy_mask_sampling": case(
        {**BASE, "off_policy_mask_threshold": 0.05},
        baseline="dapo_scored",
        rollouts="scored",
        acted=("lossplug/off_policy_mask/drop_frac",),
    ),
    "off_policy_mask_old": case(
        {**BASE, "off_policy_mask_threshold": 1e-4},
        baseline="dapo_generate",
        rollouts="generate",
        acted=("lossplug/off_policy_mask/drop_frac",),
    ),
    # the quantile over every process's entropies (TRL gathers them)
    "top_entropy": case({**BASE, "top_entropy_quantile": 0.5}, acted=PPO_CLIP),
    # advantages
    "scale_rewards_batch": case({**BASE, "scale_rewards": "batch"}),
    "scale_rewards_none": case({**BASE, "scale_rewards": "none"}),
    "normalize_then_sum": case(
        {**BASE, "multi_objective_aggregation": "normalize_then_sum"}, baseline="dapo_scored", rollouts="scored"
    ),
    "normalize_then_sum_weights": case(
        {**BASE, "multi_objective_aggregation": "normalize_then_sum", "reward_weights": [0.3, 1.7]},
        baseline="normalize_then_sum",
        rollouts="scored",
    ),
    # vLLM importance sampling (TRL's own correction, from the rollout's behaviour log-probs)
    "vllm_token_truncate": case(BASE, vllm=("token_truncate", None, 0.2), acted=("lossplug/tis/trunc_frac",)),
    "vllm_token_truncate_floor": case(BASE, vllm=("token_truncate", 0.9, 1.1), acted=("lossplug/tis/floor_frac",)),
    "vllm_token_mask": case(BASE, vllm=("token_mask", 0.2, 5.0), acted=("lossplug/icepop/reject_frac",)),
    "vllm_sequence_truncate": case(
        BASE, vllm=("sequence_truncate", None, 0.05), acted=("lossplug/tis_seq/trunc_frac",)
    ),
    "vllm_sequence_mask": case(BASE, vllm=("sequence_mask", 1e-3, 50.0), acted=("lossplug/icepop_seq/reject_frac",)),
    "vllm_sequence_mask_no_low": case(
        {"loss_type": "grpo"},
        baseline="grpo",
        vllm=("sequence_mask", None, 3.0),
    ),
    "vespo_vllm_token_truncate": case({"loss_type": "vespo"}, baseline="vespo", vllm=("token_truncate", 0.2, 3.0)),
    "vespo_vllm_token_mask": case(
        {"loss_type": "vespo"}, baseline="vespo_vllm_token_truncate", vllm=("token_mask", 0.2, 2.0)
    ),
    # KL (beta, use_bias_correction_kl: the token ratio, the sequence ratio, none)
    "kl_bias_corrected": case({**BASE, "beta": 0.5}),
    "kl_without_bias_correction": case(
        {**BASE, "beta": 0.5, "use_bias_correction_kl": False}, baseline="kl_bias_corrected"
    ),
    "kl_sequence_bias_corrected": case({**GSPO, "beta": 0.5}, baseline="gspo"),
    "no_kl": case({**BASE, "beta": 0.0}, baseline="kl_bias_corrected"),
    # entropy bonus (rows emptied by mask_truncated_completions still count in TRL's per-micro-batch mean)
    "entropy_static": case({**BASE, "entropy_coef": 0.5}),
    "entropy_static_top_entropy": case(
        {**BASE, "entropy_coef": 0.5, "top_entropy_quantile": 0.5}, baseline="top_entropy"
    ),
    "entropy_adaptive": case(ADAPTIVE, baseline="dapo_scored", rollouts="scored"),
    # the other rollouts, and an optimizer step that is half a generation batch
    "dapo_scored": case(BASE, baseline=None, rollouts="scored"),
    "dapo_generate": case(BASE, baseline=None, rollouts="generate"),
    "steps_per_generation_4": case({**BASE, "steps_per_generation": 4}),
    "bnpo_steps_per_generation_4": case(
        {"loss_type": "bnpo", "epsilon_high": 0.28, "steps_per_generation": 4}, baseline="steps_per_generation_4"
    ),
}

SCRIPT = textwrap.dedent("""
    import functools, importlib.metadata

    # transformers, accelerate and lossplug's run record look installed versions up at every trainer and train();
    # each look-up scans sys.path's distributions (~0.1 s a run): nothing is installed meanwhile
    importlib.metadata.version = functools.cache(importlib.metadata.version)
    importlib.metadata.metadata = functools.cache(importlib.metadata.metadata)

    import copy, gc, json, math, os, sys, time, traceback, warnings
    import torch, trl
    from transformers import AutoModelForCausalLM
    from lossplug.adapters.trl import attach, trl_equivalent
    from lossplug.testing import tiny

    out_dir, cases = sys.argv[1], json.loads(open(sys.argv[2]).read())
    rank = int(os.environ["RANK"])
    warnings.filterwarnings("ignore")
    model_dir = os.path.join(out_dir, f"model{rank}")
    tiny.tiny_model_and_tokenizer(model_dir)  # same seed on every process: the same weights
    tok = tiny.tiny_tokenizer()
    loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")  # every run trains a copy of it
    initial = [p.detach().clone() for p in loaded.parameters()]
    # accelerate runs gc.collect() at every train(): let it walk only what each run makes
    gc.collect()
    gc.freeze()

    def build(spec, run_dir):
        config = {"gradient_accumulation_steps": 2, "num_iterations": 2, "beta": 0.04, "max_steps": 2,
                  "optim": "sgd", "learning_rate": 0.1, "lr_scheduler_type": "constant", **spec["settings"]}
        if spec["rollouts"] == "tiny":
            config["mask_truncated_completions"] = True
        rollout = None
        if spec["rollouts"] != "generate":  # each process its own completions
            rollout = tiny.TinyRollout(tok, seed=3 + 100 * rank, unscored=spec["rollouts"] == "tiny")
        trainer = trl.GRPOTrainer(model=copy.deepcopy(loaded),
                                  reward_funcs=[tiny.length_reward, tiny.digit_reward],
                                  args=tiny.tiny_grpo_config(run_dir, **config), train_dataset=tiny.tiny_dataset(),
                                  processing_class=tok, rollout_func=rollout)
        if spec["vllm"] is not None:  # TRL computes and applies its own correction from the behaviour log-probs
            mode, clip_min, clip_max = spec["vllm"]
            for obj in (trainer.args, trainer):
                obj.use_vllm = obj.vllm_importance_sampling_correction = True
                obj.vllm_importance_sampling_mode = mode
                obj.vllm_importance_sampling_clip_min = clip_min
                obj.vllm_importance_sampling_clip_max = clip_max
            trainer._last_loaded_step = 0  # the weights "are in sync": no engine to push them to
        return trainer

    def train(spec, run_dir, ours):
        trainer = build(spec, run_dir)
        if ours:
            recipe, population = trl_equivalent(trainer.args, sampling_logprobs=trainer.rollout_func is not None)
            attach(trainer, recipe, population=population)
        torch.manual_seed(0)
        trainer.train()
        assert trainer.accelerator.num_processes == 2
        params = [p.detach().clone() for p in trainer.model.parameters()]
        metrics = {}  # lossplug's metrics: the largest |value| logged
        for row in trainer.state.log_history:
            for k, v in row.items():
                if k.startswith("lossplug/") and isinstance(v, float) and math.isfinite(v):
                    metrics[k] = max(abs(v), metrics.get(k, 0.0))
        return params, metrics

    def max_diff(a, b):
        return max(float((x - y).abs().max()) for x, y in zip(a, b))

    native, results = {}, {}
    for name, spec in cases.items():
        start = time.perf_counter()
        try:
            native[name], _ = train(spec, os.path.join(out_dir, "native"), ours=False)
            ours, metrics = train(spec, os.path.join(out_dir, "ours"), ours=True)
            results[name] = {"diff": max_diff(native[name], ours), "move": max_diff(native[name], initial),
                             "checksum": float(sum(p.double().sum() for p in native[name])),
                             "metrics": metrics}
        except Exception:
            results[name] = {"error": traceback.format_exc()[-3000:]}
        results[name]["seconds"] = time.perf_counter() - start
    for name, spec in cases.items():
        base = spec["baseline"]
        if base is not None and name in native and base in native:
            results[name]["effect"] = max_diff(native[name], native[base])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    # the results are written: leave without the interpreter's teardown, where a native thread still being joined
    # (gloo, OpenMP) can abort a process whose work succeeded
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
""")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every case on two processes, in one torchrun: ``[rank 0's results, rank 1's]``, each ``{case: result}``."""
    tmp = tmp_path_factory.mktemp("trl_ddp_parity")
    (tmp / "ddp.py").write_text(SCRIPT)
    (tmp / "cases.json").write_text(json.dumps(CASES))
    from lossplug.testing.tiny import OFFLINE_ENV

    start = time.perf_counter()
    run_on_two_processes(tmp / "ddp.py", str(tmp), str(tmp / "cases.json"), env=OFFLINE_ENV, timeout=600)
    results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)]
    print(f"\ntorchrun, {len(CASES)} options × 2 runs × 2 processes: {time.perf_counter() - start:.1f} s")
    for name, r in results[0].items():
        if "error" in r:
            print(f"{name}: ERROR ({r['seconds']:.1f} s)")
        else:
            print(
                f"{name}: max|Δparam| = {r['diff']:.2e}, moved {r['move']:.2e}, option's effect "
                f"{r.get('effect', float('nan')):.2e} ({r['seconds']:.1f} s)"
            )
    return results


def test_every_case_has_a_baseline_that_exists():
    for name, spec in CASES.items():
        assert spec["baseline"] is None or spec["baseline"] in CASES, name


@pytest.mark.parametrize("name", list(CASES))
def test_parameters_after_two_steps_match_trl_on_two_processes(ranks, name):
    for rank, results in enumerate(ranks):
        r = results[name]
        assert "error" not in r, f"{name} (rank {rank}) raised:\n{r['error']}"
        assert r["diff"] <= TOL, f"{name} (rank {rank}): max|Δparam| = {r['diff']:.2e} > {TOL:g}"
        assert r["move"] >= MIN_MOVE, f"{name}: the parameters barely moved ({r['move']:.2e}): vacuous comparison"
        if CASES[name]["baseline"] is not None:
            assert r["effect"] >= MIN_EFFECT, (
                f"{name}: the option barely changes TRL's run against {CASES[name]['baseline']} "
                f"({r['effect']:.2e}): vacuous comparison"
            )
        metrics = r["metrics"]
        assert metrics.get("lossplug/update/approx_kl", 0.0) > 1e-4, f"{name}: the second step was not off-policy"
        for prefix in CASES[name]["acted"]:
            acted = {k: v for k, v in metrics.items() if k.startswith(prefix)}
            assert acted and max(acted.values()) > 0, f"{name}: no {prefix}* metric > 0: {acted}"
    # DDP: both processes hold the same parameters
    assert ranks[0][name]["checksum"] == ranks[1][name]["checksum"], name
