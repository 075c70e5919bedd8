"""Item 5: a tiny end-to-end TRL training run, native ``GRPOTrainer`` against ``LossplugGRPOTrainer``.

Both trainers get the same tiny model (same seed), data, reward and ``GRPOConfig`` (TRL's default ``loss_type``);
the lossplug one runs the recipe that reproduces TRL's loss (``lossplug.adapters.trl.trl_equivalent``) with the
adapter's defaults (``validate="full"``, metrics on). A step is everything ``Trainer.train`` does between
``on_step_begin`` and ``on_step_end`` (generation, rewards, advantages, forward, loss, backward, optimizer). Runs
alternate native / lossplug ``rounds`` times with fresh trainers; the first ``warmup`` steps of every run are
dropped. The logged losses of the first step must agree (same generations, same loss).
"""

from __future__ import annotations

import statistics
import tempfile
import time

from .common import summarize


def _trainer(kind: str, steps: int, out_dir: str, size: dict, config: dict | None = None):
    from lossplug.testing import tiny

    tiny.offline()
    import trl
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from lossplug.adapters.trl import LossplugGRPOTrainer, trl_equivalent

    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    tok = tiny.tiny_tokenizer()
    model = tiny.tiny_model(tok, hidden_size=size["hidden"], layers=size["layers"])
    args = tiny.tiny_grpo_config(
        out_dir,
        max_steps=steps,
        per_device_train_batch_size=size["batch"],
        num_generations=size["generations"],
        max_completion_length=size["completion"],
        logging_steps=1,
        disable_tqdm=True,
        # on-policy at tiny's former learning rate (its default is num_iterations=2, 3e-3): every step generates
        **{"num_iterations": 1, "learning_rate": 1e-3, **(config or {})},  # config: e.g. use_cpu=False (bench/gpu.py)
    )
    common = dict(
        model=model,
        reward_funcs=[tiny.length_reward],
        args=args,
        train_dataset=tiny.tiny_dataset(size["prompts"]),
        processing_class=tok,
        callbacks=[StepTimer()],
    )
    if kind == "native":
        trainer = trl.GRPOTrainer(**common)
    else:
        recipe, population = trl_equivalent(args)
        trainer = LossplugGRPOTrainer(**common, recipe=recipe, population=population)
    for quiet in (PrinterCallback, ProgressCallback):  # no per-step printing inside the timed steps
        trainer.remove_callback(quiet)
    return trainer, times


def bench_trl_e2e(
    steps: int, rounds: int, warmup: int = 1, size: dict | None = None, config: dict | None = None
) -> dict:
    size = size or {"hidden": 64, "layers": 2, "batch": 8, "generations": 4, "completion": 16, "prompts": 32}
    step_times: dict[str, list[float]] = {"native": [], "lossplug": []}
    losses: dict[str, list[float]] = {}
    loss_type = None
    for r in range(rounds):
        for kind in ("native", "lossplug") if r % 2 == 0 else ("lossplug", "native"):
            with tempfile.TemporaryDirectory() as out:
                trainer, times = _trainer(kind, steps, out, size, config)
                loss_type = trainer.args.loss_type
                trainer.train()
                step_times[kind].extend(times[warmup:])
                losses.setdefault(kind, [e["loss"] for e in trainer.state.log_history if "loss" in e])
    native, ours = summarize(step_times["native"]), summarize(step_times["lossplug"])
    # same seed, same generations: step i of a lossplug run does exactly the work of step i of the native run of
    # its round plus lossplug's, so the per-step ratio cancels the variation between steps (completion lengths)
    paired = sorted(a / b for a, b in zip(step_times["lossplug"], step_times["native"]))
    r = statistics.median(paired)
    first_loss = {kind: (v[0] if v else float("nan")) for kind, v in losses.items()}
    loss_diff = max(
        (abs(a - b) for a, b in zip(losses.get("native", []), losses.get("lossplug", []))), default=float("nan")
    )
    return {
        "item": "trl_e2e",
        "loss_type": loss_type,
        **{f"size_{k}": v for k, v in size.items()},
        "steps_per_run": steps,
        "rounds": rounds,
        "warmup_steps_dropped": warmup,
        "native": native,
        "lossplug": ours,
        "time_ratio": r,
        "time_ratio_min": ours["min_s"] / native["min_s"],
        "time_ratio_unpaired": ours["median_s"] / native["median_s"],
        "paired_ratio_q1_q3": [statistics.quantiles(paired, n=4)[0], statistics.quantiles(paired, n=4)[2]]
        if len(paired) > 1
        else [r, r],
        "logged_loss_max_abs_diff": loss_diff,
        "first_step_loss": first_loss,
        "first_step_loss_abs_diff": abs(first_loss.get("native", 0.0) - first_loss.get("lossplug", 0.0)),
        "goal": "within 5%",
        "met": abs(r - 1) <= 0.05,
        "spread_native_rel": (native["q3_s"] - native["q1_s"]) / native["median_s"],
        "note": "per-step wall time of Trainer.train (generation included) on the tiny Qwen2 of "
        "lossplug.testing.tiny; native GRPOTrainer vs LossplugGRPOTrainer with trl_equivalent(args); "
        "time_ratio: median over steps of lossplug step i / native step i of the same round (identical "
        "generations), time_ratio_unpaired: ratio of the medians",
    }
