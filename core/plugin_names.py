"""Plugin and preset names when more than one distribution registers the same one.

A name is registered by a *provider*: the distribution of the entry point that registered it (its
``importlib.metadata`` name), ``lossplug`` for the built-ins, or the name given to
``lossplug.register_plugin`` for a plugin registered in-process (by default the module's ``__name__``). Every
registered name is also reachable as ``<provider>:<name>`` (``my-gates:ppo_clip``, ``lossplug:ppo_clip``), where the
provider is written in its canonical form — the normalised name of the Python packaging specification (PEP 503;
``packaging.utils.canonicalize_name``): lowercase, every run of ``-``, ``_`` and ``.`` (and ``:``, which only an
in-process name can hold) one ``-``. A qualified name is canonicalised before it is looked up, so
``My_Gates:ppo_clip`` and ``my-gates:ppo_clip`` are the same name; the part after the (first) colon is the plugin's
own name, taken as it is — which is why a plugin or preset name may not contain a colon.

When one name is registered by more than one provider (:func:`settle`):

* one of them is lossplug's built-in — the built-in keeps the bare name, each other one is registered under its
  qualified name only;
* none is built in — the bare name is ambiguous: looking it up is an error naming every qualified name, and each
  qualified name works;
* one provider registers a name more than once (two entry points of one distribution, a hook that registers two
  plugins under one name) — that name is a genuine duplicate and cannot be used, qualified or not.

This module reads no plugin and imports no torch: the command line uses it on the torch-free catalogue path.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

#: the provider of the built-in plugins and presets
BUILTIN_PROVIDER = "lossplug"
SEPARATOR = ":"

#: PEP 503's separators, and the colon (an in-process name may hold one; a qualified name splits at its first)
_RUNS = re.compile(r"[-_.:]+")


def canonical_provider(name: str) -> str:
    """A distribution's (or in-process plugin's) name in canonical form: ``My_Gates`` → ``my-gates`` (PEP 503)."""
    return _RUNS.sub("-", name.strip()).lower()


def qualify(provider: str, name: str) -> str:
    """``<provider>:<name>``, with the provider canonicalised."""
    return f"{canonical_provider(provider)}{SEPARATOR}{name}"


def split(name: str) -> tuple[str | None, str]:
    """``(canonical provider, name)`` of a qualified name; ``(None, name)`` of a bare one."""
    provider, sep, bare = name.partition(SEPARATOR)
    return (canonical_provider(provider), bare) if sep else (None, name)


def canonical(name: str) -> str:
    """A name as the registry keys it: a bare name unchanged, a qualified one with its provider canonicalised."""
    provider, bare = split(name)
    return name if provider is None else f"{provider}{SEPARATOR}{bare}"


@dataclass(frozen=True)
class Claim:
    """One registration of a name: the plugin (or preset) object, where it came from and its provider."""

    name: str
    value: Any
    origin: str
    provider: str


@dataclass(frozen=True)
class NameClash:
    """A name registered by more than one provider: ``builtin`` is the built-in's origin when lossplug's own is one
    of them (it keeps the bare name), ``others`` the (qualified name, origin) of every other registration."""

    kind: str
    name: str
    builtin: str | None
    others: tuple[tuple[str, str], ...]

    def message(self) -> str:
        """What lossplug says about the clash, once per registry build."""
        by = " and by ".join(origin for _, origin in self.others)
        qualified = " and ".join(f"'{q}'" for q, _ in self.others)
        if self.builtin is not None:
            other = "the other is" if len(self.others) == 1 else "the others are"
            return (
                f"lossplug {self.kind} '{self.name}' is built in and also registered by {by}: "
                f"'{self.name}' stays lossplug's built-in; {other} {qualified}"
            )
        return (
            f"lossplug {self.kind} '{self.name}' is registered more than once, by {by}: '{self.name}' alone is "
            f"ambiguous; name one of them: {qualified.replace(' and ', ' or ')}"
        )


@dataclass
class Settled:
    """The names of one kind after :func:`settle`: registry key → claim (the value renamed to its key), qualified
    name → registry key, the keys that one provider registered more than once (→ their origins), the bare names
    that several third-party providers registered (→ their qualified names), and the clashes to report."""

    keys: dict[str, Claim] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    duplicates: dict[str, list[str]] = field(default_factory=dict)
    ambiguous: dict[str, list[str]] = field(default_factory=dict)
    clashes: list[NameClash] = field(default_factory=list)


def _by_provider(claims: Iterable[Claim]) -> dict[str, list[Claim]]:
    grouped: dict[str, list[Claim]] = {}
    for claim in claims:
        mine = grouped.setdefault(claim.provider, [])
        if not any(c.value is claim.value for c in mine):  # the same object registered twice is one registration
            mine.append(claim)
    return grouped


def _renamed(value: Any, key: str) -> Any:
    """The plugin or preset under its registry key: a copy whose ``name`` is the qualified one, so that error
    messages, metric names and run records say which of the two it is."""
    return value if value.name == key else dataclasses.replace(value, name=key)


def settle(kind: str, claims: Iterable[Claim]) -> Settled:
    """Decide every name of one kind (see the module docstring): claims in registration order."""
    by_name: dict[str, list[Claim]] = {}
    for claim in claims:
        by_name.setdefault(claim.name, []).append(claim)
    out = Settled()
    for name, named in by_name.items():
        providers = _by_provider(named)
        clashing = len(providers) > 1
        for provider, mine in providers.items():
            key = qualify(provider, name) if clashing and provider != BUILTIN_PROVIDER else name
            out.aliases[qualify(provider, name)] = key
            if len(mine) > 1:
                out.duplicates[key] = [c.origin for c in mine]
            else:
                out.keys[key] = dataclasses.replace(mine[0], value=_renamed(mine[0].value, key))
        if not clashing:
            continue
        builtin = providers.get(BUILTIN_PROVIDER)
        others = tuple(
            (qualify(p, name), " and ".join(c.origin for c in mine))
            for p, mine in providers.items()
            if p != BUILTIN_PROVIDER
        )
        if builtin is None:
            out.ambiguous[name] = [q for q, _ in others]
        out.clashes.append(NameClash(kind, name, builtin[0].origin if builtin else None, others))
    return out
