"""The `lossplug` command line: list, show, validate, recipe explain, check, plot gates."""

import json
import os
import pickle
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
from typer.testing import CliRunner

import lossplug
from lossplug.cli import app

WIDE = {"COLUMNS": "200", "NO_COLOR": "1"}


def run(*args, env=None):
    result = CliRunner().invoke(app, list(args), env={**WIDE, **(env or {})})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"lossplug {' '.join(args)} raised instead of reporting") from result.exception
    assert "Traceback" not in result.output
    return result


# ---------------------------------------------------------------------------------------------------------------------
# help, list, show


def test_help_lists_every_command_with_a_one_line_summary():
    out = run("--help")
    assert out.exit_code == 0
    commands = {line.split()[0] for line in out.output.split("Commands:")[1].splitlines() if line.strip()}
    assert commands == {"list", "show", "validate", "check", "demo", "recipe", "plot", "schema", "verl"}
    assert "--version" in out.output
    assert "explain" in run("recipe", "--help").output
    assert "gates" in run("plot", "--help").output
    assert run().exit_code in (0, 2)  # no arguments: the help, not a traceback


def test_list_shows_every_kind_with_parameters_defaults_and_source():
    out = run("list")
    assert out.exit_code == 0
    for header in ("advantages (", "gates (", "reductions (", "presets ("):
        assert header in out.output
    assert "ppo_clip" in out.output and "eps_low=0.2" in out.output and "dual_clip_c=None" in out.output
    assert "update · token · needs old_logp" in out.output
    assert "from lossplug (built-in)" in out.output


def test_list_json_is_machine_readable_and_filters_by_kind():
    data = json.loads(run("list", "--kind", "gate", "--json").output)
    rows = {r["name"]: r for r in data["plugins"]}
    assert {r["kind"] for r in data["plugins"]} == {"gate"}
    assert rows["ppo_clip"]["distribution"] == "lossplug (built-in)"
    assert rows["ppo_clip"]["params"]["eps_high"]["default"] == 0.2
    assert rows["tis"]["role"] == "correction"
    assert data["broken"] == [] and data["duplicates"] == []


class Broken:
    @staticmethod
    @lossplug.hookimpl
    def lossplug_register_gates(register):
        raise RuntimeError("boom: cannot reach the tokenizer")


def test_broken_plugins_are_listed_in_red(fresh_registry):
    lossplug.register_plugin(Broken, name="broken_pkg")
    try:
        with pytest.warns(lossplug.LossplugPluginWarning):
            lossplug.registry()
        out = CliRunner().invoke(
            app, ["list", "--kind", "gate"], env={"COLUMNS": "200", "FORCE_COLOR": "1", "TERM": "xterm-256color"}
        )
        assert out.exit_code == 0
        text = out.output
        assert "plugins that cannot be used" in text and "boom: cannot reach the tokenizer" in text
        line = next(row for row in text.splitlines() if "broken_pkg" in row)
        assert "\x1b[31m" in line or "\x1b[1;31m" in line or "\x1b[91m" in line, repr(line)
        data = json.loads(run("list", "--json").output)
        assert data["broken"][0]["origin"] == "in-process plugin 'broken_pkg'"
    finally:
        lossplug.unregister_plugin(Broken)


def test_show_prints_the_formula_the_schema_and_the_needs():
    out = run("show", "ppo_clip")
    assert out.exit_code == 0
    text = out.output
    assert "J = min(r·A, clip(r, 1 − eps_low, 1 + eps_high)·A)" in text  # the module's formula, unwrapped
    assert "role: update gate, token level" in text
    assert "batch fields: logp, action_mask, advantage, old_logp" in text
    assert "dual_clip_c" in text and "> 1" in text and "dual-clip bound" in text


def test_show_keeps_brackets_and_covers_name_clashes_with_presets():
    text = run("show", "grpo").output
    assert "advantage grpo" in text and "recipe grpo" in text  # the advantage plugin and the preset
    assert "[B, T]" in text  # plugin text is never parsed as rich markup


def test_show_unknown_name_suggests_and_exits_1():
    out = run("show", "ppo_clp")
    assert out.exit_code == 1
    assert "did you mean 'ppo_clip'" in out.output


def test_show_json_has_the_json_schema():
    data = json.loads(run("show", "cispo", "--json").output)
    (info,) = data["plugins"]
    assert info["params_schema"]["properties"]["ratio_max"]["anyOf"]
    assert info["needs"] == ["logp", "action_mask", "advantage", "old_logp"]


# ---------------------------------------------------------------------------------------------------------------------
# validate


def batch_tensors(**overrides):
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1, 3:] = False
    logp = -torch.rand(4, 5, generator=g) - 0.1
    tensors = dict(
        logp=logp,
        old_logp=logp - 0.05,
        action_mask=mask,
        advantage=torch.tensor([1.0, -1.0, 0.5, 0.0]),
        reward=torch.tensor([1.0, 0.0, 1.0, 0.0]),
        group_id=torch.tensor([0, 0, 1, 1]),
    )
    tensors.update(overrides)
    return {k: v for k, v in tensors.items() if v is not None}


def save(path, tensors):
    pytest.importorskip("safetensors")  # writing the file (lossplug reads it without safetensors)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def test_validate_a_good_safetensors_batch(tmp_path):
    out = run("validate", str(save(tmp_path / "b.safetensors", batch_tensors())), "--recipe", "dapo")
    assert out.exit_code == 0, out.output
    assert "valid against PolicyBatch and recipe 'dapo'" in out.output and "(B=4, 18 action tokens)" in out.output


def test_validate_names_every_violation_with_field_rule_and_rows(tmp_path):
    logp = batch_tensors()["logp"].clone()
    logp[2, 1] = float("nan")
    bad = batch_tensors(logp=logp, action_mask=torch.ones(4, 5, dtype=torch.int64), advantage=torch.zeros(3))
    out = run("validate", str(save(tmp_path / "bad.safetensors", bad)), "--json")
    assert out.exit_code == 1
    data = json.loads(out.output)
    assert data["contract"] == "PolicyBatch" and not data["valid"]
    fields = {v["field"] for v in data["violations"]}
    assert {"action_mask", "advantage"} <= fields
    assert any("bool" in v["rule"] for v in data["violations"] if v["field"] == "action_mask")


def test_validate_reports_positions_in_the_table(tmp_path):
    logp = batch_tensors()["logp"].clone()
    logp[2, 1] = float("nan")
    out = run("validate", str(save(tmp_path / "nan.safetensors", batch_tensors(logp=logp))))
    assert out.exit_code == 1
    assert "1 violation of PolicyBatch" in out.output
    assert "must be finite on action positions" in out.output and "(row 2, pos 1)" in out.output
    # a 0/1 integer mask stops the contract before its value rules; validate still names both problems
    int_mask = batch_tensors()["action_mask"].to(torch.int8)
    out = run("validate", str(save(tmp_path / "both.safetensors", batch_tensors(logp=logp, action_mask=int_mask))))
    assert "2 violations of PolicyBatch" in out.output
    assert "must be a bool tensor, got torch.int8" in out.output and "(row 2, pos 1)" in out.output


def test_validate_with_a_recipe_names_the_fields_it_needs(tmp_path):
    path = save(tmp_path / "b.safetensors", batch_tensors(reward=None, group_id=None, old_logp=None))
    out = run("validate", str(path), "--recipe", "dapo", "--json")
    assert out.exit_code == 1
    data = json.loads(out.output)
    missing = {v["field"]: v["rule"] for v in data["violations"]}
    assert set(missing) == {"reward", "group_id", "old_logp"}
    assert "advantage 'grpo'" in missing["reward"] and "gates[0] 'ppo_clip'" in missing["old_logp"]


def test_validate_small_json_and_packed_transitions(tmp_path):
    policy = tmp_path / "small.json"
    policy.write_text(json.dumps({"logp": [[-0.5, -1.0]], "action_mask": [[True, False]], "advantage": [1.0]}))
    assert run("validate", str(policy)).exit_code == 0
    packed = tmp_path / "packed.json"
    packed.write_text(
        json.dumps(
            {
                "reward": [1.0, 0.0, 2.0],
                "value": [0.1, 0.2, 0.3],
                "next_value": [0.2, 0.0, 0.0],
                "terminated": [False, False, True],
                "boundary": [False, True, True],
            }
        )
    )
    out = run("validate", str(packed), "--recipe", "ppo")
    assert out.exit_code == 0, out.output
    assert "PackedTransitions" in out.output
    packed.write_text(
        json.dumps(
            {
                "reward": [1.0, 0.0],
                "value": [0.1, 0.2],
                "next_value": [0.2, 0.1],
                "terminated": [True, False],
                "boundary": [False, False],
            }
        )
    )
    out = run("validate", str(packed), "--json")
    assert out.exit_code == 1
    rules = " ".join(v["rule"] for v in json.loads(out.output)["violations"])
    assert "terminated ⇒ boundary" in rules and "must be closed" in rules


@pytest.mark.parametrize(
    "content,phrase",
    [
        (b"", "too short to be a safetensors file"),
        (b"hello, this is not a tensor file at all", "not a safetensors file"),
        (struct.pack("<Q", 20) + b"[1, 2, 3]           ", "header is not a JSON object"),
    ],
)
def test_validate_unreadable_files_give_a_clear_error(tmp_path, content, phrase):
    path = tmp_path / "x.safetensors"
    path.write_bytes(content)
    out = run("validate", str(path))
    assert out.exit_code == 2
    assert phrase in out.output


def test_validate_truncated_safetensors(tmp_path):
    path = save(tmp_path / "b.safetensors", batch_tensors())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])
    out = run("validate", str(path))
    assert out.exit_code == 2
    assert "truncated" in out.output
    path.write_bytes(data[:30])
    out = run("validate", str(path))
    assert out.exit_code == 2 and "truncated" in out.output


def test_validate_never_unpickles(tmp_path, monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("unpickling was attempted")

    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    for name in ("batch.pt", "batch.safetensors", "batch.data"):
        path = tmp_path / name
        torch.save(batch_tensors(), path)  # a zip of pickles, whatever its name
        out = run("validate", str(path))
        assert out.exit_code == 2, out.output
        assert "never unpickles" in out.output
    raw = tmp_path / "raw.bin"
    raw.write_bytes(pickle.dumps({"logp": [1.0]}))
    out = run("validate", str(raw))
    assert out.exit_code == 2 and "never unpickles" in out.output


def test_validate_missing_file_bad_json_and_unknown_contract(tmp_path):
    assert "no such file" in run("validate", str(tmp_path / "nope.safetensors")).output
    bad = tmp_path / "bad.json"
    bad.write_text('{"logp": [[-1.0, -2.0], [-1.0]]}')
    out = run("validate", str(bad), "--json")  # a field that is no array is a violation, in lossplug's words
    assert out.exit_code == 1 and "expected sequence" not in out.output
    assert json.loads(out.stdout)["violations"] == [
        {
            "field": "logp",
            "rule": "must be a rectangular array: every list at one depth has the same length",
            "where": "$.logp[1] has 1 element where $.logp[0] has 2",
        },
        {"field": "action_mask", "rule": "is required", "where": ""},
    ]
    odd = tmp_path / "odd.json"
    odd.write_text('{"score": [1.0]}')
    out = run("validate", str(odd))
    assert out.exit_code == 2 and "--contract policy|packed" in out.output
    out = run("validate", str(odd), "--contract", "policy", "--json")
    assert out.exit_code == 1
    fields = {v["field"] for v in json.loads(out.output)["violations"]}
    assert fields == {"score", "logp", "action_mask"}


def test_validate_warns_about_groups_of_one_rollout_under_grpo_and_dapo(tmp_path):
    lone = batch_tensors(group_id=torch.tensor([7, 7, 3, 9]))  # groups 3 and 9 have one rollout each
    path = save(tmp_path / "lone.safetensors", lone)
    for recipe in ("dapo", "grpo"):
        out = run("validate", str(path), "--recipe", recipe)
        assert out.exit_code == 0, out.output  # a warning never changes the exit code
        assert "valid against PolicyBatch" in out.stdout
        assert "warning" in out.stderr and "group_id 3, 9" in out.stderr and "advantage 0" in out.stderr
    out = run("validate", str(path), "--recipe", "dapo", "--json")
    assert out.exit_code == 0
    data = json.loads(out.stdout)
    assert data["valid"] and data["error"] is None
    (warning,) = data["warnings"]
    assert warning["field"] == "group_id" and warning["values"] == [3, 9] and "single rollout" in warning["message"]
    assert "group_id 3, 9" in out.stderr  # on stderr too, so a human running it sees it
    # groups of two: no warning; no recipe: nothing to warn about
    good = run("validate", str(save(tmp_path / "b.safetensors", batch_tensors())), "--recipe", "dapo", "--json")
    assert json.loads(good.stdout)["warnings"] == [] and good.stderr == ""
    assert run("validate", str(path)).stderr == ""


def test_validate_names_the_first_lone_groups_and_counts_the_rest(tmp_path):
    n = 30
    tensors = dict(
        logp=torch.full((n, 2), -1.0),
        old_logp=torch.full((n, 2), -1.0),
        action_mask=torch.ones(n, 2, dtype=torch.bool),
        reward=torch.zeros(n),
        group_id=torch.arange(100, 100 + n),
    )
    out = run("validate", str(save(tmp_path / "lone.safetensors", tensors)), "--recipe", "dapo", "--json")
    assert out.exit_code == 0
    assert "30 of 30 groups" in out.stderr and "group_id 100, 101," in out.stderr and "… and 20 more" in out.stderr
    assert "129" not in out.stderr
    assert json.loads(out.stdout)["warnings"][0]["values"] == list(range(100, 130))


def test_validate_warns_even_when_the_batch_has_violations_and_keeps_exit_1(tmp_path):
    bad = batch_tensors(group_id=torch.tensor([0, 1, 1, 2]), old_logp=None)
    out = run("validate", str(save(tmp_path / "bad.safetensors", bad)), "--recipe", "dapo", "--json")
    assert out.exit_code == 1
    data = json.loads(out.stdout)
    assert not data["valid"] and {v["field"] for v in data["violations"]} == {"old_logp"}
    assert data["warnings"][0]["values"] == [0, 2]


def test_validate_json_reports_errors_as_json_on_stdout(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"hello, this is not a tensor file at all")
    out = run("validate", str(path), "--json")
    assert out.exit_code == 2
    data = json.loads(out.stdout)
    assert data["valid"] is False and data["file"] == str(path) and data["violations"] == []
    assert data["error"]["kind"] == "unreadable_file" and "not a safetensors file" in data["error"]["message"]
    assert "error: " in out.stderr and "not a safetensors file" in out.stderr  # the plain text stays on stderr
    good = save(tmp_path / "b.safetensors", batch_tensors())
    out = run("validate", str(good), "--recipe", "dapoo", "--json")
    assert out.exit_code == 2
    error = json.loads(out.stdout)["error"]
    assert error["kind"] == "bad_recipe" and "did you mean 'dapo'" in error["message"]
    # every outcome has the same keys
    assert json.loads(run("validate", str(good), "--json").stdout).keys() == data.keys()


def test_validate_help_documents_the_exit_codes():
    text = " ".join(run("validate", "--help").output.split())
    for phrase in (
        "0 — the batch is valid",
        "1 — it has violations",
        "2 — it could not be judged",
        "keep exit code 0 unless --strict",
    ):
        assert phrase in text


class RaisingValidator:
    @staticmethod
    @lossplug.hookimpl
    def lossplug_validate_batch(batch, recipe):
        raise KeyError("group_size")


def test_validate_blames_a_failing_plugin_validator(tmp_path):
    lossplug.register_plugin(RaisingValidator, name="strict-checks")
    try:
        path = save(tmp_path / "b.safetensors", batch_tensors())
        out = run("validate", str(path), "--recipe", "dapo", "--json")
    finally:
        lossplug.unregister_plugin(RaisingValidator)
    assert out.exit_code == 2
    error = json.loads(out.stdout)["error"]
    assert error["kind"] == "plugin_failed"
    assert "in-process plugin 'strict-checks'" in error["message"] and "raised KeyError" in error["message"]


# ---------------------------------------------------------------------------------------------------------------------
# recipe explain, check, plot


def test_recipe_explain_a_preset():
    out = run("recipe", "explain", "dapo")
    assert out.exit_code == 0
    text = out.output
    assert "DAPO (Yu et al., 2025" in text and "eps_high: 0.28" in text and "dual_clip_c: null" in text
    for field in ("logp", "action_mask", "reward", "group_id", "old_logp"):
        assert field in text
    assert "Normalizer(action_tokens=" in text


def test_recipe_explain_a_file_and_json(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("gates:\n  - {name: ppo_clip}\n  - {name: icepop}\nreduction: {name: fixed}\n")
    data = json.loads(run("recipe", "explain", str(path), "--json").output)
    needs = {n["field"]: n["needed_by"] for n in data["needs"]}
    assert set(needs) == {"logp", "action_mask", "advantage", "old_logp", "behavior_logp"}
    assert "no advantage stage" in needs["advantage"]
    assert "gates[1] 'icepop'" in needs["behavior_logp"]
    assert "budget=" in data["normalizer"]
    assert [s["stage"] for s in data["stages"]] == ["gates[0]", "gates[1]", "reduction"]


def test_recipe_explain_errors_are_messages(tmp_path):
    out = run("recipe", "explain", "dapoo")
    assert out.exit_code == 2 and "unknown preset 'dapoo'" in out.output and "did you mean 'dapo'" in out.output
    path = tmp_path / "r.yaml"
    path.write_text("gates: [{name: ppo_clip, eps_hgh: 0.3}]\nreduction: token\n")
    out = run("recipe", "explain", str(path))
    assert out.exit_code == 2 and "did you mean 'eps_high'" in out.output


#: a third-party gate's description: a first paragraph of several lines, as docstrings are written
LONG_DESCRIPTION = (
    "Soft trust band: A times the ratio inside the band, bending smoothly towards its edge outside it so that no "
    "token loses its gradient at once; the band widens with the advantage's magnitude and narrows for tokens the "
    "policy already finds likely, as the second table of the paper describes for each of its settings."
)


def _soft_band_gate(name="soft_trust_band"):
    doc = textwrap.fill(LONG_DESCRIPTION, 70) + "\n\nPaper: none; a test gate."

    @lossplug.gate(name, requires=("old_logp",), role="correction", doc=doc)
    def soft_trust_band(inp, p):
        return lossplug.GateOutput(weight=(inp.logp - inp.old_logp).detach().exp().clamp(max=2.0))

    return soft_trust_band


def _printed_whole(text: str, expected: str) -> bool:
    """``expected`` appears in ``text`` word for word, however rich wrapped it."""
    return " ".join(expected.split()) in " ".join(text.split())


@pytest.mark.parametrize("columns", ["60", "200"])
def test_recipe_explain_prints_a_plugin_description_whole_at_any_width(register_gates, tmp_path, columns):
    register_gates(_soft_band_gate())
    path = tmp_path / "recipe.yaml"
    path.write_text("gates: [{name: ppo_clip}, {name: soft_trust_band}]\nreduction: token\n")
    out = run("recipe", "explain", str(path), env={"COLUMNS": columns})
    assert out.exit_code == 0
    assert _printed_whole(out.output, LONG_DESCRIPTION)
    # a built-in's first paragraph runs over two lines of its docstring too
    assert _printed_whole(out.output, "for A < 0; with ``delta``: min(min(r, δ)·A, clip(r)·A).")
    stages = out.output.split("\nstages\n")[1].split("the batch")[0]
    assert "…" not in stages


def test_recipe_explain_folds_a_long_plugin_name_instead_of_cutting_it(register_gates, tmp_path):
    name = "soft_trust_band_with_a_name_longer_than_the_column"
    register_gates(_soft_band_gate(name))
    path = tmp_path / "recipe.yaml"
    path.write_text(f"gates: [{{name: ppo_clip}}, {{name: {name}}}]\nreduction: token\n")
    out = run("recipe", "explain", str(path), env={"COLUMNS": "50"})
    assert out.exit_code == 0
    lines = out.output.split("\nstages\n")[1].split("the batch")[0].splitlines()
    assert not any("…" in line for line in lines)
    row = next(i for i, line in enumerate(lines) if "gates[1]" in line)
    start = lines[row].index(name[:8])
    width = len(lines[row][start:].split()[0])
    column = [line[start : start + width].strip() for line in lines[row:]]
    assert "".join(column[: column.index("")] if "" in column else column) == name  # folded, every letter kept


def test_list_prints_each_plugin_summary_whole(register_gates):
    register_gates(_soft_band_gate())
    out = run("list", "--kind", "gate", env={"COLUMNS": "80"})
    assert out.exit_code == 0
    assert _printed_whole(out.output, LONG_DESCRIPTION)
    assert _printed_whole(out.output, "for A < 0; with ``delta``: min(min(r, δ)·A, clip(r)·A).")


def test_check_runs_the_conformance_kit():
    out = run("check", "sapo", "--param", "tau_neg=2.0")
    assert out.exit_code == 0, out.output
    assert "masked_poison" in out.output and "✓ sapo conforms" in out.output
    assert run("check", "ppo_clip").exit_code == 0
    plugin = FlippedSignPlugin()
    lossplug.register_plugin(plugin, "flipped")
    try:
        out = run("check", "flipped_pg")
    finally:
        lossplug.unregister_plugin(plugin)
    assert out.exit_code == 1
    assert "ratio_one" in out.output and "sign is flipped" in out.output
    assert run("check", "no_such_gate").exit_code == 1


def test_check_shows_the_checks_a_failure_blocks(register_gates):
    @lossplug.gate("undetached_weight", requires=("behavior_logp",), role="correction")
    def undetached_weight(inp, p):
        """min(π_θ/π_behaviour, 2), not detached."""
        return lossplug.GateOutput(weight=(inp.logp - inp.behavior_logp).clamp(-20, 20).exp().clamp(max=2.0))

    register_gates(undetached_weight, name="cli-blocked")
    out = run("check", "undetached_weight")
    assert out.exit_code == 1
    text = " ".join(out.output.split())
    assert "✗ 1 check(s) failed, 8 blocked by a failure" in text
    assert text.count("– blocked") == 8 and "blocked by detached" in text


def test_check_a_plugin_whose_import_failed_says_so_and_why(site):
    site.add("lpx-broken-gates", "lpx_broken_gates", "raise ImportError('needs libfancy >= 2')")
    out = run("check", "lpx_fancy_gate")
    assert out.exit_code == 1
    text = " ".join(out.output.split())
    assert "unknown gate plugin 'lpx_fancy_gate'" in text
    assert "entry point 'lpx_broken_gates = lpx_broken_gates' of distribution 'lpx-broken-gates 0.1'" in text
    assert "failed to import: ImportError: needs libfancy >= 2" in text
    assert "Is the distribution" not in text


def test_check_an_unknown_name_without_import_failures_asks_whether_it_is_installed(fresh_registry):
    text = " ".join(run("check", "no_such_gate").output.split())
    assert "Is the distribution that provides it installed" in text


class FlippedSignPlugin:
    """A gate that returns the loss instead of the objective: the kit must catch it."""

    @lossplug.hookimpl
    def lossplug_register_gates(self, register):
        @lossplug.gate("flipped_pg")
        def flipped_pg(inp, p):
            """−A·logp (wrong on purpose)."""
            return lossplug.GateOutput(objective=-inp.advantage * inp.logp)

        register(flipped_pg)


def test_plot_gates_writes_a_png_through_the_real_plugins(tmp_path):
    pytest.importorskip("matplotlib")
    gates = ["ppo_clip", "ppo_clip:dual_clip_c=3", "sapo", "icepop:low=0.8,high=2"]
    out = run("plot", "gates", "--out", str(tmp_path / "gates.png"), *[a for g in gates for a in ("--gate", g)])
    assert out.exit_code == 0, out.output
    assert "wrote" in out.output and "(4 gates)" in out.output
    png = (tmp_path / "gates.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    width, height = struct.unpack(">II", png[16:24])
    assert width > 1000 and height > 300


def test_plot_default_covers_every_gate_and_dual_clip():
    pytest.importorskip("numpy")  # gate_coefficients returns a NumPy array
    from lossplug.cli.app import _gate_specs
    from lossplug.cli.gate_curves import NOT_PLOTTED, gate_coefficients

    specs = _gate_specs(None)
    names = [s["name"] for s in specs]
    # every gate but those left out with a reason (their curve would be reinforce's flat line)
    assert set(names) | set(NOT_PLOTTED) == set(lossplug.registry().plugins["gate"])
    assert not set(names) & set(NOT_PLOTTED) and all(NOT_PLOTTED.values())
    assert {"dual_clip_c": 3.0, "name": "ppo_clip"} in specs
    for spec in specs:
        for adv in (1.0, -1.0):
            coef = gate_coefficients(spec, [0.3, 1.0, 3.5], adv)
            assert coef[1] == pytest.approx(adv, rel=1e-6), spec  # every gate is the policy gradient at ratio 1


def test_plot_gate_coefficients_are_the_gradients():
    pytest.importorskip("numpy")  # gate_coefficients returns a NumPy array
    from lossplug.cli.gate_curves import gate_coefficients

    r = [0.5, 0.9, 1.0, 1.1, 1.5]
    assert gate_coefficients({"name": "ppo_clip"}, r, 1.0).tolist() == pytest.approx([0.5, 0.9, 1.0, 1.1, 0.0])
    assert gate_coefficients({"name": "ppo_clip"}, r, -1.0).tolist() == pytest.approx([0.0, -0.9, -1.0, -1.1, -1.5])
    assert gate_coefficients({"name": "cispo"}, r, 1.0).tolist() == pytest.approx([0.8, 0.9, 1.0, 1.1, 1.2])
    assert gate_coefficients({"name": "tis", "cap": 1.2}, r, 1.0).tolist() == pytest.approx([0.5, 0.9, 1.0, 1.1, 1.2])
    out = run("plot", "gates", "--gate", "no_such_gate", "--out", "/dev/null")
    assert out.exit_code == 2 and "unknown gate plugin 'no_such_gate'" in out.output


# ---------------------------------------------------------------------------------------------------------------------
# a missing optional extra: one line naming it, exit 2, no traceback


def _without(monkeypatch, *modules):
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # `import module` raises, as where it is not installed


@pytest.mark.parametrize(
    ("args", "hidden", "line"),
    [
        (("demo", "--fast"), "trl", "lossplug demo needs trl, which is not installed: pip install 'lossplug[demo]'"),
        (
            ("demo", "--compare", "grpo,dapo"),
            "transformers",
            "lossplug demo needs transformers, which is not installed: pip install 'lossplug[demo]'",
        ),
        (
            ("demo", "--fast"),
            "matplotlib",  # checked before training, not after minutes of it when curves.png is drawn
            "lossplug demo needs matplotlib, which is not installed: pip install 'lossplug[demo]'",
        ),
        (
            ("plot", "gates"),
            "matplotlib",
            "lossplug plot gates needs matplotlib, which is not installed: pip install 'lossplug[plot]'",
        ),
    ],
)
def test_a_command_without_its_extra_names_it_in_one_line(monkeypatch, tmp_path, args, hidden, line):
    _without(monkeypatch, hidden)
    out = run(*args, "--out", str(tmp_path / "out"))
    assert (out.exit_code, out.stderr.strip(), out.stdout) == (2, f"error: {line}", "")
    assert not (tmp_path / "out").exists()


def test_the_gate_plot_helper_without_matplotlib_names_the_plot_extra(monkeypatch, tmp_path):
    from lossplug.cli.gate_curves import plot_gates

    _without(monkeypatch, "matplotlib")
    with pytest.raises(lossplug.MissingExtra) as info:
        plot_gates(tmp_path / "gates.png", [{"name": "ppo_clip"}])
    assert str(info.value) == (
        "lossplug.cli.gate_curves.plot_gates needs matplotlib, which is not installed: pip install 'lossplug[plot]'"
    )


def test_a_missing_extra_met_anywhere_in_a_command_is_one_line(monkeypatch):
    from lossplug.cli import describe

    def needs_verl(recipe):
        import verl  # noqa: F401

    monkeypatch.setattr(describe, "explain_recipe", needs_verl)
    _without(monkeypatch, "verl")
    out = run("recipe", "explain", "dapo")
    assert out.exit_code == 2
    assert out.stderr.strip() == (
        "error: lossplug recipe explain needs verl, which is not installed: pip install 'lossplug[verl]'"
    )


def test_an_import_error_that_is_no_extra_is_not_disguised_as_one(monkeypatch):
    from lossplug.cli import describe

    def broken(recipe):
        import lossplug_no_such_module  # noqa: F401

    monkeypatch.setattr(describe, "explain_recipe", broken)
    result = CliRunner().invoke(app, ["recipe", "explain", "dapo"], env=WIDE)
    assert isinstance(result.exception, ModuleNotFoundError) and "pip install" not in result.output


@pytest.mark.slow
def test_lossplug_demo_without_trl_prints_one_line_and_exits_2(tmp_path):
    """The issue as a user met it: `lossplug demo` where TRL is not installed printed a 40-line traceback."""
    code = (
        "import sys\n"
        "sys.modules['trl'] = None  # as where TRL is not installed\n"
        "sys.argv = ['lossplug', 'demo', '--fast', '--out', sys.argv[1]]\n"
        "from lossplug.cli import main\n"
        "main()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "60", "NO_COLOR": "1"},  # narrower than the line: not broken, copy-pasteable
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == "error: lossplug demo needs trl, which is not installed: pip install 'lossplug[demo]'\n"
