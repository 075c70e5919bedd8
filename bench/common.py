"""Timing and allocation measurement shared by the benchmarks.

Timing: the candidates of one comparison run **interleaved** (A B A B …, in a fresh random order every round,
seeded) after a warm-up, so a load spike on a shared machine hits both sides, and no candidate always follows the
same one (a fixed or merely rotated order would always run a light candidate right after the same heavy one, with
its caches evicted); each side reports its median, min and interquartile range, and ratios are formed from medians
(``ratio_min`` from the minima is reported too, as a noise check).

Peak memory (CPU): ``torch.profiler`` with ``profile_memory=True`` records every allocation and free of torch's CPU
allocator (``[memory]`` events with the running ``Total Allocated`` since profiling started). The peak of that
running total over one call is the most the call held at once on top of what existed before it — the inputs are
allocated before profiling starts and do not count; the gradient of ``logp`` does (both sides produce one). It is
deterministic (allocation sizes, not timings), so one profiled call per candidate suffices. Python objects and
glibc caches are invisible to it; everything the loss math allocates is a torch tensor.
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable

import torch


def summarize(times: list[float]) -> dict:
    times = sorted(times)
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return {"median_s": statistics.median(times), "min_s": times[0], "q1_s": q[0], "q3_s": q[2], "n": len(times)}


def interleaved(
    candidates: dict[str, Callable[[], object]], repeats: int, warmup: int = 1, setup: Callable[[], None] | None = None
) -> dict[str, dict]:
    """Time each candidate ``repeats`` times, interleaved; ``setup`` (untimed) runs before every call."""
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            if setup:
                setup()
            candidates[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    gc.collect()
    gc.disable()  # no collector pause inside a timed call (tensors are freed by reference counting anyway)
    order_rng = random.Random(0)
    try:
        for _ in range(repeats):
            order = order_rng.sample(names, len(names))
            for name in order:
                if setup:
                    setup()
                t0 = time.perf_counter()
                candidates[name]()
                times[name].append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return {n: summarize(ts) for n, ts in times.items()}


def ratio(ours: dict, base: dict) -> dict:
    return {"ratio": ours["median_s"] / base["median_s"], "ratio_min": ours["min_s"] / base["min_s"]}


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of the net bytes allocated by torch's CPU allocator during one call of ``fn`` (see module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.remove(path)
    running = peak = 0
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["args"].get("Ev Idx", 0)):
        if e["args"].get("Device Type", 0) != 0:  # CPU only
            continue
        running += int(e["args"]["Bytes"])
        peak = max(peak, running)
    return peak


def environment(threads: int) -> dict:
    import platform

    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
    }
    try:
        info["load_avg_at_start"] = os.getloadavg()
    except OSError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("lossplug", "trl", "verl", "transformers", "numpy"):
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:
            info[dist] = None
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info
