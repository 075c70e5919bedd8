"""Items 3 and 4: gate + reduction forward+backward against TRL's and verl's native loss code; contract validation.

Every case runs on the same tensors for both sides: ``logp`` is a fresh leaf (requires grad) for every call, the
step is the loss's forward **and** ``backward()``; timings and allocation peaks include the trainer's own metrics
(verl's ``pg_metrics`` with their ``.item()`` syncs, TRL's clip-ratio metrics) against lossplug with
``metrics="basic"`` (what the adapters run by default: the loss, the approximate KL and each gate's cut fractions —
the same kind of metrics); ``metrics="off"`` and ``metrics="full"`` (ratio quantiles, effective-sample fractions) are
reported as well.

Baselines
---------
* **verl** (0.9.1): its functions, called exactly as ``verl/workers/utils/losses.py::ppo_loss`` calls them —
  ``compute_policy_loss_vanilla`` / ``_gspo`` / ``_sapo`` / ``_cispo`` with an ``ActorConfig`` whose
  ``global_batch_info`` holds the micro-batch's own population (dp_size 1), ``agg_loss`` inside them. Advantages are
  ``[B, T]`` (verl stores token advantages). For CISPO + TIS, verl computes ``rollout_is_weights`` once per batch in
  the trainer (``rollout_corr_helper.compute_rollout_correction_weights``, with batch-level metrics); the baseline
  computes the same token-TIS formula inline per micro-batch (``exp(clamp(old − rollout, ±20)) · mask``, clamped at
  2) without those metrics, because lossplug's ``tis`` gate computes it per micro-batch.
* **TRL** (1.16): ``GRPOTrainer._compute_loss`` needs a model forward; its per-token math after the log-probs is
  **replicated** line by line (the coefficient, the loss_type's per-token loss, the loss_type's reduction with one
  process and no gradient accumulation, and the clip-ratio metrics with ``accelerator.reduce`` as the identity).
  Advantages are ``[B]`` as TRL passes them. CISPO + TIS: TRL's ``vllm_importance_sampling_mode="token_truncate"``
  ratio (computed in ``_generate_and_score_completions``) is computed inline per micro-batch, like lossplug's gate.

Each lossplug recipe is the one that reproduces the baseline exactly — the same arithmetic, so the same work: e.g.
TRL's SAPO clamps no log-ratio (``log_ratio_clamp: null``), verl's clamps at ±20 (the default); the benchmark checks
loss and gradient agreement before timing.

Metrics, side by side (what each side computes per micro-batch; like with like unless said):

* verl: ``pg_metrics`` (clip fractions, ``ppo_kl``, with ``.item()``) ↔ ``basic``'s ``update/approx_kl`` and the
  gate's cut fractions.
* TRL ppo_clip / gspo: ``clip_ratio/{low,high,region}_mean``, ``low_min``, ``high_max`` (``.item()`` each) ↔
  ``update/approx_kl`` and the cut fractions. TRL sapo logs no loss metric: ``basic``'s ``update/approx_kl`` (one
  ``[B, T]`` sum) is charged to lossplug alone. TRL cispo: ``cispo_clip_ratio`` ↔ cispo's cut fractions.
* The engine side of CISPO + TIS: TRL's sampling metrics of its ratio (log-prob difference mean and max, ratio
  min/mean/max: ~2.5 ms at 64 × 4096 through boolean indexing) and verl's ``rollout_corr`` metrics (~20 ms) run once
  per generation / training batch, not per micro-batch, and are left out; lossplug's per-micro-batch
  ``engine/approx_kl`` and ``tis/trunc_frac`` are charged to lossplug.
* TRL's ``entropy`` metric is logged by both trainers with TRL's own code, outside the loss: on neither side.
* A trainer's ``.item()`` is a read on the CPU (no device to wait for); lossplug keeps 0-d tensors, which its adapters
  read in one transfer per micro-batch (not timed here, a few µs).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import lossplug

from .common import interleaved, peak_bytes, ratio, summarize

TIS_CAP = 2.0


def make_tensors(B: int, T: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded responses of mixed length; off-policy noise so that clips and truncations happen."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(T // 4, 1), T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    old = -torch.rand(B, T, generator=g) * 3
    logp = (old + 0.1 * torch.randn(B, T, generator=g)).clamp(max=0)
    behavior = (old + 0.1 * torch.randn(B, T, generator=g)).clamp(max=0)
    adv = torch.randn(B, generator=g)
    # padding holds finite garbage (verl multiplies by the mask, so NaN there would poison its loss)
    return {
        "logp": torch.where(mask, logp, 0.0),
        "old_logp": torch.where(mask, old, 0.0),
        "behavior_logp": torch.where(mask, behavior, 0.0),
        "advantage": adv,
        "advantage_bt": adv[:, None].expand(B, T).contiguous(),
        "mask": mask,
    }


# ---------------------------------------------------------------------------------------------------------------------
# The cases


@dataclass
class Case:
    name: str
    trainer: str  # "verl" or "trl"
    recipe: dict
    native: Callable[[dict, torch.Tensor], torch.Tensor]  # (tensors, logp leaf) -> loss
    token_advantage: bool  # lossplug gets [B, T] advantages (as verl's adapter passes) or [B] (TRL)
    behavior: bool = False


def _verl_config(B: int, tokens: int, **kw):
    from verl.workers.config import ActorConfig

    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=B, **kw)
    config.global_batch_info.update(
        {"dp_size": 1, "batch_num_tokens": tokens, "global_batch_size": B, "loss_scale_factor": None}
    )
    return config


def verl_cases(B: int, tokens: int) -> list[Case]:
    from verl.trainer.ppo import core_algos as ca

    vanilla = _verl_config(
        B, tokens, clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean"
    )
    gspo = _verl_config(B, tokens, clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode="seq-mean-token-mean")
    sapo = _verl_config(B, tokens, loss_agg_mode="seq-mean-token-mean")
    cispo = _verl_config(B, tokens, clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="token-mean")

    def call(fn, config, mode):
        def native(t, logp, weights=None):
            return fn(
                old_log_prob=t["old_logp"],
                log_prob=logp,
                advantages=t["advantage_bt"],
                response_mask=t["mask"],
                loss_agg_mode=mode,
                config=config,
                rollout_is_weights=weights,
            )[0]

        return native

    def cispo_tis(t, logp):
        with torch.no_grad():  # verl's token TIS formula (rollout_corr_helper), without its batch metrics
            log_ratio = torch.clamp(t["old_logp"] - t["behavior_logp"], min=-20.0, max=20.0)
            weights = (torch.exp(log_ratio) * t["mask"]).clamp(max=TIS_CAP)
        return call(ca.compute_policy_loss_cispo, cispo, "token-mean")(t, logp, weights)

    return [
        Case(
            "ppo_clip+token",
            "verl",
            {
                "gates": [{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2, "dual_clip_c": 3.0}],
                "reduction": "token",
            },
            call(ca.compute_policy_loss_vanilla, vanilla, "token-mean"),
            True,
        ),
        Case(
            "gspo",
            "verl",
            {"gates": [{"name": "gspo_token", "eps_low": 3e-4, "eps_high": 4e-4}], "reduction": "response"},
            call(ca.compute_policy_loss_gspo, gspo, "seq-mean-token-mean"),
            True,
        ),
        Case(
            "sapo",
            "verl",
            {"gates": ["sapo"], "reduction": "response"},
            call(ca.compute_policy_loss_sapo, sapo, "seq-mean-token-mean"),
            True,
        ),
        Case(
            "cispo+tis",
            "verl",
            {
                "gates": [{"name": "cispo", "eps_low": 0.2, "eps_high": 0.2}, {"name": "tis", "cap": TIS_CAP}],
                "reduction": "token",
            },
            cispo_tis,
            True,
            behavior=True,
        ),
    ]


# TRL's _compute_loss after the log-probs, replicated line by line (trl 1.16.0, grpo_trainer.py)


def _trl_masked_mean(x, mask):  # global_masked_mean with one process
    return ((x * mask).sum() / mask.sum().float().clamp(min=1.0)).item()


def _trl_clip_loss(level: str, eps_low: float, eps_high: float, loss_type: str):
    def native(t, logp):
        mask = t["mask"].long()  # TRL's completion_mask is an int64 tensor
        advantages = t["advantage"].unsqueeze(1)
        log_ratio = logp - t["old_logp"]
        if level == "token":
            log_importance_weights = log_ratio
        else:
            log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        coef_1 = torch.exp(log_importance_weights)
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
        if loss_type == "grpo":
            loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        else:  # dapo: / (num_items_in_batch / processes × GA / steps_per_generation) = / action tokens here
            loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
        is_low = (coef_1 < 1 - eps_low) & (advantages < 0)
        is_high = (coef_1 > 1 + eps_high) & (advantages > 0)
        if coef_1.shape[1] == 1:
            metrics = [float(x.float().mean()) for x in (is_low, is_high, is_low | is_high)]
            seq_low, seq_high = is_low.float().squeeze(1), is_high.float().squeeze(1)
        else:
            metrics = [_trl_masked_mean(x.float(), mask) for x in (is_low, is_high, is_low | is_high)]
            seq_low = (is_low.float() * mask).sum(-1) / mask.sum(-1)
            seq_high = (is_high.float() * mask).sum(-1) / mask.sum(-1)
        metrics += [float(seq_low.min()), float(seq_high.max())]
        return loss

    return native


def _trl_sapo(t, logp):
    mask = t["mask"].long()
    advantages = t["advantage"].unsqueeze(1)
    coef_1 = torch.exp(logp - t["old_logp"])
    temperatures = torch.where(advantages > 0, 1.0, 1.05)
    soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
    per_token_loss = -soft_coef_1 * advantages
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def _trl_cispo_tis(t, logp):
    mask = t["mask"].long()
    with torch.no_grad():  # _generate_and_score_completions, vllm_importance_sampling_mode="token_truncate"
        diff = torch.nan_to_num((t["old_logp"] - t["behavior_logp"]) * mask, nan=0.0)
        is_ratio = torch.clamp(torch.exp(diff), min=None, max=TIS_CAP)
    advantages = t["advantage"].unsqueeze(1)
    coef_1 = torch.exp(logp - t["old_logp"])
    clamped_ratios = torch.clamp(coef_1, max=5.0).detach()
    per_token_loss = -clamped_ratios * advantages * logp
    per_token_loss = per_token_loss * is_ratio
    loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    _trl_masked_mean(((coef_1 > 5.0) & (advantages > 0)).float(), mask)
    return loss


def trl_cases() -> list[Case]:
    """TRL's ``_compute_loss`` after the log-probs, replicated (trl 1.16.0, grpo_trainer.py)."""
    return [
        Case(
            "ppo_clip+token",
            "trl",
            {"gates": [{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2}], "reduction": "token"},
            _trl_clip_loss("token", 0.2, 0.2, "dapo"),
            False,
        ),
        Case(
            "gspo",
            "trl",
            {"gates": [{"name": "gspo", "eps_low": 3e-4, "eps_high": 4e-4}], "reduction": "response"},
            _trl_clip_loss("sequence", 3e-4, 4e-4, "grpo"),
            False,
        ),
        Case(
            "sapo",
            "trl",
            {"gates": [{"name": "sapo", "log_ratio_clamp": None}], "reduction": "response"},  # TRL clamps nothing
            _trl_sapo,
            False,
        ),
        Case(
            "cispo+tis",
            "trl",
            {
                "gates": [
                    {"name": "cispo", "eps_low": None, "ratio_max": 5.0, "log_ratio_clamp": None},
                    {"name": "tis", "cap": TIS_CAP, "log_ratio_clamp": None},  # TRL clamps nothing
                ],
                "reduction": "token",
            },
            _trl_cispo_tis,
            False,
            behavior=True,
        ),
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Running a case


def _lossplug_step(case: Case, t: dict, recipe: lossplug.Recipe, normalizer, metrics: bool, validate: str = "off"):
    def step(logp):
        batch = lossplug.PolicyBatch.unchecked(
            logp=logp,
            action_mask=t["mask"],
            old_logp=t["old_logp"],
            behavior_logp=t["behavior_logp"] if case.behavior else None,
            advantage=t["advantage_bt"] if case.token_advantage else t["advantage"],
        )
        result = lossplug.policy_loss(batch, recipe, normalizer, validate=validate, metrics=metrics)
        return result.loss

    return step


def _with_backward(step, leaf: dict):
    def run():
        loss = step(leaf["logp"])
        loss.backward()
        return loss

    return run


def bench_case(case: Case, t: dict, repeats: int) -> dict:
    B = t["mask"].shape[0]
    tokens = int(t["mask"].sum())
    recipe = lossplug.Recipe.model_validate(case.recipe)
    normalizer = lossplug.Normalizer(action_tokens=tokens, sequences=B)
    leaf = {}

    def fresh():
        leaf["logp"] = t["logp"].clone().requires_grad_(True)

    steps = {
        "native": lambda logp: case.native(t, logp),
        "lossplug": _lossplug_step(case, t, recipe, normalizer, metrics="basic"),
        "lossplug_no_metrics": _lossplug_step(case, t, recipe, normalizer, metrics="off"),
        "lossplug_full_metrics": _lossplug_step(case, t, recipe, normalizer, metrics="full"),
    }
    runs = {name: _with_backward(step, leaf) for name, step in steps.items()}

    # agreement of loss and gradient (the recipe reproduces the native loss)
    results = {}
    for name in ("native", "lossplug"):
        fresh()
        loss = runs[name]()
        results[name] = (loss.detach(), leaf["logp"].grad)
    (l0, g0), (l1, g1) = results["native"], results["lossplug"]
    loss_diff = float((l0 - l1).abs())
    grad_diff = float((g0 - g1).abs().max())

    times = interleaved(runs, repeats, warmup=2, setup=fresh)
    peaks = {}
    for name, run in runs.items():
        fresh()
        peaks[name] = peak_bytes(run)
    out = {
        "item": "loss_step",
        "case": case.name,
        "baseline": case.trainer,
        "B": B,
        "T": t["mask"].shape[1],
        "action_tokens": tokens,
        "recipe": case.recipe,
        "loss_abs_diff": loss_diff,
        "grad_max_abs_diff": grad_diff,
        **{name: {**times[name], "peak_bytes": peaks[name]} for name in runs},
    }
    for name, suffix in (
        ("lossplug", ""),
        ("lossplug_no_metrics", "_no_metrics"),
        ("lossplug_full_metrics", "_full_metrics"),
    ):
        r = ratio(times[name], times["native"])
        out[f"time_ratio{suffix}"] = r["ratio"]
        out[f"time_ratio_min{suffix}"] = r["ratio_min"]
        out[f"mem_ratio{suffix}"] = peaks[name] / max(peaks["native"], 1)
    out["metrics"] = "lossplug: metrics='basic' (the adapters' default); _no_metrics: 'off'; _full_metrics: 'full'"
    out["goal"] = "<= 1.10x time and <= 1.10x peak memory"
    out["met"] = out["time_ratio"] <= 1.10 and out["mem_ratio"] <= 1.10
    out["met_no_metrics"] = out["time_ratio_no_metrics"] <= 1.10 and out["mem_ratio_no_metrics"] <= 1.10
    return out


def case_inputs(case: Case, t: dict) -> tuple[lossplug.Recipe, lossplug.Normalizer, dict]:
    """``(recipe, normalizer, fields)`` of a case: its recipe, the tensors' whole population, and the batch fields
    beside ``logp`` (which each timed call takes fresh)."""
    recipe = lossplug.Recipe.model_validate(case.recipe)
    normalizer = lossplug.Normalizer(action_tokens=int(t["mask"].sum()), sequences=t["mask"].shape[0])
    fields = dict(
        action_mask=t["mask"],
        old_logp=t["old_logp"],
        behavior_logp=t["behavior_logp"] if case.behavior else None,
        advantage=t["advantage_bt"] if case.token_advantage else t["advantage"],
    )
    return recipe, normalizer, fields


def bench_validation(case: Case, t: dict, repeats: int) -> dict:
    """Item 4: what validation costs in lossplug's loss step (basic metrics, what the adapters run).

    The headline is **in the step**: the time ``policy_loss(validate="full")`` spends in its checks — the contract's
    rules before the loss (``pipeline._check_policy_inputs``: the memo's constant fields, one integer max over the
    fresh ``logp``) and the checks that read what the loss pass computed after it (``pipeline._settle_checks``: the
    logp's finiteness from ``update/approx_kl``, the loss, the Normalizer's coverage) — timed inside each full step,
    as a fraction of the step with ``validate="off"``. Cross-checks: the difference of the two steps' medians, and
    ``PolicyBatch(...)`` construction (the complete contract a user building a batch pays, reading the fresh
    ``logp`` for finiteness too; ``validate_first``: with the memo cleared, what the first micro-batch of a step
    reads).
    """
    from lossplug import pipeline
    from lossplug.contracts.batch import forget_checked

    B = t["mask"].shape[0]
    recipe, normalizer, fields = case_inputs(case, t)
    leaf = {}

    def fresh():
        leaf["logp"] = t["logp"].clone().requires_grad_(True)

    def construct():  # the PolicyBatch contract: one O(N) pass over what is new, one host sync
        return lossplug.PolicyBatch(logp=leaf["logp"], **fields)

    def construct_first():
        forget_checked()
        return construct()

    in_step: list[float] = []
    spent = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - started

        return wrapper

    step_off = _with_backward(_lossplug_step(case, t, recipe, normalizer, metrics="basic", validate="off"), leaf)
    full = _with_backward(_lossplug_step(case, t, recipe, normalizer, metrics="basic", validate="full"), leaf)

    def step_full():
        spent[0] = 0.0
        full()
        in_step.append(spent[0])

    step_bare = _with_backward(_lossplug_step(case, t, recipe, normalizer, metrics="off", validate="off"), leaf)
    native = _with_backward(lambda logp: case.native(t, logp), leaf)
    originals = pipeline._check_policy_inputs, pipeline._settle_checks
    pipeline._check_policy_inputs, pipeline._settle_checks = (timed(f) for f in originals)
    try:
        times = interleaved(
            {
                "validate_construct": construct,
                "validate_first": construct_first,
                "step_off": step_off,
                "step_full": step_full,
                "step_no_metrics": step_bare,
                "native": native,
            },
            repeats,
            warmup=2,
            setup=fresh,
        )
    finally:
        pipeline._check_policy_inputs, pipeline._settle_checks = originals
    times["validate"] = summarize(in_step[-repeats:])  # (the warm-up calls dropped)
    v = times["validate"]["median_s"]
    off = times["step_off"]["median_s"]
    frac = v / off
    return {
        "item": "validation",
        "case": case.name,
        "baseline": case.trainer,
        "B": B,
        "T": t["mask"].shape[1],
        **times,
        "fraction_of_step": frac,
        "fraction_of_step_no_metrics": v / times["step_no_metrics"]["median_s"],
        "fraction_of_native_step": v / times["native"]["median_s"],
        "first_fraction_of_step": times["validate_first"]["median_s"] / off,
        "construct_fraction_of_step": times["validate_construct"]["median_s"] / off,
        "validate_full_overhead": (times["step_full"]["median_s"] - off) / off,
        "goal": "<= 5% of the loss step",
        "met": frac <= 0.05,
        "note": "validate: the time policy_loss(validate='full') spends in its checks, timed inside the step, as a "
        "fraction of lossplug's loss step with validate='off' and basic metrics (what the adapters run), without "
        "metrics, and of the native step; validate_full_overhead: the difference of the full and off steps' "
        "medians (a noisy cross-check); construct: PolicyBatch(...) with its complete contract check, the "
        "constant fields remembered; validate_first: the same reading every field (the first micro-batch of a "
        "step)",
    }
