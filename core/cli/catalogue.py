"""What ``lossplug list`` and ``lossplug show`` print, without importing torch once it has been worked out.

The catalogue — every registered plugin with its docs and parameters, every preset explained — comes from the plugin
registry, which imports every plugin and so torch (1–2 s). Listing should not cost that each time, so the first call
keeps the catalogue as JSON in the user's cache directory (:func:`cache_dir`), under a key (:func:`cache_key`) that
changes whenever the registry's answer could:

* every entry point the registry would load (:func:`lossplug.plugin_discovery.select`: lossplug's built-ins, and the
  third-party ones ``LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD`` / ``LOSSPLUG_PLUGINS`` allow), with its distribution's name,
  version and installed-files record (``RECORD``: a reinstall of the same version with other files changes it);
* a digest of the sources of lossplug's own library (kernel, command line, contracts, plugins: an edited built-in
  must not print stale text), and of a third party's entry-point packages when it is installed editable (PEP 610):
  the version and record of an editable install stay the same while its sources change;
* lossplug's version, this catalogue's format, and the versions of Python and pydantic (which writes the parameter
  schemas).

Computing the key reads metadata and source files (a few milliseconds); it imports no plugin. A miss builds the
catalogue from the registry once and writes it atomically (a temporary file renamed into place), so concurrent
processes never read half a file; a file that cannot be read or parsed is ignored and replaced, and a cache
directory that cannot be written only means the next call builds again. Nothing is kept while a plugin is broken
(its import may fail for a reason no key sees, a dependency installed since, say), and a process that has already
built the registry answers from it directly: plugins registered in-process (notebooks, tests) are part of it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lossplug import plugin_discovery

if TYPE_CHECKING:
    from lossplug.plugin_registry import Registry

#: where the cache lives instead of the platform's cache directory (tests, read-only homes, CI)
CACHE_ENV = "LOSSPLUG_CACHE_DIR"
#: bumped when the catalogue's layout changes, so that no older file is read as a newer one
FORMAT = 1
#: how many catalogues are kept (one per key: several environments or source states in turn)
KEEP = 8
_KEYS = ("kinds", "plugins", "rows", "presets", "broken", "duplicates", "clashes")


# ---------------------------------------------------------------------------------------------------------------------
# The catalogue from the registry


def quiet_registry() -> Registry:
    """The plugin registry, built without raising broken plugins as Python warnings: the commands show them, in red."""
    import warnings

    from lossplug.plugin_registry import LossplugPluginWarning, registry

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LossplugPluginWarning)
        return registry()


def live() -> dict[str, Any]:
    """The catalogue from the registry (imports every plugin, hence torch), as JSON data."""
    import lossplug
    from lossplug.contracts import Recipe
    from lossplug.kinds import KINDS

    from .describe import distribution, explain_recipe, parameters, plugin_info

    reg = quiet_registry()
    rows = lossplug.list_plugins()
    for row in rows:
        row["distribution"] = distribution(row["source"])
    plugins = {}
    for kind in KINDS:
        for name, plugin in sorted(reg.plugins.get(kind, {}).items()):
            info = plugin_info(kind, name, plugin, reg.origin(kind, name))
            info["parameters"] = parameters(plugin)
            info["qualified"] = reg.qualified_name(kind, name)
            plugins[f"{kind}:{name}"] = info
    data = {
        "kinds": list(KINDS),
        "plugins": plugins,
        "rows": rows,
        "presets": {name: explain_recipe(Recipe.preset(name)) for name in sorted(reg.presets)},
        "broken": [{"origin": b.origin, "error": b.error} for b in reg.broken],
        "duplicates": [{"kind": k, "name": n, "sources": list(v)} for (k, n), v in reg.duplicates.items()],
        "clashes": [
            {"kind": c.kind, "name": c.name, "qualified": [q for q, _ in c.others], "message": c.message()}
            for c in reg.clashes
        ],
    }
    # through JSON, so that a fresh catalogue prints exactly as a cached one (defaults, tuples, enums)
    as_json: dict[str, Any] = json.loads(json.dumps(data, default=str))
    return as_json


def current() -> dict[str, Any]:
    """The catalogue: the cached one when its key holds, else the registry's (then cached)."""
    if "lossplug.plugin_registry" in sys.modules:
        return live()  # torch is loaded already, and plugins may have been registered in this process
    return cached_or_built()


def cached_or_built() -> dict[str, Any]:
    """The cached catalogue of the current key, else the registry's, cached unless a plugin is broken."""
    key = cache_key()
    cached = read_cache(key)
    if cached is not None:
        return cached
    data = live()
    if not data["broken"]:
        write_cache(key, data)
    return data


# ---------------------------------------------------------------------------------------------------------------------
# The key


def _digest_files(files: Iterable[tuple[str, Path]]) -> str:
    """SHA-256 over (name, contents) pairs, in name order."""
    h = hashlib.sha256()
    for name, path in sorted(files):
        h.update(f"{name}\0".encode())
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def _package_dirs(name: str) -> list[Path]:
    """The folders of an importable package (none for a plain module); imports at most its parent packages."""
    spec = importlib.util.find_spec(name)
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []


def _module_files(name: str) -> list[tuple[str, Path]]:
    """Every source file of a package (or the one file of a module), named relative to where it lives."""
    dirs = _package_dirs(name)
    if dirs:
        return [(f"{name}/{p.relative_to(d).as_posix()}", p) for d in dirs for p in d.rglob("*.py")]
    spec = importlib.util.find_spec(name)
    origin = Path(spec.origin) if spec is not None and spec.origin else None
    return [(name, origin)] if origin is not None and origin.is_file() else []


def lossplug_sources() -> list[tuple[str, Path]]:
    """What lossplug's catalogue is made from: the kernel's modules and the command line (the registry, the plugin
    classes, what a plugin needs, how a preset is explained), the contracts and every built-in plugin. Its folders are
    not its package names (``package-dir``), so each package is located by import, never by path."""
    core = _package_dirs("lossplug")
    files = [(f"lossplug/{p.name}", p) for d in core for p in d.glob("*.py")]
    files += [(f"lossplug/cli/{p.name}", p) for d in core for p in (d / "cli").glob("*.py")]
    return files + _module_files("lossplug.contracts") + _module_files("lossplug.plugins")


def _editable(dist: md.Distribution) -> bool:
    """Whether pip installed the distribution in editable mode (PEP 610's ``direct_url.json``)."""
    try:
        direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        return False
    return bool(direct_url.get("dir_info", {}).get("editable"))


def _distribution_part(name: str, dist: md.Distribution, modules: set[str]) -> str:
    record = dist.read_text("RECORD") or ""
    part = f"distribution {name} {dist.version} record {hashlib.sha256(record.encode()).hexdigest()}"
    if plugin_discovery.is_builtin_distribution(name):
        # always, not only when PEP 610 says editable: from a source checkout the metadata found first may be the
        # checkout's own egg-info (the current folder is on sys.path), which says nothing of how it is installed;
        # reading lossplug's hundred-odd files costs a few milliseconds
        part += f" sources {_digest_files(lossplug_sources())}"
    elif _editable(dist):
        part += f" sources {_digest_files(f for top in sorted(modules) for f in _module_files(top))}"
    return part


def cache_key() -> str:
    """What the catalogue depends on, as a SHA-256 (see the module docstring); imports no plugin."""
    import lossplug

    selection = plugin_discovery.select()
    parts = [f"format {FORMAT}", f"lossplug {lossplug.__version__}", f"python {sys.version}"]
    parts.append(f"pydantic {md.version('pydantic')}")
    dists: dict[str, tuple[md.Distribution, set[str]]] = {}
    for ep in (*selection.builtin, *selection.third_party):
        parts.append(f"entry point {ep.name} = {ep.value}")
        dist = getattr(ep, "dist", None)
        if dist is not None:
            top = ep.value.partition(":")[0].strip().split(".")[0]  # the package a third party's sources are in
            dists.setdefault(dist.name, (dist, set()))[1].add(top)
    parts += [_distribution_part(name, dist, modules) for name, (dist, modules) in sorted(dists.items())]
    return hashlib.sha256("\n".join(sorted(parts)).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------------
# The cache


def cache_dir() -> Path:
    """``$LOSSPLUG_CACHE_DIR``, else the platform's user cache directory (as platformdirs names it):
    ``$XDG_CACHE_HOME/lossplug`` or ``~/.cache/lossplug`` on Linux, ``~/Library/Caches/lossplug`` on macOS,
    ``%LOCALAPPDATA%\\lossplug\\Cache`` on Windows."""
    override = os.environ.get(CACHE_ENV, "").strip()
    if override:
        return Path(override).expanduser()
    if sys.platform == "win32":
        return Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local") / "lossplug" / "Cache"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "lossplug"
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "lossplug"


def cache_path(key: str) -> Path:
    return cache_dir() / f"catalogue-{key[:32]}.json"


def read_cache(key: str) -> dict[str, Any] | None:
    """The cached catalogue of this key; None when there is none, or it cannot be read or is not one."""
    path = cache_path(key)
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    data = stored.get("catalogue") if isinstance(stored, dict) and stored.get("key") == key else None
    if not isinstance(data, dict) or not all(k in data for k in _KEYS):
        return None
    try:
        os.utime(path)  # recently used: kept when older catalogues are pruned
    except OSError:
        pass
    return data


def write_cache(key: str, data: dict[str, Any]) -> bool:
    """Store the catalogue of this key atomically and prune the oldest; False when the directory is not writable."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=".catalogue-", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"key": key, "catalogue": data}, f, ensure_ascii=False)
            os.replace(temporary, cache_path(key))
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError:
        return False
    _prune(folder)
    return True


def _prune(folder: Path) -> None:
    def used(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:
            return 0.0

    for old in sorted(folder.glob("catalogue-*.json"), key=used, reverse=True)[KEEP:]:
        try:
            old.unlink()
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------------------------------
# Names


def resolve(catalogue: dict[str, Any], kind: str, name: str) -> str:
    """The name under which the catalogue lists a bare or qualified plugin or preset name of this kind
    (``my_gates:ppo_clip`` → ``my-gates:ppo_clip``; ``lossplug:ppo_clip`` → ``ppo_clip``)."""
    from lossplug.plugin_names import canonical

    wanted = canonical(name)
    found = (row["name"] for row in catalogue["rows"] if row["kind"] == kind and row.get("qualified") == wanted)
    return next(found, wanted)


def ambiguity(catalogue: dict[str, Any], kinds: list[str], name: str) -> str | None:
    """Why a bare name lists nothing though distributions registered it: several did, and none is built in."""
    clashes = catalogue.get("clashes", [])
    listed = {(row["kind"], row["name"]) for row in catalogue["rows"]}
    ambiguous = (c for c in clashes if c["name"] == name and c["kind"] in kinds and (c["kind"], name) not in listed)
    return next((c["message"] for c in ambiguous), None)
