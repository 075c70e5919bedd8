"""Which ``lossplug`` entry points the plugin registry loads, read from the installed distributions' metadata.

Every plugin module is found the same way: through the ``lossplug`` entry-point group. lossplug's own distribution
declares its built-in plugin modules there (``[project.entry-points.lossplug]`` in its ``pyproject.toml``), exactly
as a third-party package declares its own. What sets the built-ins apart is only their distribution:

* the **built-ins** — the entry points of the distribution named ``lossplug`` — always load; without them no recipe
  could be checked, so neither switch below applies to them;
* a **third-party** entry point loads unless ``LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD=1`` (entry points run arbitrary
  code, as pytest's plugins do), and, when ``LOSSPLUG_PLUGINS=a,b`` is set, only if ``a`` or ``b`` names it or its
  distribution (an empty value loads none).

Nothing here imports a plugin, or torch: the command line keys its catalogue cache on this selection
(:mod:`lossplug.cli.catalogue`) before deciding whether it needs the registry at all.
"""

from __future__ import annotations

import importlib.metadata as md
import os
from dataclasses import dataclass

from .plugin_names import BUILTIN_PROVIDER, canonical_provider

ENTRY_POINT_GROUP = "lossplug"
DISABLE_ENV = "LOSSPLUG_DISABLE_PLUGIN_AUTOLOAD"
ALLOW_ENV = "LOSSPLUG_PLUGINS"


def distribution_name(ep: md.EntryPoint) -> str | None:
    """The name of the distribution that declares the entry point (None when metadata does not say)."""
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else None


def is_builtin_distribution(name: str) -> bool:
    """Whether a distribution name (in any spelling) is lossplug's own."""
    return canonical_provider(name) == BUILTIN_PROVIDER


def is_builtin(ep: md.EntryPoint) -> bool:
    """Whether the entry point is one of lossplug's built-ins: declared by the ``lossplug`` distribution itself."""
    name = distribution_name(ep)
    return name is not None and is_builtin_distribution(name)


def autoload_disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes")


def allow_list() -> set[str] | None:
    """The names ``LOSSPLUG_PLUGINS`` allows (entry-point or distribution names); None when it is not set."""
    text = os.environ.get(ALLOW_ENV)
    return {s.strip() for s in text.split(",") if s.strip()} if text is not None else None


def _names(ep: md.EntryPoint) -> set[str]:
    return {ep.name, distribution_name(ep) or ep.name}


@dataclass(frozen=True)
class Selection:
    """The entry points to load: ``builtin`` (lossplug's own), ``third_party`` (those the switches allow), and
    ``unmatched``: names in the allow-list that no installed entry point or distribution has."""

    builtin: tuple[md.EntryPoint, ...]
    third_party: tuple[md.EntryPoint, ...]
    unmatched: tuple[str, ...]


def select() -> Selection:
    """The ``lossplug`` entry points the registry loads now (the environment variables are read on every call)."""
    every = list(md.entry_points(group=ENTRY_POINT_GROUP))
    builtin = tuple(ep for ep in every if is_builtin(ep))
    others = [ep for ep in every if not is_builtin(ep)]
    allow = allow_list()
    if autoload_disabled():
        return Selection(builtin, (), ())
    if allow is None:
        return Selection(builtin, tuple(others), ())
    third_party = tuple(ep for ep in others if _names(ep) & allow)
    known = set().union(*(_names(ep) for ep in every))
    return Selection(builtin, third_party, tuple(sorted(allow - known)))
