"""``lossplug demo``: train a tiny model from scratch with TRL's ``GRPOTrainer`` and a lossplug recipe, on CPU, with
no hub access — and show that it learns.

The task (:class:`SuccessorTask`) is verifiable and small enough for a randomly initialised 2-layer model to learn
in seconds of CPU: a prompt is one to three filler letters followed by a digit ``d`` (``"c k 7"``); the reward is 1
when the first word of the completion is ``(d + 1) mod 10`` and 0 otherwise. An untrained model spreads its mass
over the 54-word vocabulary, so the reward starts near 0.02–0.03; with the default settings it passes 0.8 within
about 100 steps.

Held-out ability is measured apart from the learning signal (seed invariant 9): greedy decoding on prompts whose
filler letters (``n``–``z``) never occur in training (``a``–``m``), scored with the same reward, before training,
every ``eval_every`` steps and at the end.

Settings (:data:`DEFAULT`; :data:`FAST` is the same for 60 steps): 16 prompts × 16 completions of at most 3 tokens
per rollout batch, two optimizer steps per batch (the second is off-policy, so update ratios and clip fractions are
not trivially 1 and 0), Adam at a constant 3e-3, a 2-layer hidden-64 Qwen2, 200 steps, one torch thread (for a model
this small one thread was about 5× faster than two on a 2-core machine: torch's worker threads spin).

A run folder holds::

    recipe.yaml       the resolved recipe, defaults filled          (written by lossplug.adapters.trl)
    provenance.json   behaviour / old / current / reference log-prob sources (seed invariant 8)
    versions.json     python, torch, trl, transformers, lossplug … and the TRL settings the recipe replaced
    metrics.jsonl     one line per logging step: TRL's metrics, lossplug/… metrics, demo/… throughput, heldout/…
    summary.json      reward and held-out score before/after, wall and CPU time, settings, task
    curves.png        learning signal, gate activity, throughput and held-out score on separate panels

:func:`run_demo` trains one recipe, :func:`run_compare` several on the same seeds (one folder each, plus
``compare.png``). This module imports TRL (lazily, inside the functions), so it lives in ``lossplug.adapters``;
``import lossplug`` never imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from . import _tiny

__all__ = ["DemoSettings", "DEFAULT", "FAST", "SuccessorTask", "RunResult", "run_demo", "run_compare",
           "plot_run", "plot_compare", "default_out_dir", "successor_reward"]

DEFAULT_RECIPE = "dapo"
#: a run "learned" when its reward (mean of the last logs minus mean of the first) rose by more than this and its
#: held-out score improved
LEARNED_MARGIN = 0.2


# ---------------------------------------------------------------------------------------------------------------------
# settings


@dataclass(frozen=True)
class DemoSettings:
    """Everything that decides a demo run (recorded in ``summary.json``)."""

    steps: int = 200                  # optimizer steps
    seed: int = 0                     # model init, prompt order, sampling
    prompts_per_generation: int = 16  # prompts per rollout batch
    num_generations: int = 16         # completions per prompt (the group)
    steps_per_generation: int = 2     # optimizer steps per rollout batch: the 2nd is off-policy (ratios ≠ 1)
    max_completion_length: int = 3
    learning_rate: float = 3e-3
    hidden_size: int = 64
    layers: int = 2
    temperature: float = 1.0
    eval_every: int = 10              # held-out evaluation every … optimizer steps
    heldout_prompts: int = 100
    train_prompts: int = 2000
    threads: int = 1                  # torch intra-op threads: 1 is fastest for this model size

    def __post_init__(self):
        if (self.prompts_per_generation * self.num_generations) % self.steps_per_generation:
            raise ValueError("prompts_per_generation × num_generations must be divisible by steps_per_generation")

    @property
    def logging_steps(self) -> int:
        return self.steps_per_generation  # every log holds exactly one rollout batch (so always a reward)

    def replace(self, **changes: Any) -> "DemoSettings":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


DEFAULT = DemoSettings()
#: the test settings (``--fast``): a few dozen steps, well under a minute
FAST = DemoSettings(steps=60, eval_every=20, heldout_prompts=50)


# ---------------------------------------------------------------------------------------------------------------------
# the task


TRAIN_FILLERS = tuple(chr(c) for c in range(ord("a"), ord("n")))   # a … m
HELDOUT_FILLERS = tuple(chr(c) for c in range(ord("n"), ord("z") + 1))  # n … z


def score(prompt: str, completion: str) -> float:
    """The reward of one completion: 1 if its first word is the successor of the prompt's last digit, else 0."""
    digit = int(prompt.split()[-1])
    words = str(completion).split()
    return 1.0 if words and words[0] == str((digit + 1) % 10) else 0.0


def successor_reward(prompts, completions, **kwargs) -> list[float]:
    """TRL reward function: :func:`score` for every (prompt, completion)."""
    return [score(p if isinstance(p, str) else p[-1]["content"], c if isinstance(c, str) else c[-1]["content"])
            for p, c in zip(prompts, completions)]


class SuccessorTask:
    """Prompts ``"<1–3 filler letters> <digit d>"``; answer ``(d + 1) mod 10`` as the first completion word."""

    name = "successor"
    description = ("prompt: 1-3 filler letters then a digit d; reward 1 if the first word of the completion is "
                   "(d+1) mod 10, else 0. Held-out: greedy decoding on prompts whose filler letters (n-z) never "
                   "occur in training (a-m), fraction answered correctly")

    def __init__(self, seed: int = 0):
        self.seed = seed

    @staticmethod
    def _prompt(rng: random.Random, fillers: Sequence[str], digit: int) -> str:
        return " ".join([rng.choice(fillers) for _ in range(rng.randint(1, 3))] + [str(digit)])

    def train_prompts(self, n: int) -> list[str]:
        rng = random.Random(self.seed)
        return [self._prompt(rng, TRAIN_FILLERS, rng.randrange(10)) for _ in range(n)]

    def heldout_prompts(self, n: int) -> list[str]:
        rng = random.Random(10_000 + self.seed)  # balanced over digits
        return [self._prompt(rng, HELDOUT_FILLERS, i % 10) for i in range(n)]

    reward = staticmethod(successor_reward)

    @staticmethod
    def evaluate(model, tok, prompts: Sequence[str], max_new_tokens: int = 1) -> float:
        """Greedy decoding on ``prompts``: the mean reward, i.e. the fraction answered correctly."""
        import torch

        was_training = model.training
        model.eval()
        try:
            enc = tok(list(prompts), return_tensors="pt", padding=True)
            enc = {k: v.to(model.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
            with torch.no_grad():
                out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        finally:
            model.train(was_training)
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        return sum(score(p, t) for p, t in zip(prompts, texts)) / len(prompts)


# ---------------------------------------------------------------------------------------------------------------------
# run record helpers


def default_out_dir(label: str, root: Union[str, Path] = "runs") -> Path:
    """``runs/<timestamp>-<label>/`` (the label made file-name safe)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-") or "run"
    return Path(root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{safe}"


def recipe_label(recipe) -> str:
    """A short name for a recipe argument: the preset name, the file stem, or the recipe's own name."""
    from lossplug import Recipe

    if isinstance(recipe, (str, Path)) and str(recipe).endswith((".yaml", ".yml", ".json")):
        return Path(recipe).stem
    if isinstance(recipe, str) and "\n" not in recipe and ":" not in recipe:
        return recipe
    return Recipe.load(recipe).name or "recipe"


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _gate_keys(row: dict[str, Any]) -> list[str]:
    """The gate's clip-fraction metrics in a log row: ``lossplug/<gate>/clip_frac_high|low`` (or ``clip_frac`` for a
    gate that reports no sides)."""
    keys = [k for k in row if k.startswith("lossplug/") and re.search(r"/clip_frac(_low|_high)?$", k)]
    sided = {k.rsplit("_", 1)[0] for k in keys if k.endswith(("_low", "_high"))}
    return sorted((k for k in keys if k not in sided), key=lambda k: (k.rsplit("/", 1)[0], not k.endswith("high")))


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


@dataclass
class RunResult:
    """What :func:`run_demo` returns: the folder, the summary (also in ``summary.json``) and the metric rows."""

    out_dir: Path
    summary: dict[str, Any]
    rows: list[dict[str, Any]]

    @property
    def learned(self) -> bool:
        return bool(self.summary["learned"])


# ---------------------------------------------------------------------------------------------------------------------
# live display


_SPARK = "▁▂▃▄▅▆▇█"


def _sparkline(values: Sequence[float], width: int = 40, lo: float = 0.0, hi: float = 1.0) -> str:
    """The whole history in at most ``width`` characters (bucket means when longer)."""
    values = [v for v in values if v is not None]
    if len(values) > width:
        edges = [round(i * len(values) / width) for i in range(width + 1)]
        values = [_mean(values[a:b]) for a, b in zip(edges, edges[1:])]
    out = []
    for v in values:
        x = (min(max(v, lo), hi) - lo) / (hi - lo) if hi > lo else 0.0
        out.append(_SPARK[min(int(x * len(_SPARK)), len(_SPARK) - 1)])
    return "".join(out)


class _Display:
    """A rich Live panel on a terminal; elsewhere (CI logs, pipes) or with ``quiet``, one plain line per held-out
    evaluation — and, unless ``quiet``, the final panel once at the end."""

    def __init__(self, label: str, settings: DemoSettings, quiet: bool, console=None):
        from rich.console import Console

        self.label, self.settings, self.quiet = label, settings, quiet
        self.console = console or Console(highlight=False)
        self.animate = not quiet and self.console.is_terminal
        self.live = None
        self.stopped = False
        self.t0 = time.perf_counter()
        self.rows: list[dict[str, Any]] = []
        self.heldout: list[tuple[int, float]] = []

    def start(self) -> None:
        self.t0 = time.perf_counter()
        if self.animate:
            from rich.live import Live

            self.live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
            self.live.start()

    def update(self, row: dict[str, Any]) -> None:
        if "reward" in row:
            self.rows.append(row)
        if "heldout/score" in row:
            self.heldout.append((row["step"], row["heldout/score"]))
            if not self.animate:
                self._plain(row)
        if self.live is not None:
            self.live.update(self._render())

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        if self.live is not None:
            self.live.update(self._render())
            self.live.stop()
            self.live = None
        elif not self.quiet:
            self.console.print(self._render())

    def _plain(self, row: dict[str, Any]) -> None:
        last = self.rows[-1] if self.rows else {}
        reward = last.get("reward")
        tps = last.get("demo/tokens_per_s")
        self.console.print(
            f"[{self.label}] step {row['step']:>4}/{self.settings.steps}  "
            f"reward {'—' if reward is None else f'{reward:.3f}'}  "
            f"held-out {row['heldout/score']:.3f}  "
            f"{'' if tps is None else f'{tps:,.0f} tok/s  '}{time.perf_counter() - self.t0:.0f}s",
            markup=False, soft_wrap=True)

    def _render(self):
        from rich.console import Group
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        s = self.settings
        last = self.rows[-1] if self.rows else {}
        step = last.get("step", 0)
        elapsed = time.perf_counter() - self.t0
        head = Table.grid(expand=True)
        head.add_column(ratio=1)
        head.add_column(justify="right")
        head.add_row(Text(f"lossplug demo · recipe {self.label} · task successor · seed {s.seed}", style="bold"),
                     Text(f"step {step}/{s.steps} · {elapsed:.0f}s", style="cyan"))
        bar = Table.grid(expand=True)  # a ProgressBar on its own in a Group ends no line: the next row is lost
        bar.add_column(ratio=1)
        bar.add_row(ProgressBar(total=s.steps, completed=step, width=None))

        def fmt(key, spec=".3f"):
            v = last.get(key)
            return "—" if v is None else format(v, spec)

        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column(justify="right")
        table.add_column()
        rewards = [r.get("reward") for r in self.rows]
        first = _mean(rewards[:3]) if rewards else None
        table.add_row("reward", fmt("reward"),
                      Text(_sparkline(rewards, width=20), style="green")
                      + Text("" if first is None else f"  from {first:.2f}", style="dim"))
        if self.heldout:
            h0, hn = self.heldout[0], self.heldout[-1]
            table.add_row("held-out", f"{hn[1]:.3f}",
                          Text(_sparkline([h[1] for h in self.heldout], width=20), style="magenta")
                          + Text(f"  from {h0[1]:.2f}", style="dim"))
        clip = _gate_keys(last)
        if clip:
            gate = clip[0].split("/")[1]
            table.add_row("clip fraction", " ".join(fmt(k) for k in clip),
                          Text(f"{gate}: " + " · ".join(k.rsplit("_", 1)[-1] for k in clip), style="dim"))
        if "lossplug/effective/token_frac" in last:
            table.add_row("effective rate", f"{fmt('lossplug/effective/token_frac')} "
                                                   f"{fmt('lossplug/effective/seq_frac')}",
                          Text("token · sequence", style="dim"))
        if "lossplug/ratio/update/p50" in last:
            table.add_row("update ratio", " ".join(fmt(f"lossplug/ratio/update/{q}")
                                                              for q in ("p05", "p50", "p95")),
                          Text(f"p05 · p50 · p95, max {fmt('lossplug/ratio/update/max')}", style="dim"))
        if "demo/tokens_per_s" in last:
            table.add_row("tokens/s", f"{last['demo/tokens_per_s']:,.0f}",
                          Text(f"rollout {fmt('demo/rollout_tokens_per_s', ',.0f')} generated/s", style="dim"))
        if "entropy" in last:
            table.add_row("entropy", fmt("entropy"), Text(f"mean length {fmt('completions/mean_length', '.2f')}",
                                                          style="dim"))
        return Panel(Group(head, bar, table), border_style="blue", width=min(self.console.width, 88))


# ---------------------------------------------------------------------------------------------------------------------
# the callback


def _callback_class():
    from transformers import TrainerCallback

    class DemoCallback(TrainerCallback):
        """Writes ``metrics.jsonl``, evaluates held-out ability and drives the display at every logging step."""

        def __init__(self, task: SuccessorTask, tok, heldout: list[str], settings: DemoSettings, metrics_path: Path,
                     display: _Display):
            self.task, self.tok, self.heldout, self.settings = task, tok, heldout, settings
            self.metrics_path, self.display = metrics_path, display
            self.rows: list[dict[str, Any]] = []
            self.trainer = None
            self.t_start = self.t_last = 0.0
            self.excluded = 0.0  # time spent on held-out evaluation since the last log (not training)
            self.tokens_last = 0.0
            self.rollout_last = (0.0, 0)
            self.last_eval_step = -1

        def _evaluate(self, model, step: int) -> dict[str, float]:
            t = time.perf_counter()
            result = self.task.evaluate(model, self.tok, self.heldout)
            self.excluded += time.perf_counter() - t
            self.last_eval_step = step
            return {"heldout/score": result}

        def _write(self, row: dict[str, Any]) -> None:
            row = {k: _finite(v) for k, v in row.items()}
            self.rows.append(row)
            with self.metrics_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            self.display.update(row)

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            self.metrics_path.write_text("")
            self.display.start()
            row = {"step": 0, "time_s": 0.0, **self._evaluate(model, 0)}
            self.excluded = 0.0
            self.t_start = self.t_last = time.perf_counter()
            self._write(row)

        def on_log(self, args, state, control, logs=None, model=None, **kwargs):
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

        def on_train_end(self, args, state, control, model=None, **kwargs):
            if self.last_eval_step != state.global_step:
                self._write({"step": state.global_step, "time_s": time.perf_counter() - self.t_start,
                             **self._evaluate(model, state.global_step)})
            self.display.stop()

    return DemoCallback


def _trainer_class():
    """``LossplugGRPOTrainer`` that also times its rollouts (generation + scoring) for the throughput panel."""
    from lossplug.adapters.trl import LossplugGRPOTrainer

    class DemoGRPOTrainer(LossplugGRPOTrainer):
        _demo_rollout = (0.0, 0)

        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            output = super()._generate_and_score_completions(inputs)
            seconds, tokens = self._demo_rollout
            self._demo_rollout = (seconds + time.perf_counter() - t, tokens + int(output["completion_mask"].sum()))
            return output

    return DemoGRPOTrainer


# ---------------------------------------------------------------------------------------------------------------------
# one run


@contextlib.contextmanager
def _quiet_libraries():
    """Offline before transformers is first imported; only errors from transformers' logger; the libraries' own
    warnings (TRL, transformers, accelerate, torch, datasets) do not scroll over the display."""
    _tiny.offline()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"(trl|transformers|accelerate|torch|datasets)(\.|$)")
        yield


def _build(recipe, label: str, settings: DemoSettings, out: Path, display: "_Display"):
    """The trainer (recipe attached, provenance recorded) and its callback; nothing is trained or written yet."""
    from datasets import Dataset
    from transformers import PrinterCallback, ProgressCallback

    task = SuccessorTask(seed=settings.seed)
    tok = _tiny.tiny_tokenizer()
    model = _tiny.tiny_model(tok, hidden_size=settings.hidden_size, layers=settings.layers, seed=settings.seed)
    model.config._name_or_path = (f"tiny-qwen2-h{settings.hidden_size}-l{settings.layers}-seed{settings.seed} "
                                  "(random init, built locally)")
    dataset = Dataset.from_dict({"prompt": task.train_prompts(settings.train_prompts)})
    heldout = task.heldout_prompts(settings.heldout_prompts)
    per_device = settings.prompts_per_generation * settings.num_generations // settings.steps_per_generation
    args = _tiny.tiny_grpo_config(
        out, max_steps=settings.steps, seed=settings.seed, data_seed=settings.seed,
        per_device_train_batch_size=per_device, num_generations=settings.num_generations,
        steps_per_generation=settings.steps_per_generation, gradient_accumulation_steps=1,
        max_completion_length=settings.max_completion_length, learning_rate=settings.learning_rate,
        lr_scheduler_type="constant", temperature=settings.temperature, beta=0.0,
        logging_steps=settings.logging_steps, disable_tqdm=True, log_completions=False)
    callback = _callback_class()(task, tok, heldout, settings, out / "metrics.jsonl", display)
    trainer = _trainer_class()(model=model, reward_funcs=[successor_reward], args=args, train_dataset=dataset,
                               processing_class=tok, callbacks=[callback], recipe=recipe,
                               metrics="full")  # the panels show ratio quantiles and effective rates
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    # the four log-prob sources (trl_provenance records behaviour = old: TRL samples with the training model);
    # beta = 0: no reference policy
    callback.trainer = trainer
    return trainer, callback, task


def _preflight(recipes: Sequence[tuple[str, Any]], settings: DemoSettings) -> None:
    """Build (not train) a trainer for every recipe, so that one TRL refuses fails before any run starts."""
    import tempfile

    from rich.console import Console

    from lossplug import LossplugError

    with tempfile.TemporaryDirectory(prefix="lossplug-demo-") as tmp, open(os.devnull, "w") as null:
        for label, recipe in recipes:
            display = _Display(label, settings, True, Console(file=null))
            try:
                _build(recipe, label, settings.replace(heldout_prompts=10, train_prompts=16), Path(tmp) / label,
                       display)
            except LossplugError as err:
                raise LossplugError(f"recipe {label!r}: {err}") from None


def run_demo(recipe: Any = DEFAULT_RECIPE, settings: DemoSettings = DEFAULT, out_dir: Optional[Union[str, Path]] = None,
             *, quiet: bool = False, console=None, label: Optional[str] = None) -> RunResult:
    """Train the tiny model on :class:`SuccessorTask` with ``recipe`` (a preset name, YAML/JSON path, mapping or
    :class:`lossplug.Recipe`) and write the run folder (default ``runs/<timestamp>-<recipe>/``).

    ``quiet``: no live display, one plain line per held-out evaluation. Raises :class:`lossplug.LossplugError` for a
    recipe that does not load or that TRL cannot run (nothing is left on disk then)."""
    with _quiet_libraries():
        return _run_demo(recipe, settings, out_dir, quiet=quiet, console=console, label=label)


def _run_demo(recipe, settings: DemoSettings, out_dir, *, quiet: bool, console, label: Optional[str]) -> RunResult:
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
        display = _Display(label, settings, quiet, console)
        try:
            trainer, callback, task = _build(recipe_obj, label, settings, out, display)
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
    summary = _summarise(label, recipe_obj, settings, task, rows, wall, cpu, settings.threads)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_run(rows, out / "curves.png", title=f"lossplug demo · recipe {label} · task {task.name} · "
                                            f"seed {settings.seed}")
    return RunResult(out_dir=out, summary=summary, rows=rows)


def _summarise(label: str, recipe, settings: DemoSettings, task: SuccessorTask, rows: list[dict[str, Any]],
               wall: float, cpu: float, threads: int) -> dict[str, Any]:
    rewards = [r["reward"] for r in rows if r.get("reward") is not None]
    k = max(1, min(3, len(rewards) // 5))
    heldout = [r for r in rows if r.get("heldout/score") is not None]
    tps = [r["demo/tokens_per_s"] for r in rows if r.get("demo/tokens_per_s") is not None]
    start, end = (_mean(rewards[:k]), _mean(rewards[-k:])) if rewards else (None, None)
    before, after = heldout[0], heldout[-1]
    learned = bool(rewards and end - start > LEARNED_MARGIN and after["heldout/score"] > before["heldout/score"])
    return {
        "recipe": label, "recipe_name": recipe.name, "task": task.name, "task_description": task.description,
        "learned": learned,
        "reward": {"start": start, "end": end, "first": rewards[0] if rewards else None,
                   "last": rewards[-1] if rewards else None, "max": max(rewards) if rewards else None,
                   "averaged_over_logs": k},
        "heldout": {"before": before["heldout/score"], "after": after["heldout/score"],
                    "prompts": settings.heldout_prompts, "what": "greedy decoding, fraction answered correctly"},
        "provenance": "behaviour = old (TRL samples with the training model via transformers generate); no "
                      "reference policy (beta = 0, no KL term): see provenance.json",
        "steps": settings.steps, "wall_s": wall, "cpu_s": cpu, "torch_threads": threads,
        "tokens_per_s_mean": _mean(tps) if tps else None,
        "settings": dataclasses.asdict(settings),
        "files": ["recipe.yaml", "provenance.json", "versions.json", "metrics.jsonl", "summary.json", "curves.png"],
    }


# ---------------------------------------------------------------------------------------------------------------------
# several recipes


def run_compare(recipes: Sequence[Any], settings: DemoSettings = DEFAULT, out_dir: Optional[Union[str, Path]] = None,
                *, quiet: bool = False, console=None,
                on_result: Optional[Callable[[RunResult], None]] = None) -> tuple[Path, dict[str, RunResult]]:
    """Train each recipe on the same seeds (same initial model, prompts and sampling seed); one folder per recipe
    under ``out_dir`` and ``compare.png`` with their curves side by side. Returns ``(compare.png, results)``."""
    from lossplug import Recipe, compile_recipe

    labels = [recipe_label(r) for r in recipes]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--compare: recipes must have different names, got {labels}")
    for r in recipes:  # every recipe is checked (and a trainer built) before the first one trains
        compile_recipe(Recipe.load(r))
    with _quiet_libraries():
        _preflight(list(zip(labels, recipes)), settings)
    out = Path(out_dir) if out_dir is not None else default_out_dir("compare-" + "-".join(labels))
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, RunResult] = {}
    for label, recipe in zip(labels, recipes):
        results[label] = run_demo(recipe, settings, out / label, quiet=quiet, console=console, label=label)
        if on_result is not None:
            on_result(results[label])
    path = plot_compare({k: v.rows for k, v in results.items()}, out / "compare.png",
                        title=f"lossplug demo · task successor · seed {settings.seed} · {settings.steps} steps")
    (out / "compare.json").write_text(json.dumps({k: v.summary for k, v in results.items()}, indent=2) + "\n")
    return path, results


# ---------------------------------------------------------------------------------------------------------------------
# plots


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if v is not None:
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def _smooth(ys: list[float], window: int = 5) -> list[float]:
    out = []
    for i in range(len(ys)):
        part = ys[max(0, i - window + 1):i + 1]
        out.append(sum(part) / len(part))
    return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(rows: list[dict[str, Any]], path: Union[str, Path], title: str = "lossplug demo") -> Path:
    """``curves.png``: learning signal, gate activity, throughput and held-out score, each on its own panel."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    (ax_r, ax_g), (ax_t, ax_h) = axes

    xs, ys = _series(rows, "reward")
    ax_r.plot(xs, ys, color="tab:green", alpha=0.35, lw=1, label="reward (per rollout batch)")
    ax_r.plot(xs, _smooth(ys), color="tab:green", lw=2.2, label="reward (running mean of 5)")
    sx, sy = _series(rows, "frac_reward_zero_std")
    if sy:
        ax_r.plot(sx, [1.0 - y for y in sy], color="0.45", lw=1, ls=":",
                  label="groups with a learning signal (reward std > 0)")
    ax_r.set_title("Learning signal: training reward (sampled, temperature 1)")
    ax_r.set_ylim(-0.02, 1.02)
    ax_r.set_ylabel("reward")

    keys = sorted({k for r in rows for k in _gate_keys(r)})
    styles = {"low": ("tab:blue", "-"), "high": ("tab:red", "-")}
    for k in keys:
        side = k.rsplit("_", 1)[-1]
        color, ls = styles.get(side, ("tab:purple", "-"))
        gx, gy = _series(rows, k)
        ax_g.plot(gx, gy, color=color, ls=ls, lw=1.6, label=k.removeprefix("lossplug/"))
    for k in sorted({k for r in rows for k in r if k.startswith("lossplug/") and k.endswith("/gate_mean")}):
        gx, gy = _series(rows, k)  # smooth gates (SAPO): the mean gate weight instead of a clip fraction
        ax_g.plot(gx, gy, color="tab:purple", lw=1.6, label=k.removeprefix("lossplug/") + " (mean gate weight)")
    for key, color, label in (("lossplug/effective/token_frac", "black", "effective sample rate (tokens)"),
                              ("lossplug/effective/seq_frac", "tab:orange", "effective sample rate (sequences)")):
        gx, gy = _series(rows, key)
        if gy:
            ax_g.plot(gx, gy, color=color, lw=1.2, ls="--", label=label)
    ax_g.set_title("Gate activity: clip fractions and effective sample rates")
    ax_g.set_ylim(-0.02, 1.05)
    ax_g.set_ylabel("fraction")

    tx, ty = _series(rows, "demo/tokens_per_s")
    ax_t.plot(tx, ty, color="tab:blue", lw=1.5, label="training loop (prompt + completion tokens / s)")
    rx, ry = _series(rows, "demo/rollout_tokens_per_s")
    if ry:
        ax_t.plot(rx, ry, color="tab:cyan", lw=1.2, ls="--", label="rollout (completion tokens / s of generation)")
    ax_t.set_title("Sampling throughput")
    ax_t.set_ylabel("tokens / s")
    ax_t.set_ylim(bottom=0)

    hx, hy = _series(rows, "heldout/score")
    ax_h.plot(hx, hy, color="tab:purple", marker="o", lw=2, label="greedy answers correct")
    ax_h.set_title("Held-out ability: prompts with unseen filler letters")
    ax_h.set_ylim(-0.02, 1.02)
    ax_h.set_ylabel("score")

    return _save(plt, fig, axes.flat, title, path, legend_size=8, top=0.96)


def plot_compare(runs: dict[str, list[dict[str, Any]]], path: Union[str, Path],
                 title: str = "lossplug demo · recipes compared") -> Path:
    """``compare.png``: one line per recipe on each panel — reward, held-out score, clip fraction, throughput."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.8))
    ax_r, ax_h, ax_g, ax_t = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, rows) in enumerate(runs.items()):
        color = colors[i % len(colors)]
        xs, ys = _series(rows, "reward")
        ax_r.plot(xs, ys, color=color, alpha=0.25, lw=1)
        ax_r.plot(xs, _smooth(ys), color=color, lw=2, label=label)
        hx, hy = _series(rows, "heldout/score")
        ax_h.plot(hx, hy, color=color, marker="o", ms=3, lw=1.6, label=label)
        for k in sorted({k for r in rows for k in _gate_keys(r)}):
            gx, gy = _series(rows, k)
            ls = "--" if k.endswith("low") else "-"
            ax_g.plot(gx, _smooth(gy, 3), color=color, ls=ls, lw=1.4, label=f"{label}: {k.split('/', 2)[-1]}")
        tx, ty = _series(rows, "demo/tokens_per_s")
        ax_t.plot(tx, ty, color=color, lw=1.3, label=label)
    ax_r.set_title("Learning signal: training reward (running mean)")
    ax_h.set_title("Held-out score (greedy, unseen fillers)")
    ax_g.set_title("Clip fractions (solid high / dashed low)")
    ax_t.set_title("Throughput (tokens / s)")
    for ax in (ax_r, ax_h):
        ax.set_ylim(-0.02, 1.02)
    ax_g.set_ylim(bottom=-0.01)
    ax_t.set_ylim(bottom=0)
    return _save(plt, fig, axes, title, path, legend_size=7, top=0.93)


def _save(plt, fig, axes, title: str, path: Union[str, Path], *, legend_size: int, top: float) -> Path:
    """The finish every demo figure shares: step axes, grids, legends where there is something to label, title."""
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=legend_size, loc="best")
    fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, top))
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
