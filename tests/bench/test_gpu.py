"""``python -m bench --gpu`` (bench/gpu.py, bench/gpu_sweep.py) without a GPU: the CPU fallback runs every built-in
gate × reduction × metric level and says what it skipped; the CUDA-only pieces (the sync-debug guard, the failure
classification, the table) are tested with stand-ins. It measures nothing here: benchmarks never run in the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lossplug

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import gpu, gpu_sweep  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def fallback(tmp_path_factory):
    """One run of the command as a user types it, on a machine without CUDA (CUDA hidden if there is one)."""
    out = tmp_path_factory.mktemp("gpu") / "results.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--gpu", "--quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def test_fallback_says_what_it_skipped_and_why(fallback):
    stdout, saved = fallback
    assert saved["cuda"] is False and saved["device"] == "cpu"
    assert {s["part"] for s in saved["skipped"]} == {"a", "b", "c"}
    assert all(gpu.NO_CUDA in s["reason"] for s in saved["skipped"])
    for part in ("a", "b", "c"):
        assert f"SKIPPED ({part})" in stdout
    assert "sync-debug mode" in stdout and "python -m bench" in stdout
    assert "loss_items" not in saved and "trl_step" not in saved  # (b) and (c) did not run
    assert saved["sweep"]["sync_debug"] is False


def test_fallback_runs_every_combination_and_none_fails(fallback, builtin_gates):
    _, saved = fallback
    result = saved["sweep"]
    assert builtin_gates <= set(result["gates"])
    assert set(result["reductions"]) >= {"token", "response", "sequence_sum", "token_sum", "fixed", "prompt_mean"}
    assert result["levels"] == ["off", "basic", "full"]
    grid = {(r["row"], r["reduction"], r["level"]) for r in result["records"] if r["group"] == "gate" and not r["spec"]}
    expected = {(g, r, lv) for g in result["gates"] for r in result["reductions"] for lv in result["levels"]}
    assert grid == expected and result["combinations"] == result["expected_combinations"] == len(expected)
    # a full batch is given: no built-in may refuse, and none may fail
    assert result["counts"]["pass"] == len(result["records"]), [r for r in result["records"] if r["status"] != "pass"]
    regularizers = {r["row"] for r in result["records"] if r["group"] == "regularizer"}
    assert regularizers == set(gpu_sweep.builtin_names("regularizer"))
    assert saved["failures"] == []


def test_fallback_prints_one_table_with_a_row_per_gate(fallback):
    stdout, saved = fallback
    assert saved["table"] in stdout and "Failures: 0" in stdout
    rows = [line for line in stdout.splitlines() if line.startswith("|")]
    assert len(rows) == saved["table"].count("\n") + 1  # every table line printed, and nothing else like it
    for gate in saved["sweep"]["gates"]:
        assert any(row.startswith(f"| a | {gate} | ") and "all pass" in row for row in rows), gate
    assert sum(row.startswith(("| b |", "| c |")) for row in rows) == 2  # the skipped rows


# ---------------------------------------------------------------------------------------------------------------------
# The CUDA path's pieces, with stand-ins


class FakeCuda:
    def __init__(self):
        self.mode, self.calls = 0, []

    def get_sync_debug_mode(self):
        return self.mode

    def set_sync_debug_mode(self, mode):
        self.calls.append(mode)
        self.mode = mode


def test_the_guard_arms_sync_debug_mode_on_cuda_and_restores_it():
    cuda = FakeCuda()
    with gpu_sweep.host_sync_guard(torch.device("cuda"), cuda) as armed:
        assert armed and cuda.mode == "error"
    assert cuda.mode == 0
    with pytest.raises(RuntimeError), gpu_sweep.host_sync_guard(torch.device("cuda:0"), cuda):
        raise RuntimeError(gpu_sweep.SYNC_MESSAGE)
    assert cuda.mode == 0 and cuda.calls == ["error", 0, "error", 0]
    with gpu_sweep.host_sync_guard(CPU, cuda) as armed:  # off CUDA: nothing to arm
        assert armed is False
    assert cuda.calls == ["error", 0, "error", 0]


def test_failures_are_classified_by_the_whole_chain():
    try:
        try:
            raise RuntimeError(gpu_sweep.SYNC_MESSAGE)
        except RuntimeError as exc:
            raise lossplug.PluginError("recipe.gates[0] (x) raised RuntimeError") from exc
    except lossplug.PluginError as wrapped:
        assert gpu_sweep.failure_kind(wrapped) == "host_sync"
    assert gpu_sweep.failure_kind(lossplug.RecipeError("gates: unknown")) == "refused"
    assert gpu_sweep.failure_kind(lossplug.PluginError("crashed")) == "error"
    assert gpu_sweep.failure_kind(ValueError("bad")) == "error"


@lossplug.gate("needs_sum_pi_squared_gpu_test", requires=("sum_pi_squared",))
def needs_sum_pi_squared(inp, p):
    """A·logp, declaring a field the sweep's batches lack (only an advantage estimator reads it)."""
    return lossplug.GateOutput(objective=inp.broadcast_advantage() * inp.logp)


ARMED = [False]


@lossplug.gate("syncs_when_guarded_gpu_test")
def syncs_when_guarded(inp, p):
    """A·logp; raises what CUDA raises at a host sync while the guard is armed."""
    if ARMED[0]:
        raise RuntimeError(gpu_sweep.SYNC_MESSAGE)
    return lossplug.GateOutput(objective=inp.broadcast_advantage() * inp.logp)


@lossplug.gate("nan_gpu_test")
def nan_objective(inp, p):
    """A·logp·NaN."""
    return lossplug.GateOutput(objective=inp.broadcast_advantage() * inp.logp * float("nan"))


def test_the_sweep_reports_refusals_syncs_and_non_finite_losses(register_gates, monkeypatch):
    import contextlib

    @contextlib.contextmanager
    def armed_guard(device, cuda=None):  # the CUDA guard's effect, on the CPU
        ARMED[0] = True
        try:
            yield True
        finally:
            ARMED[0] = False

    register_gates(needs_sum_pi_squared, syncs_when_guarded, nan_objective, name="gpu-sweep-test")
    monkeypatch.setattr(gpu_sweep, "host_sync_guard", armed_guard)
    names = ["needs_sum_pi_squared_gpu_test", "syncs_when_guarded_gpu_test", "nan_gpu_test"]
    result = gpu_sweep.sweep(CPU, 8, 12, gpu_sweep.VARIANTS[:1], gates=names, regularizers=())
    per_gate = len(result["reductions"]) * len(result["levels"])
    by_gate = {g: {r["status"] for r in result["records"] if r["row"] == g} for g in names}
    assert by_gate == {names[0]: {"refused"}, names[1]: {"host_sync"}, names[2]: {"non_finite"}}
    assert result["counts"] == {
        "pass": 0,
        "refused": per_gate,
        "non_finite": per_gate,
        "error": 0,
        "host_sync": per_gate,
    }
    refused = next(r for r in result["records"] if r["row"] == names[0])
    assert "sum_pi_squared" in refused["detail"] and refused["variant"] == gpu_sweep.VARIANTS[0].name
    synced = next(r for r in result["records"] if r["row"] == names[1])
    assert gpu_sweep.SYNC_MESSAGE in synced["detail"] and synced["where"]
    assert len(gpu_sweep.failures(result)) == 2 * per_gate  # a refusal is not a failure

    table = gpu.build_table({"sweep": result})
    rows = table.splitlines()[2:]
    assert len(rows) == 3
    assert f"0 pass, {per_gate} refused" in rows[0] and f"{per_gate} host_sync" in rows[1]
    lines = gpu.failure_lines({"sweep": result}, limit=3)
    assert len(lines) == 4 and lines[-1].startswith(f"  … and {2 * per_gate - 3} more")


@pytest.mark.parametrize("kind", ["advantage", "gate", "reduction", "regularizer"])
def test_builtins_come_from_the_registry(kind):
    names = gpu_sweep.builtin_names(kind)
    assert names and names == sorted(names)
    assert all(lossplug.registry().origin(kind, n) == "lossplug (built-in)" for n in names)


def test_every_gate_parameter_set_names_a_builtin_gate():
    gates = set(gpu_sweep.builtin_names("gate"))
    assert {s["name"] for s in gpu_sweep.GATE_PARAMETER_SETS} <= gates
    for spec in gpu_sweep.GATE_PARAMETER_SETS:  # each one is a valid recipe
        gpu_sweep.sweep_recipe(spec, "response", 12)


def test_loss_items_run_on_the_cpu_through_the_device_path():
    """Part (b)'s code (agreement, interleaved timing, peaks, table rows) at toy size; on CUDA it uses events."""
    pytest.importorskip("verl")
    pytest.importorskip("trl")
    results = gpu.bench_loss_items(CPU, [(4, 32)], repeats=1, warmup=0)
    assert [(r["case"], r["baseline"]) for r in results] == [
        (c, t) for t in ("verl", "trl") for c in ("ppo_clip+token", "gspo", "sapo", "cispo+tis")
    ]
    for r in results:
        assert r["loss_abs_diff"] < 1e-5 and r["grad_max_abs_diff"] < 1e-5
        assert r["native"]["peak_bytes"] > 0 and r["lossplug"]["peak_bytes"] > 0
        assert r["time_ratio"] > 0 and r["validate_fraction_of_step"] > 0
    rows = gpu.build_table({"loss_items": results}).splitlines()[2:]
    assert len(rows) == 8 and all(row.startswith("| b | ") and "B=4, T=32" in row for row in rows)


def test_a_side_whose_packages_do_not_import_is_skipped_with_the_reason(monkeypatch):
    """On the lent machine verl does not import (no ray there): (b) runs TRL's cases, names what it skipped; (c)
    likewise without trl."""
    monkeypatch.setitem(gpu.NEEDS, "verl", ("lossplug_no_such_module_verl",))
    monkeypatch.setitem(gpu.NEEDS, "trl_step", ("lossplug_no_such_module_trl",))
    results = gpu.run_gpu({"b", "c"}, True, CPU, repeats=1, warmup=0)
    assert [(s["part"], s["what"]) for s in results["skipped"]] == [("b", "the verl cases"), ("c", gpu.PART_NAMES["c"])]
    assert all("does not import (ModuleNotFoundError" in s["reason"] for s in results["skipped"])
    assert {r["baseline"] for r in results["loss_items"]} == {"trl"} and len(results["loss_items"]) == 4
    assert "trl_step" not in results
    table = gpu.build_table(results)
    assert "| b | the verl cases | — | skipped | lossplug_no_such_module_verl does not import" in table


@lossplug.gate("raises_gpu_test")
def raises_a_sync(inp, p):
    """Raises what CUDA raises at a host sync."""
    raise RuntimeError(gpu_sweep.SYNC_MESSAGE)


def test_the_failure_site_is_the_innermost_lossplug_line(register_gates):
    register_gates(raises_a_sync, name="gpu-site-test")
    batch = lossplug.PolicyBatch(logp=torch.zeros(2, 3), action_mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(lossplug.PluginError) as raised:
        lossplug.policy_loss(batch, {"gates": ["raises_gpu_test"], "reduction": "token"}, validate="off")
    # the gate's own frame is outside lossplug: the innermost lossplug frame is the plugin wrapper that called it
    assert gpu_sweep.failure_kind(raised.value) == "host_sync"
    assert gpu_sweep.failure_site(raised.value).startswith("plugin.py:")
    with pytest.raises(ValueError) as outside:
        raise ValueError("no lossplug frame")
    assert gpu_sweep.failure_site(outside.value).startswith("test_gpu.py:")  # then the innermost frame
