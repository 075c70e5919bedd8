"""The benchmark runner works at toy sizes (it measures nothing here: benchmarks never run in the test suite)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench_run():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.run import main

    return main


def test_bench_runner_at_toy_sizes(bench_run, tmp_path, capsys):
    out = tmp_path / "results.json"
    results = bench_run(["--quick", "--repeats", "1", "--cases", "ppo_clip+token", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["table"] == results["table"]
    assert saved["environment"]["threads"] == 1
    items = [r["item"] for r in saved["results"]]
    assert items == [
        "packed_gae",
        "padded_gae",
        "loss_step",
        "validation",
        "loss_step",
        "validation",
        "rollout_stages",
        "trl_e2e",
    ]
    by_item = {}
    for r in saved["results"]:
        by_item.setdefault(r["item"], []).append(r)
    packed = by_item["packed_gae"][0]
    assert packed["max_abs_diff_vs_sequential"] < 1e-4 and packed["speedup"] > 0
    padded = by_item["padded_gae"][0]
    assert padded["max_abs_diff_vs_verl_on_actions"] < 1e-4 and padded["speedup"] > 0
    for r in by_item["loss_step"]:  # the recipe reproduces the native loss before anything is timed
        assert {r["baseline"] for r in by_item["loss_step"]} == {"verl", "trl"}
        assert r["loss_abs_diff"] < 1e-5 and r["grad_max_abs_diff"] < 1e-5
        assert r["native"]["peak_bytes"] > 0 and r["lossplug"]["peak_bytes"] > 0
        assert r["time_ratio"] > 0 and r["mem_ratio"] > 0
    for r in by_item["validation"]:
        assert 0 < r["fraction_of_step"]
    rollout = by_item["rollout_stages"][0]
    assert rollout["loss_step"]["median_s"] > 0 and rollout["kl_in_reward_vs_verl"] is not None
    assert rollout["kept_responses"] < 1  # the zero-variance filter dropped some groups: it ran
    e2e = by_item["trl_e2e"][0]
    assert e2e["first_step_loss_abs_diff"] < 1e-6 and e2e["time_ratio"] > 0
    table = capsys.readouterr().out
    assert table.count("\n| ") >= 8 and "packed GAE vs sequential loop" in table
