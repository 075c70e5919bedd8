"""One demo run: the trainer (TRL's ``GRPOTrainer`` with a lossplug recipe, on the tiny local model), the callback
that writes ``metrics.jsonl``, evaluates held-out ability and drives the display, and :func:`run_demo`, which trains
and writes the run folder.

TRL, transformers and torch are imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

from lossplug.extras import requires_extra
from lossplug.testing import tiny

from .display import LiveDisplay
from .figures import plot_run
from .record import RunResult, default_out_dir, finite_or_none, recipe_label, summarise
from .settings import DEFAULT, DEFAULT_RECIPE, DemoSettings
from .task import SuccessorTask, successor_reward


class _DemoRecorder:
    """What the demo's trainer callback does, written without transformers: writes ``metrics.jsonl``, evaluates
    held-out ability and drives the display at every logging step (:func:`_callback_class` mixes it into a
    ``TrainerCallback``)."""

    def __init__(
        self,
        task: SuccessorTask,
        tok: Any,
        heldout: list[str],
        settings: DemoSettings,
        metrics_path: Path,
        display: LiveDisplay,
    ) -> None:
        self.task, self.tok, self.heldout, self.settings = task, tok, heldout, settings
        self.metrics_path, self.display = metrics_path, display
        self.rows: list[dict[str, Any]] = []
        self.trainer: Any = None
        self.t_start = self.t_last = 0.0
        self.excluded = 0.0  # time spent on held-out evaluation since the last log (not training)
        self.tokens_last = 0.0
        self.rollout_last = (0.0, 0)
        self.last_eval_step = -1

    def _evaluate(self, model: Any, step: int) -> dict[str, float]:
        t = time.perf_counter()
        result = self.task.evaluate(model, self.tok, self.heldout)
        self.excluded += time.perf_counter() - t
        self.last_eval_step = step
        return {"heldout/score": result}

    def _write(self, row: dict[str, Any]) -> None:
        row = {k: finite_or_none(v) for k, v in row.items()}
        self.rows.append(row)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.display.update(row)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        self.metrics_path.write_text("")
        self.display.start()
        row = {"step": 0, "time_s": 0.0, **self._evaluate(model, 0)}
        self.excluded = 0.0
        self.t_start = self.t_last = time.perf_counter()
        self._write(row)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, model: Any = None, **kwargs: Any) -> None:
        logs = dict(logs or {})
        if "train_runtime" in logs:  # the end-of-training summary, not a step
            return
        now = time.perf_counter()
        step = state.global_step
        row: dict[str, Any] = {"step": step, "time_s": now - self.t_start}
        row.update({k: v for k, v in logs.items() if isinstance(v, (int, float))})
        train_time = max(now - self.t_last - self.excluded, 1e-9)
        tokens = float(logs.get("num_tokens", self.tokens_last))
        if tokens > self.tokens_last:
            row["demo/tokens_per_s"] = (tokens - self.tokens_last) / train_time
        self.tokens_last = tokens
        trainer = self.trainer
        if trainer is not None:
            gen_time, gen_tokens = trainer._demo_rollout
            dt, dn = gen_time - self.rollout_last[0], gen_tokens - self.rollout_last[1]
            if dt > 0 and dn > 0:
                row["demo/rollout_tokens_per_s"] = dn / dt
                row["demo/rollout_time_frac"] = min(dt / train_time, 1.0)
            self.rollout_last = (gen_time, gen_tokens)
        self.excluded = 0.0
        if step % self.settings.eval_every == 0 or step >= self.settings.steps:
            row.update(self._evaluate(model, step))
        self.t_last = time.perf_counter()
        self.excluded = 0.0
        self._write(row)

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.last_eval_step != state.global_step:
            self._write(
                {
                    "step": state.global_step,
                    "time_s": time.perf_counter() - self.t_start,
                    **self._evaluate(model, state.global_step),
                }
            )
        self.display.stop()


def _callback_class() -> Any:  # (a TrainerCallback subclass, made when transformers is imported)
    from transformers import TrainerCallback

    class DemoCallback(_DemoRecorder, TrainerCallback):
        """Writes ``metrics.jsonl``, evaluates held-out ability and drives the display at every logging step."""

    return DemoCallback


def _trainer_class() -> Any:  # (a LossplugGRPOTrainer subclass, made when TRL is imported)
    """``LossplugGRPOTrainer`` that also times its rollouts (generation + scoring) for the throughput panel."""
    from lossplug.adapters.trl import LossplugGRPOTrainer

    class DemoGRPOTrainer(LossplugGRPOTrainer):
        _demo_rollout = (0.0, 0)

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            t = time.perf_counter()
            output = super()._generate_and_score_completions(inputs)
            seconds, tokens = self._demo_rollout
            self._demo_rollout = (seconds + time.perf_counter() - t, tokens + int(output["completion_mask"].sum()))
            return output

    return DemoGRPOTrainer


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Offline before transformers is first imported; only errors from transformers' logger; the libraries' own
    warnings (TRL, transformers, accelerate, torch, datasets) do not scroll over the display."""
    tiny.offline()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"(trl|transformers|accelerate|torch|datasets)(\.|$)")
        yield


def build_trainer(
    recipe: Any, settings: DemoSettings, out: Path, display: LiveDisplay
) -> tuple[Any, Any, SuccessorTask]:
    """The trainer (recipe attached, provenance recorded) and its callback; nothing is trained or written yet."""
    from datasets import Dataset
    from transformers import PrinterCallback, ProgressCallback

    task = SuccessorTask(seed=settings.seed)
    tok = tiny.tiny_tokenizer()
    model = tiny.tiny_model(tok, hidden_size=settings.hidden_size, layers=settings.layers, seed=settings.seed)
    model.config._name_or_path = (
        f"tiny-qwen2-h{settings.hidden_size}-l{settings.layers}-seed{settings.seed} (random init, built locally)"
    )
    dataset = Dataset.from_dict({"prompt": task.train_prompts(settings.train_prompts)})
    heldout = task.heldout_prompts(settings.heldout_prompts)
    per_device = settings.prompts_per_generation * settings.num_generations // settings.steps_per_generation
    args = tiny.tiny_grpo_config(
        out,
        max_steps=settings.steps,
        seed=settings.seed,
        data_seed=settings.seed,
        per_device_train_batch_size=per_device,
        num_generations=settings.num_generations,
        steps_per_generation=settings.steps_per_generation,
        gradient_accumulation_steps=1,
        max_completion_length=settings.max_completion_length,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant",
        temperature=settings.temperature,
        beta=0.0,
        logging_steps=settings.logging_steps,
        disable_tqdm=True,
        log_completions=False,
    )
    callback = _callback_class()(task, tok, heldout, settings, out / "metrics.jsonl", display)
    trainer = _trainer_class()(
        model=model,
        reward_funcs=[successor_reward],
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[callback],
        recipe=recipe,
        metrics="full",
    )  # the panels show ratio quantiles and effective rates
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    # the four log-prob sources (trl_provenance records behaviour = old: TRL samples with the training model);
    # beta = 0: no reference policy
    callback.trainer = trainer
    return trainer, callback, task


@requires_extra("demo", "lossplug.demo.run_demo")
def run_demo(
    recipe: Any = DEFAULT_RECIPE,
    settings: DemoSettings = DEFAULT,
    out_dir: str | Path | None = None,
    *,
    quiet: bool = False,
    console: Console | None = None,
    label: str | None = None,
) -> RunResult:
    """Train the tiny model on :class:`SuccessorTask` with ``recipe`` (a preset name, YAML/JSON path, mapping or
    :class:`lossplug.Recipe`) and write the run folder (default ``runs/<timestamp>-<recipe>/``).

    ``quiet``: no live display, one plain line per held-out evaluation. Raises :class:`lossplug.LossplugError` for a
    recipe that does not load or that TRL cannot run (nothing is left on disk then), and
    :class:`lossplug.MissingExtra` before anything is built where TRL or matplotlib is not installed (``pip install
    'lossplug[demo]'``)."""
    with quiet_libraries():
        return _run_demo(recipe, settings, out_dir, quiet=quiet, console=console, label=label)


def _run_demo(
    recipe: Any,
    settings: DemoSettings,
    out_dir: str | Path | None,
    *,
    quiet: bool,
    console: Console | None,
    label: str | None,
) -> RunResult:
    import torch

    import lossplug
    from lossplug import Recipe

    label = label or recipe_label(recipe)
    recipe_obj = Recipe.load(recipe)
    lossplug.compile_recipe(recipe_obj)  # a bad recipe fails before anything is built
    out = Path(out_dir) if out_dir is not None else default_out_dir(label)
    created = not out.exists()

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        gates = [gate.name for gate in recipe_obj.gates]
        display = LiveDisplay(label, settings, quiet, console, gates=gates)
        try:
            trainer, callback, task = build_trainer(recipe_obj, settings, out, display)
        except BaseException:
            if created and out.exists():  # a refused recipe leaves no half-made run folder behind
                import shutil

                shutil.rmtree(out, ignore_errors=True)
            raise
        out.mkdir(parents=True, exist_ok=True)
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            trainer.train()
        finally:
            display.stop()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        torch.set_num_threads(previous_threads)

    rows = callback.rows
    summary = summarise(label, recipe_obj, settings, task, rows, wall, cpu, settings.threads)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_run(
        rows,
        out / "curves.png",
        title=f"lossplug demo · recipe {label} · task {task.name} · seed {settings.seed}",
        gates=summary["gates"],
    )
    return RunResult(out_dir=out, summary=summary, rows=rows)
