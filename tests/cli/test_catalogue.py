"""The shipped catalogue snapshot: current, equal to the registry's, and what makes ``list``/``show`` torch-free."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lossplug.cli import catalogue


def _run(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LOSSPLUG_")} | env
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=environ
    ).stdout.strip()


def test_the_shipped_snapshot_is_current():
    data = json.loads(catalogue.SNAPSHOT.read_text(encoding="utf-8"))
    assert data["digest"] == catalogue.sources_digest(), (
        "core/cli/catalogue.json is stale: a plugin, contract or kernel module changed since it was written; "
        "run `python -m lossplug.cli.catalogue --write` and commit it"
    )


def test_the_snapshot_says_what_the_registry_says():
    snapshot = json.loads(catalogue.SNAPSHOT.read_text(encoding="utf-8"))
    snapshot.pop("digest")
    live = json.loads(_run("import json; from lossplug.cli import catalogue; print(json.dumps(catalogue.live()))",
                           LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD="1"))  # fmt: skip
    assert snapshot.keys() == live.keys()
    for key in snapshot:
        assert snapshot[key] == live[key], key


@pytest.mark.parametrize("argv", [["list"], ["show", "ppo_clip"], ["show", "dapo"], ["list", "--json"], ["--version"]])
def test_list_show_and_version_import_no_torch(argv):
    code = (
        "import sys; from lossplug.cli import app\n"
        f"try: app({argv!r})\n"
        "except SystemExit as e: assert not e.code, e.code\n"
        "print('torch' in sys.modules, file=sys.stderr)"
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LOSSPLUG_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=environ)
    assert done.stdout
    assert done.stderr.strip().splitlines()[-1] == "False", done.stderr


def test_a_third_party_entry_point_or_an_edited_source_falls_back_to_the_registry(monkeypatch, tmp_path):
    monkeypatch.delenv(catalogue.DISABLE_ENV, raising=False)
    monkeypatch.delenv(catalogue.ALLOW_ENV, raising=False)
    monkeypatch.setattr(catalogue, "third_party_may_load", lambda: True)
    assert _snapshot_without_registry() is None
    monkeypatch.setattr(catalogue, "third_party_may_load", lambda: False)
    stale = tmp_path / "catalogue.json"
    stale.write_text(json.dumps({"digest": "0" * 64}))
    monkeypatch.setattr(catalogue, "SNAPSHOT", stale)
    assert _snapshot_without_registry() is None


def _snapshot_without_registry():
    saved = sys.modules.pop("lossplug.plugin_registry", None)
    try:
        return catalogue.snapshot()
    finally:
        if saved is not None:
            sys.modules["lossplug.plugin_registry"] = saved


def test_the_entry_point_names_are_the_registrys():
    from lossplug import plugin_registry

    assert (catalogue.ENTRY_POINT_GROUP, catalogue.DISABLE_ENV, catalogue.ALLOW_ENV) == (
        plugin_registry.ENTRY_POINT_GROUP,
        plugin_registry.DISABLE_ENV,
        plugin_registry.ALLOW_ENV,
    )


def test_version_reports_what_a_run_record_holds():
    from typer.testing import CliRunner

    from lossplug.cli import app
    from lossplug.versions import installed

    out = CliRunner().invoke(app, ["--version"]).output.strip()
    versions = installed()
    assert out == "  ".join(f"{k} {v}" for k, v in versions.items())
    assert {"lossplug", "python", "torch"} <= versions.keys()
