"""``lossplug list`` / ``show`` answer from a catalogue cached in the user's cache directory: built from the registry
once (torch imported then), read without torch afterwards, and keyed so that a new distribution version, a switch
that changes which entry points load, or an edited source gives a fresh one. A cache that cannot be read or
written costs time, never a wrong answer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lossplug.cli import catalogue

THIRD_PARTY_GATE = """
import lossplug


@lossplug.gate("half_pg")
def half_pg(inp, p):
    \"\"\"½ · A · logp.\"\"\"
    return lossplug.GateOutput(objective=0.5 * inp.advantage * inp.logp)


@lossplug.hookimpl
def lossplug_register_gates(register):
    register(half_pg)
"""

SHOW_CATALOGUE = (
    "import json, sys; from lossplug.cli import catalogue\n"
    "print(json.dumps(catalogue.current()))\n"
    "print('torch' in sys.modules, file=sys.stderr)"
)


def run(code: str, cache: Path, *, site: Path | None = None, **env: str) -> tuple[str, bool]:
    """Run ``code`` in a fresh interpreter with this cache folder (and a fake site-packages on its path); its
    stdout, and whether it imported torch (the last line the code prints to stderr)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LOSSPLUG_")}
    environ |= {catalogue.CACHE_ENV: str(cache), **env}
    if site is not None:
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=environ, cwd=cache.parent
    )
    return done.stdout, done.stderr.strip().splitlines()[-1] == "True"


def cli(argv: list[str]) -> str:
    return (
        "import sys; from lossplug.cli import app\n"
        f"try: app({argv!r})\n"
        "except SystemExit as e: assert not e.code, e.code\n"
        "print('torch' in sys.modules, file=sys.stderr)"
    )


def cached_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("catalogue-*.json"))


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> tuple[Path, dict]:
    """A cache folder after one cold call, and the catalogue that call printed."""
    cache = tmp_path_factory.mktemp("warm") / "cache"
    out, torch_imported = run(SHOW_CATALOGUE, cache)
    assert torch_imported  # cold: built from the registry
    return cache, json.loads(out)


def test_a_cold_call_caches_what_the_registry_says(warm):
    cache, built = warm
    [path] = cached_files(cache)
    stored = json.loads(path.read_text(encoding="utf-8"))
    assert stored["catalogue"] == built and path.name == f"catalogue-{stored['key'][:32]}.json"
    assert "gate:ppo_clip" in built["plugins"] and "dapo" in built["presets"]
    assert built["broken"] == built["clashes"] == []


def test_a_warm_call_reads_the_same_catalogue_without_torch(warm):
    cache, built = warm
    out, torch_imported = run(SHOW_CATALOGUE, cache)
    assert json.loads(out) == built and not torch_imported
    assert len(cached_files(cache)) == 1


@pytest.mark.parametrize("argv", [["list"], ["show", "ppo_clip"], ["show", "dapo"], ["list", "--json"], ["--version"]])
def test_list_show_and_version_import_no_torch_once_warm(warm, argv):
    out, torch_imported = run(cli(argv), warm[0])
    assert out and not torch_imported


def test_a_corrupt_cache_file_is_ignored_and_rebuilt(warm, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(warm[0], cache)
    [path] = cached_files(cache)
    path.write_text('{"key": "', encoding="utf-8")  # a write cut short (the cache never writes one: it renames)
    out, torch_imported = run(SHOW_CATALOGUE, cache)
    assert json.loads(out) == warm[1] and torch_imported
    assert json.loads(path.read_text(encoding="utf-8"))["catalogue"] == warm[1]


def test_a_third_party_plugin_is_listed_and_the_warm_path_stays_torch_free(site, tmp_path):
    site.add("lpx-half", "lpx_half", THIRD_PARTY_GATE)
    cache = tmp_path / "cache"
    listed = cli(["list", "--json", "--kind", "gate"])
    for expect_torch in (True, False):  # cold, then warm
        out, torch_imported = run(listed, cache, site=site.path)
        rows = {r["name"]: r for r in json.loads(out)["plugins"]}
        assert rows["half_pg"]["distribution"] == "lpx-half 0.1" and "ppo_clip" in rows
        assert torch_imported is expect_torch
    out, torch_imported = run(cli(["show", "half_pg"]), cache, site=site.path)
    assert "½ · A · logp" in out and not torch_imported
    # with autoloading off the entry point does not load: another key, another catalogue
    out, _ = run(listed, cache, site=site.path, LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD="1")
    assert "half_pg" not in {r["name"] for r in json.loads(out)["plugins"]}
    assert len(cached_files(cache)) == 2


def test_the_key_follows_the_installed_distributions_and_the_switches(site, monkeypatch):
    site.add("lpx-half", "lpx_half", THIRD_PARTY_GATE)
    first = catalogue.cache_key()
    assert catalogue.cache_key() == first
    monkeypatch.setenv("LOSSPLUG_PLUGINS", "lpx-half")  # allows what loads anyway: the same entry points
    assert catalogue.cache_key() == first
    monkeypatch.setenv("LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert catalogue.cache_key() != first
    monkeypatch.delenv("LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD")
    monkeypatch.delenv("LOSSPLUG_PLUGINS")
    (info,) = site.path.glob("lpx_half-*.dist-info")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lpx-half\nVersion: 0.2\n")
    info.rename(site.path / "lpx_half-0.2.dist-info")
    assert catalogue.cache_key() != first


def test_an_edited_source_of_an_editable_plugin_changes_the_key(site):
    site.add("lpx-half", "lpx_half", THIRD_PARTY_GATE)
    (info,) = site.path.glob("lpx_half-*.dist-info")
    (info / "direct_url.json").write_text('{"url": "file:///src/lpx-half", "dir_info": {"editable": true}}')
    before = catalogue.cache_key()
    (site.path / "lpx_half" / "__init__.py").write_text(THIRD_PARTY_GATE.replace("½", "one half"))
    assert catalogue.cache_key() != before


def test_an_edited_builtin_changes_the_key(monkeypatch, tmp_path):
    import lossplug.plugins
    from lossplug.plugins.gates import ppo_clip

    sources = catalogue.lossplug_sources()
    digested = {path.resolve() for _, path in sources}
    plugins = Path(lossplug.plugins.__file__).parent
    assert set(plugins.rglob("*.py")) <= digested and Path(ppo_clip.__file__).resolve() in digested
    assert Path(catalogue.__file__).resolve() in digested  # the catalogue's own format too
    copy = tmp_path / "ppo_clip.py"
    copy.write_text(Path(ppo_clip.__file__).read_text())
    monkeypatch.setattr(catalogue, "lossplug_sources", lambda: [*sources, ("lossplug/plugins/gates/ppo_clip.py", copy)])
    before = catalogue.cache_key()
    copy.write_text(copy.read_text().replace("PPO", "P.P.O."))
    assert catalogue.cache_key() != before


def test_reading_and_writing_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(catalogue.CACHE_ENV, str(tmp_path / "cache"))
    data = {key: [] for key in ("kinds", "rows", "broken", "duplicates", "clashes")} | {"plugins": {}, "presets": {}}
    key = "a" * 64
    assert catalogue.read_cache(key) is None
    assert catalogue.write_cache(key, data) and catalogue.read_cache(key) == data
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [f"catalogue-{'a' * 32}.json"]  # no temporary left
    path = catalogue.cache_path(key)
    for foreign in ("not json", "[]", json.dumps({"key": "b" * 64, "catalogue": data}), json.dumps({"key": key})):
        path.write_text(foreign)
        assert catalogue.read_cache(key) is None, foreign
    for n in range(catalogue.KEEP + 3):  # the least recently used are pruned
        assert catalogue.write_cache(f"{n:032d}" + "f" * 32, data)
    assert len(cached_files(tmp_path / "cache")) == catalogue.KEEP
    assert catalogue.read_cache(f"{catalogue.KEEP + 2:032d}" + "f" * 32) == data
    unwritable = tmp_path / "a-file"
    unwritable.write_text("")
    monkeypatch.setenv(catalogue.CACHE_ENV, str(unwritable))
    assert not catalogue.write_cache(key, data) and catalogue.read_cache(key) is None


def test_a_catalogue_with_a_broken_plugin_is_not_kept(monkeypatch, tmp_path):
    monkeypatch.setenv(catalogue.CACHE_ENV, str(tmp_path))
    broken = {"kinds": [], "plugins": {}, "rows": [], "presets": {}, "duplicates": [], "clashes": []}
    broken["broken"] = [{"origin": "entry point 'x = x'", "error": "failed to import: ModuleNotFoundError"}]
    monkeypatch.setattr(catalogue, "live", lambda: broken)
    assert catalogue.cached_or_built() == broken
    assert cached_files(tmp_path) == []


def test_the_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv(catalogue.CACHE_ENV, str(tmp_path))
    assert catalogue.cache_dir() == tmp_path
    monkeypatch.delenv(catalogue.CACHE_ENV)
    if sys.platform.startswith("linux"):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert catalogue.cache_dir() == tmp_path / "xdg" / "lossplug"
        monkeypatch.delenv("XDG_CACHE_HOME")
        assert catalogue.cache_dir() == Path.home() / ".cache" / "lossplug"


def test_version_reports_what_a_run_record_holds():
    from typer.testing import CliRunner

    from lossplug.cli import app
    from lossplug.versions import installed

    out = CliRunner().invoke(app, ["--version"]).output.strip()
    versions = installed()
    assert out == "  ".join(f"{k} {v}" for k, v in versions.items())
    assert {"lossplug", "python", "torch"} <= versions.keys()
