"""What ``lossplug list`` and ``lossplug show`` print, without importing torch when nothing but the built-ins is
installed.

The plugins are Python modules that import torch (1–2 s); listing them should not cost that. So the built-in
catalogue is also kept as data, ``catalogue.json`` beside this module, written from the live registry by
``python -m lossplug.cli.catalogue --write``. It is read only while it provably says what the registry would:

* its ``digest`` equals the SHA-256 of the sources it was made from (every module of ``lossplug.contracts`` and
  ``lossplug.plugins``, the kernel modules directly under ``lossplug`` and :mod:`lossplug.cli.describe`), so an
  edited plugin or docstring falls back to the registry instead of printing stale text;
* no third-party plugin would load: no distribution declares a ``lossplug`` entry point, or autoloading is off
  (``LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD``), or the allow-list ``LOSSPLUG_PLUGINS`` is empty;
* this process has not imported the registry (then torch is loaded anyway, and a plugin registered in-process, as
  tests do, is seen).

Otherwise the registry is built as before. Both paths give the same data: the live one is passed through JSON too,
so defaults print alike (``tests/cli/test_catalogue.py`` compares them and checks the shipped file is current).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lossplug.plugin_registry import Registry

SNAPSHOT = Path(__file__).with_name("catalogue.json")


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(name)
    return Path(next(iter(spec.submodule_search_locations)))


def sources() -> list[Path]:
    """The files the catalogue is derived from, in a fixed order."""
    core = _package_dir("lossplug")
    files = sorted(core.glob("*.py")) + [core / "cli" / "describe.py"]
    for package in ("lossplug.contracts", "lossplug.plugins"):
        files += sorted(_package_dir(package).rglob("*.py"))
    return files


def sources_digest() -> str:
    """SHA-256 over the sources' relative names and contents."""
    h = hashlib.sha256()
    for path in sources():
        h.update(f"{path.parent.name}/{path.name}\0".encode())
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


#: lossplug.plugin_registry's entry-point group and variables (that module imports torch; a test keeps them equal)
ENTRY_POINT_GROUP, DISABLE_ENV, ALLOW_ENV = "lossplug", "LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD", "LOSSPLUG_PLUGINS"


def third_party_may_load() -> bool:
    """Whether building the registry would load a plugin from outside lossplug (see the module docstring)."""
    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes"):
        return False
    if os.environ.get(ALLOW_ENV) is not None and not os.environ[ALLOW_ENV].strip():
        return False
    return any(True for _ in md.entry_points(group=ENTRY_POINT_GROUP))


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
    as_json: dict[str, Any] = json.loads(json.dumps(data, default=str))
    return as_json


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


def snapshot() -> dict[str, Any] | None:
    """The shipped built-in catalogue, or None when it may not say what the registry would."""
    if "lossplug.plugin_registry" in sys.modules:
        return None  # torch is loaded already, and plugins may have been registered in this process
    if not SNAPSHOT.is_file() or third_party_may_load():
        return None
    data: dict[str, Any] = json.loads(SNAPSHOT.read_text(encoding="utf-8"))
    return data if data.get("digest") == sources_digest() else None


def current() -> dict[str, Any]:
    """The catalogue: the shipped snapshot when it holds, else the registry's."""
    return snapshot() or live()


def write() -> Path:
    """Write the snapshot from the live registry (built-ins only)."""
    os.environ[DISABLE_ENV] = "1"
    data = {"digest": sources_digest(), **live()}
    SNAPSHOT.write_text(json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    return SNAPSHOT


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m lossplug.cli.catalogue --write")
    print(f"wrote {write()}")
