"""The GPU check: ``python -m bench --gpu`` — one prepared command for the day a CUDA machine is lent.

    python -m bench --gpu                      # everything below; under 5 minutes on one H200 (planned, not yet run)
    python -m bench --gpu --quick              # small sizes (the CPU fallback CI runs: tests/bench/test_gpu.py)
    python -m bench --gpu --parts a --out /tmp/sweep.json

It measures three things and prints **one** table (Markdown, ready for docs/performance.md), then writes every
number to ``bench/results-gpu.json`` (``--out``; without CUDA the default is ``bench/results-gpu-fallback.json``,
so a CPU run never overwrites a GPU result):

* **(a) no host synchronisation, every built-in combination.** Every built-in gate (read from the registry) ×
  every built-in reduction × every metric level (``off``/``basic``/``full``), each on five batches (sequence and
  token advantages, with and without a two-micro-batch step :class:`~lossplug.Normalizer`, and bf16 log-probs as
  trainers on GPUs hand them; ``--quick``: two of them), forward and backward
  under ``torch.cuda.set_sync_debug_mode("error")``: any ``.item()``, ``bool(tensor)``, device-to-host copy or
  data-dependent shape raises. A correction gate runs after ``ppo_clip``. Extra rows: the gate parameter sets that
  take other code paths, and every built-in regularizer. Each combination is first validated (``validate="full"``,
  outside the guard, where one sync is allowed): what lossplug refuses by design there (a field the batch lacks, a
  refused pairing) is reported as *refused*, not as a failure. After the guarded step the loss and the gradient on
  the actions must be finite. The table has one row per gate; the failures are listed under it with the variant,
  the error and the innermost lossplug source line. This is the GPU counterpart of tests/core/test_no_host_sync.py
  (the meta device), which proves the same without data. The sweep lives in ``bench/gpu_sweep.py``.
* **(b) the loss items against verl's and TRL's own code** (``bench/loss_bench.py``'s cases, its recipes and
  replicated TRL losses): forward + backward on the GPU at the CPU bench's size (B=64, T=4096) and at B=512,
  T=8192; time from ``torch.cuda.Event`` pairs around each call (queue drained before, interleaved candidates in a
  random order, warm-ups dropped), peak memory from ``torch.cuda.max_memory_allocated`` above what was allocated
  before the call; lossplug at ``basic`` (the adapters' default), ``off`` and ``full`` metrics, and the contract
  check (``PolicyBatch(...)``) as a fraction of the step. Loss and gradient agreement is checked before timing.
* **(c) a TRL training step**: ``GRPOTrainer`` against ``LossplugGRPOTrainer`` with ``trl_equivalent`` (the tiny
  Qwen2 of :mod:`lossplug.testing.tiny`, wider and with longer completions than on the CPU), per-step wall time,
  paired by step (``bench/trl_bench.py``).

Without CUDA it says so: (a) runs on the CPU as a smoke run over every combination (no sync-debug mode exists
there, so it proves only that every combination runs, refuses cleanly or fails loudly), and (b) and (c) are skipped
— their CPU measurements are ``python -m bench``. ``--device cpu`` runs every part there anyway (toy numbers). A
side whose packages do not import (verl, trl) is skipped with the import error rather than failing the run.

On a device machine lent to a session, in one prepared call (``bench/gpu_device.sh`` says what it installs and why)::

    bash bench/gpu_device.sh prepare     # here, once: the wheels the machine lacks into the git-ignored .whl/
    # then the device tool's run: command "bash bench/gpu_device.sh run", carry [".whl"], timeout_s 420;
    # the table is in its output, the JSON in $OUT/results-gpu.json

Status: written and tested without a GPU (tests/bench/test_gpu.py runs the CPU fallback and the CUDA pieces with
stand-ins); not yet run on one.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import lossplug

from .gpu_sweep import STATUSES, VARIANTS, failures, status_counts, sweep

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results-gpu.json"
FALLBACK_OUT = HERE / "results-gpu-fallback.json"
PARTS = ("a", "b", "c")
NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"


# ---------------------------------------------------------------------------------------------------------------------
# (b) the loss items on the device


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(
    candidates: dict[str, Callable[[], object]],
    device: torch.device,
    repeats: int,
    warmup: int,
    setup: Callable[[], None],
) -> dict[str, dict]:
    """Seconds per call of each candidate, interleaved in a fresh random order every round (seeded), ``setup``
    untimed before each call. On CUDA: a ``torch.cuda.Event`` pair around the call with the queue drained before
    it (``wall_median_s``: the host's time from the first event to the end of the work, syncs included);
    elsewhere ``time.perf_counter``."""
    from .common import summarize

    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            setup()
            candidates[name]()
    _synchronize(device)
    times: dict[str, list[float]] = {n: [] for n in names}
    walls: dict[str, list[float]] = {n: [] for n in names}
    order = random.Random(0)
    for _ in range(repeats):
        for name in order.sample(names, len(names)):
            setup()
            _synchronize(device)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                candidates[name]()
                end.record()
                end.synchronize()
                walls[name].append(time.perf_counter() - t0)
                times[name].append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                candidates[name]()
                times[name].append(time.perf_counter() - t0)
    out = {n: summarize(ts) for n, ts in times.items()}
    for n, ws in walls.items():
        if ws:
            out[n]["wall_median_s"] = statistics.median(ws)
    return out


def peak_bytes_above(fn: Callable[[], object], device: torch.device, setup: Callable[[], None]) -> int:
    """The most ``fn`` held at once above what was allocated before it (CUDA: ``max_memory_allocated``; CPU: the
    CPU bench's profiler measurement)."""
    setup()
    if device.type != "cuda":
        from .common import peak_bytes

        return peak_bytes(fn)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    del out
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _loss_candidates(case, t: dict, leaf: dict) -> dict[str, Callable[[], object]]:
    from .loss_bench import case_inputs

    recipe, normalizer, fields = case_inputs(case, t)

    def lossplug_step(level: str) -> Callable[[], object]:
        def run():
            batch = lossplug.PolicyBatch.unchecked(logp=leaf["logp"], **fields)
            loss = lossplug.policy_loss(batch, recipe, normalizer, validate="off", metrics=level).loss
            loss.backward()
            return loss

        return run

    def native():
        loss = case.native(t, leaf["logp"])
        loss.backward()
        return loss

    def validate():  # the contract check in the hot loop (constant fields remembered), as bench item 4
        return lossplug.PolicyBatch(logp=leaf["logp"], **fields)

    return {
        "native": native,
        "lossplug": lossplug_step("basic"),
        "lossplug_no_metrics": lossplug_step("off"),
        "lossplug_full_metrics": lossplug_step("full"),
        "validate": validate,
    }


def bench_loss_case(case, t: dict, device: torch.device, repeats: int, warmup: int) -> dict:
    """One of bench/loss_bench.py's cases on ``device``: agreement, then time and peak memory of each side."""
    leaf: dict[str, torch.Tensor] = {}

    def fresh():
        leaf["logp"] = t["logp"].detach().clone().requires_grad_(True)

    runs = _loss_candidates(case, t, leaf)
    agree = {}
    for name in ("native", "lossplug"):
        fresh()
        agree[name] = (runs[name]().detach(), leaf["logp"].grad)
    (l0, g0), (l1, g1) = agree["native"], agree["lossplug"]
    times = time_calls(runs, device, repeats, warmup, fresh)
    peaks = {name: peak_bytes_above(run, device, fresh) for name, run in runs.items() if name != "validate"}
    native = times["native"]["median_s"]
    out = {
        "item": "loss_step",
        "case": case.name,
        "baseline": case.trainer,
        "device": str(device),
        "B": t["mask"].shape[0],
        "T": t["mask"].shape[1],
        "recipe": case.recipe,
        "loss_abs_diff": float((l0 - l1).abs()),
        "grad_max_abs_diff": float((g0 - g1).abs().max()),
        **{name: {**times[name], "peak_bytes": peaks.get(name)} for name in runs},
        "validate_fraction_of_step": times["validate"]["median_s"] / times["lossplug"]["median_s"],
    }
    for name, suffix in (("lossplug", ""), ("lossplug_no_metrics", "_no_metrics"), ("lossplug_full_metrics", "_full")):
        out[f"time_ratio{suffix}"] = times[name]["median_s"] / native
        out[f"mem_ratio{suffix}"] = peaks[name] / max(peaks["native"], 1)
    return out


def bench_loss_items(
    device: torch.device,
    sizes: list[tuple[int, int]],
    repeats: int,
    warmup: int,
    log=lambda m: None,
    trainers: tuple[str, ...] = ("verl", "trl"),
) -> list[dict]:
    """Part (b): every case of bench/loss_bench.py against ``trainers`` at each ``(B, T)`` on ``device``."""
    from . import loss_bench as lb

    results = []
    for B, T in sizes:
        t = {k: v.to(device) for k, v in lb.make_tensors(B, T).items()}
        cases = (lb.verl_cases(B, int(t["mask"].sum())) if "verl" in trainers else []) + (
            lb.trl_cases() if "trl" in trainers else []
        )
        for case in cases:
            log(f"[b] {case.name} vs {case.trainer}, B={B}, T={T} …")
            results.append(bench_loss_case(case, t, device, repeats, warmup))
    return results


# ---------------------------------------------------------------------------------------------------------------------
# (c) a TRL training step

GPU_TRL_SIZE = {"hidden": 256, "layers": 4, "batch": 16, "generations": 4, "completion": 64, "prompts": 64}
QUICK_TRL_SIZE = {"hidden": 32, "layers": 1, "batch": 4, "generations": 2, "completion": 4, "prompts": 8}


def bench_trl_step(device: torch.device, quick: bool) -> dict:
    """Part (c): bench/trl_bench.py's native-vs-lossplug GRPOTrainer run, on ``device`` (TRL places the model)."""
    from .trl_bench import bench_trl_e2e

    size = QUICK_TRL_SIZE if quick else GPU_TRL_SIZE
    steps, rounds = (2, 1) if quick else (6, 2)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = bench_trl_e2e(steps, rounds, size=size, config={"use_cpu": device.type == "cpu"})
    result["device"] = str(device)
    if device.type == "cuda":
        result["peak_bytes_both_trainers"] = torch.cuda.max_memory_allocated(device)
    return result


# ---------------------------------------------------------------------------------------------------------------------
# The table and the command


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _sweep_rows(result: dict) -> list[str]:
    rows = []
    per_combo = f"{len(result['reductions'])} reductions × {len(result['levels'])} levels"
    names = dict.fromkeys((r["group"], r["row"]) for r in result["records"])
    for group, name in names:
        mine = [r for r in result["records"] if (r["group"], r["row"]) == (group, name)]
        counts = status_counts(mine)
        extra = sum(r["spec"] is not None for r in mine) // len(result["levels"])
        if group == "gate":
            runs = f"{len(mine)}: {per_combo}" + (f" + {extra} parameter set{'s' * (extra > 1)}" if extra else "")
        else:
            runs = f"{len(mine)}: {len(mine) // len(result['levels'])} parameter sets × {len(result['levels'])} levels"
        bad = [f"{counts[s]} {s}" for s in STATUSES[1:] if counts[s]]
        result_text = "all pass" if not bad else f"{counts['pass']} pass, " + ", ".join(bad)
        label = name if group == "gate" else f"regularizer {name}"
        rows.append(f"| a | {label} | {runs} | {result_text} | {_sweep_detail(mine)} |")
    return rows


def _sweep_detail(records: list[dict]) -> str:
    bad = [r for r in records if r["status"] != "pass"]
    if not bad:
        return ""
    first = bad[0]
    where = f" at {first['where']}" if first.get("where") else ""
    return f"first: {first['reduction']}·{first['level']}: {first['status']}{where}"


def _loss_row(r: dict) -> str:
    return (
        f"| b | {r['case']} fwd+bwd vs {r['baseline']} | B={r['B']}, T={r['T']} | time **{r['time_ratio']:.2f}×** "
        f"basic / {r['time_ratio_no_metrics']:.2f}× off / {r['time_ratio_full']:.2f}× full; peak mem "
        f"{r['mem_ratio']:.2f}× / {r['mem_ratio_no_metrics']:.2f}× / {r['mem_ratio_full']:.2f}× | lossplug "
        f"{_ms(r['lossplug']['median_s'])} vs {_ms(r['native']['median_s'])}; validation "
        f"{100 * r['validate_fraction_of_step']:.0f}% of the step; agreement {max(r['loss_abs_diff'], r['grad_max_abs_diff']):.0e} |"
    )


def _trl_row(r: dict) -> str:
    return (
        f"| c | TRL GRPOTrainer step ({r['loss_type']}) | {r['rounds']} × {r['steps_per_run']} steps, "
        f"{r['size_batch']} compl. × {r['size_completion']} tok, hidden {r['size_hidden']} | time "
        f"**{r['time_ratio']:.3f}×** paired per step | lossplug {_ms(r['lossplug']['median_s'])} vs TRL "
        f"{_ms(r['native']['median_s'])}; first-step loss diff {r['first_step_loss_abs_diff']:.0e} |"
    )


def build_table(results: dict) -> str:
    """One Markdown table of everything that ran, and a row for every part that was skipped, with why."""
    rows = ["| part | item | runs / size | result | detail |", "|---|---|---|---|---|"]
    if "sweep" in results:
        rows += _sweep_rows(results["sweep"])
    rows += [_loss_row(r) for r in results.get("loss_items", [])]
    if "trl_step" in results:
        rows.append(_trl_row(results["trl_step"]))
    for skip in results.get("skipped", []):
        rows.append(f"| {skip['part']} | {skip['what']} | — | skipped | {skip['reason']} |")
    return "\n".join(rows)


def failure_lines(results: dict, limit: int = 25) -> list[str]:
    """The failures of (a), one line each (the first ``limit``; all of them are in the JSON)."""
    if "sweep" not in results:
        return []
    bad = failures(results["sweep"])
    lines = [
        f"  {r['row']}{' ' + json.dumps(r['spec']) if r['spec'] else ''} · {r['reduction']} · {r['level']} · "
        f"{r.get('variant')}: {r['status']}: {r.get('detail')}" + (f" [{r['where']}]" if r.get("where") else "")
        for r in bad[:limit]
    ]
    if len(bad) > limit:
        lines.append(f"  … and {len(bad) - limit} more (bench results JSON, sweep.records)")
    return lines


PART_NAMES = {
    "a": "every built-in gate × reduction × metric level under sync-debug mode",
    "b": "loss items vs verl's and TRL's own code (time, peak memory)",
    "c": "TRL GRPOTrainer training step, native vs lossplug",
}


#: what must import for each side (bench/loss_bench.py's TRL cases replicate TRL's math in torch: they need nothing)
NEEDS = {
    "verl": ("verl.trainer.ppo.core_algos", "verl.workers.config"),
    "trl_step": ("trl", "datasets", "lossplug.adapters.trl"),
}


def missing(modules: tuple[str, ...]) -> str | None:
    """Why the first of ``modules`` that does not import fails (verl's imports need ray, for one), or None."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # not only ImportError: a package can fail while importing its own dependencies
            return f"{name} does not import ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})"
    return None


def run_gpu(parts: set[str], quick: bool, device: torch.device, repeats: int, warmup: int, log=lambda m: None) -> dict:
    """Run ``parts`` on ``device`` (:func:`_choose` decides which run off CUDA); a side whose packages do not
    import is skipped, with the reason, instead of failing the run."""
    from .common import environment

    results: dict = {"device": str(device), "cuda": device.type == "cuda", "quick": quick, "skipped": []}
    results["environment"] = environment(torch.get_num_threads())
    started = time.perf_counter()
    if "a" in parts:
        B, T = (8, 12) if quick else (8, 24)  # B: whole prompt groups of gpu_sweep.GROUP_SIZE rows
        # quick: one batch of each advantage shape, one of them under a step normalizer (half the runs)
        variants = (VARIANTS[1], VARIANTS[2]) if quick else VARIANTS
        results["sweep"] = sweep(device, B, T, variants, log=log)
    if "b" in parts:
        sizes = [(4, 64)] if quick else [(64, 4096), (512, 8192)]
        trainers = ("verl", "trl")
        why = missing(NEEDS["verl"])
        if why:
            trainers = ("trl",)
            results["skipped"].append({"part": "b", "what": "the verl cases", "reason": why})
        results["loss_items"] = bench_loss_items(device, sizes, repeats, warmup, log=log, trainers=trainers)
    if "c" in parts:
        why = missing(NEEDS["trl_step"])
        if why:
            results["skipped"].append({"part": "c", "what": PART_NAMES["c"], "reason": why})
        else:
            log("[c] TRL training step …")
            results["trl_step"] = bench_trl_step(device, quick)
    results["seconds"] = time.perf_counter() - started
    return results


def _choose(args: argparse.Namespace) -> tuple[torch.device, set[str], list[dict]]:
    """The device and the parts to run on it; without CUDA (and no ``--device``), (b) and (c) are skipped."""
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown = parts - set(PARTS)
    if unknown:
        raise SystemExit(f"--parts: unknown part(s) {sorted(unknown)}; the parts are {', '.join(PARTS)}")
    explicit = args.device is not None
    device = torch.device(args.device if explicit else ("cuda" if torch.cuda.is_available() else "cpu"))
    skipped = []
    if device.type != "cuda" and "a" in parts:
        reason = f"{device} is not a CUDA device: (a) ran there as a smoke run, without sync-debug mode"
        skipped.append(
            {
                "part": "a",
                "what": "sync-debug mode",
                "reason": reason
                if explicit
                else f"{NO_CUDA}: (a) "
                "ran on the CPU as a smoke run without torch.cuda.set_sync_debug_mode, which cannot detect "
                "a host sync",
            }
        )
    if device.type == "cuda" or explicit:
        return device, parts, skipped
    for part in sorted(parts & {"b", "c"}):
        reason = f"{NO_CUDA}; the CPU numbers are `python -m bench` (or force this part with --device cpu)"
        skipped.append({"part": part, "what": PART_NAMES[part], "reason": reason})
    return device, parts & {"a"}, skipped


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench --gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds; what CI runs without CUDA)")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated parts: a,b,c (default: all)")
    parser.add_argument("--device", default=None, help="run every part on this device (default: cuda if available)")
    parser.add_argument("--repeats", type=int, default=None, help="(b) timed calls per candidate (default 30, quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="(b) untimed calls per candidate (default 5, quick 1)")
    parser.add_argument(
        "--out", default=None, help=f"the JSON (default {DEFAULT_OUT.name}; no CUDA: {FALLBACK_OUT.name})"
    )
    args = parser.parse_args(argv)
    device, parts, skipped = _choose(args)
    repeats = args.repeats or (2 if args.quick else 30)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    log = lambda m: print(m, file=sys.stderr, flush=True)
    for skip in skipped:
        print(f"SKIPPED ({skip['part']}) {skip['what']}: {skip['reason']}", flush=True)
    results = run_gpu(parts, args.quick, device, repeats, warmup, log=log)
    for skip in results["skipped"]:
        print(f"SKIPPED ({skip['part']}) {skip['what']}: {skip['reason']}", flush=True)
    results["skipped"] = skipped + results["skipped"]
    results["command"] = "python -m bench --gpu" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    results["table"] = build_table(results)
    results["failures"] = failure_lines(results, limit=10**6)
    out = Path(args.out) if args.out else (DEFAULT_OUT if device.type == "cuda" else FALLBACK_OUT)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=float))
    sync = "sync-debug mode 'error'" if device.type == "cuda" else "no sync-debug mode (not CUDA)"
    print(f"\nlossplug on {results['environment'].get('cuda_device') or device}, {sync}:\n")
    print(results["table"])
    bad = failure_lines(results)
    print(f"\nFailures: {len(results['failures'])}" + (":\n" + "\n".join(bad) if bad else ""))
    print(f"\n{results['command']}: {results['seconds']:.0f} s; written to {out}")
    return results
