"""Resolving a plugin and running the checks against it: :func:`check_plugin` and friends, and :data:`CHECKS`."""

from __future__ import annotations

import contextlib
import json
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

import lossplug
from lossplug.contracts import LossplugError
from lossplug.kinds import KINDS as KIND_TABLE
from lossplug.kinds import AnyPlugin

from . import advantages, every_kind, gates, loss_checks, reductions, regularizers
from ._common import (
    KINDS,
    Check,
    CheckFailed,
    CheckResult,
    CheckSkipped,
    ConformanceReport,
    Subject,
    collecting_warnings,
    format_exception,
    raised_in_kit,
    reference_update_gate,
)

#: every check by name, in the order they run and are reported: an order in which each check comes after the checks it
#: ``needs`` (declared with the check, see :class:`Check`)
CHECKS: dict[str, Check] = {
    c.name: c
    for c in (
        every_kind.docstring,
        every_kind.params_schema,
        every_kind.output_contract,
        loss_checks.detached,
        loss_checks.metric_levels,
        every_kind.requires_declared,
        every_kind.masked_poison,
        every_kind.masked_layout,
        loss_checks.zero_advantage,
        loss_checks.extreme_ratios,
        loss_checks.microbatch_split,
        gates.ratio_one,
        reductions.positive_weights,
        advantages.row_permutation,
        regularizers.coefficient_linear,
    )
}


def _check_order(checks: Mapping[str, Check]) -> None:
    """Every check needs only checks listed before it (so one pass in order runs each after what it needs)."""
    seen: set[str] = set()
    for name, c in checks.items():
        late = [n for n in c.needs if n not in seen]
        if late:
            raise RuntimeError(f"check {name!r} needs {late}, which are not listed before it in CHECKS")
        seen.add(name)


_check_order(CHECKS)


def needs_for(name: str, kind: str) -> tuple[str, ...]:
    """The checks ``name`` needs that apply to ``kind``: a needed check that does not apply stands in for what it
    needs itself (so a reduction's masked_poison needs output_contract, past the gate-only checks)."""
    out: list[str] = []
    for need in CHECKS[name].needs:
        out.extend([need] if kind in CHECKS[need].kinds else needs_for(need, kind))
    return tuple(dict.fromkeys(out))


def _find(plugin: str | AnyPlugin, kind: str | None) -> tuple[str, str, AnyPlugin, str, bool]:
    """(kind, name, plugin, source, registered)."""
    reg = lossplug.registry()
    if isinstance(plugin, str):
        kinds = [kind] if kind else list(KINDS)
        found = [k for k in kinds if reg.knows(k, plugin)]  # bare or qualified (my-gates:my_gate), or unusable
        if not found:
            k = kind or "gate"
            if kind is None:
                others = [kk for kk in KINDS if plugin in reg.plugins[kk]]
                k = others[0] if others else "gate"
            failed_imports = [b for b in reg.broken if b.failed_to_import]
            if failed_imports:  # then "is it installed?" misleads: it is, and its import error is the answer
                from lossplug.contracts.errors import did_you_mean

                raise LookupError(
                    f"unknown {k} plugin '{plugin}'{did_you_mean(plugin, sorted(reg.plugins[k]))}. It may be "
                    "provided by an installed plugin whose import failed, so nothing it registers exists: "
                    + "; ".join(map(str, failed_imports))
                    + ". Fix that import error and run again"
                ) from None
            try:
                reg.lookup(k, plugin, "lossplug.testing")
            except LossplugError as err:
                raise LookupError(
                    f"{err}. Is the distribution that provides it installed (pip install -e .), "
                    f"with a [project.entry-points.lossplug] entry?"
                ) from None
        if len(found) > 1:
            raise LookupError(f"'{plugin}' names plugins of several kinds ({', '.join(found)}); pass kind=")
        k = found[0]
        obj = reg.lookup(k, plugin, "lossplug.testing")  # raises on duplicates
        return k, plugin, obj, reg.origin(k, plugin), True
    k = getattr(plugin, "kind", "")
    if k not in KINDS or not hasattr(plugin, "params"):
        raise TypeError(
            f"expected a plugin name or an object made by @lossplug.gate/advantage/reduction, got {plugin!r}"
        )
    registered = reg.plugins[k].get(plugin.name)
    if registered is plugin:
        return k, plugin.name, plugin, reg.origin(k, plugin.name), True
    if registered is not None or (k, plugin.name) in reg.duplicates:
        raise LookupError(
            f"a different {k} is already registered as '{plugin.name}' ({reg.origin(k, plugin.name)}); "
            "rename yours or test the registered one by name"
        )
    return k, plugin.name, plugin, "unregistered, checked in-process", False


@contextlib.contextmanager
def _registered(kind: str, plugin: AnyPlugin, needed: bool) -> Iterator[None]:
    if not needed:
        yield
        return
    shim = types.SimpleNamespace()

    def register_hook(register: Callable[[AnyPlugin], None]) -> None:
        register(plugin)

    setattr(shim, KIND_TABLE[kind].hook, lossplug.hookimpl(register_hook))
    register_hook.__name__ = KIND_TABLE[kind].hook
    lossplug.register_plugin(shim, name=f"lossplug.testing:{plugin.name}")
    try:
        yield
    finally:
        lossplug.unregister_plugin(shim)


def checks_for(plugin: str | AnyPlugin, *, kind: str | None = None) -> list[str]:
    """The names of the checks that apply to this plugin's kind."""
    k = _find(plugin, kind)[0] if isinstance(plugin, str) else plugin.kind
    return [name for name, c in CHECKS.items() if k in c.kinds]


def _run_one(subject: Subject, name: str) -> CheckResult:
    """Run one check. Whatever the plugin does, this returns: a plugin that raises, or whose output lossplug
    refuses, fails the check with the error and where it came from; an exception from the kit's own code (a kit
    bug: every plugin output is checked against its kind's contract before the kit reads it) is reported as one."""
    check = CHECKS[name]
    torch.manual_seed(0)  # each check draws the same numbers whatever ran before it (so a needed check's result keeps)
    with collecting_warnings() as found:
        try:
            check.fn(subject)
        except CheckSkipped as skip:
            return CheckResult(name, "skipped", str(skip), check.summary)
        except CheckFailed as fail:
            return CheckResult(name, "failed", str(fail), check.summary, blocking=fail.blocking, warnings=tuple(found))
        except Exception as err:
            if raised_in_kit(err):
                message = (
                    f"the conformance kit itself raised {format_exception(err)}: a bug in lossplug.testing, not a "
                    "verdict on the plugin — please report it with this message"
                )
                return CheckResult(name, "failed", message, check.summary, kit_error=True)
            return CheckResult(name, "failed", f"raised {format_exception(err)}", check.summary, warnings=tuple(found))
    return CheckResult(name, "passed", "", check.summary, warnings=tuple(found))


#: every check's last result, by (check, plugin, parameters, reference gate): a check run alone (one pytest item per
#: check) finds the checks it needs here instead of running them again. The values keep the plugin objects alive, so
#: an id in a key is never reused for another plugin.
_NEEDED: dict[tuple[Any, ...], tuple[object, object, CheckResult]] = {}


def _cache_key(name: str, subject: Subject) -> tuple[tuple[Any, ...], object, object]:
    ref = lossplug.registry().plugins["gate"].get(reference_update_gate())
    params = json.dumps(subject.params, sort_keys=True, default=repr)
    return (CHECKS[name], subject.kind, subject.name, id(subject.plugin), params, id(ref)), subject.plugin, ref


def _run_needed(subject: Subject, name: str, requested: bool) -> CheckResult:
    """Run a check; one that was not requested (only needed) is taken from the cache when it ran before."""
    key, plugin, ref = _cache_key(name, subject)
    if not requested and key in _NEEDED:
        return _NEEDED[key][2]
    result = _run_one(subject, name)
    if len(_NEEDED) > 4096:
        _NEEDED.clear()
    _NEEDED[key] = (plugin, ref, result)
    return result


def _blocked(name: str, roots: tuple[str, ...], results: Mapping[str, CheckResult], reported: set[str]) -> CheckResult:
    """A check that did not run because ``roots`` failed. When the report shows the roots (``reported``), above it
    in check order, the row points to them in one line instead of repeating their message on every blocked row;
    a check run alone (one pytest item) carries the first root's reason, which nothing else shows."""
    if set(roots) <= reported:
        where = "which failed (its row is above)" if len(roots) == 1 else "which failed (their rows are above)"
        message = f"blocked by {', '.join(roots)}, {where}"
    else:
        reason = results[roots[0]].message.split("\n", 1)[0]
        reason = reason if len(reason) <= 200 else reason[:199] + "…"
        message = f"blocked by {', '.join(roots)}, which fails: {reason}"
    return CheckResult(name, "skipped", message, CHECKS[name].summary, blocked_by=roots)


def _run_in_order(
    subject: Subject, wanted: list[str], applicable: list[str], reasons: Mapping[str, str]
) -> dict[str, CheckResult]:
    """Run ``wanted`` and the checks they need, in :data:`CHECKS` order; a check whose needed check failed (or was
    blocked) is not run, but reported as blocked by the root failure(s)."""
    kind = subject.kind
    closure: set[str] = set()
    todo = [n for n in wanted if n in applicable and n not in reasons]
    while todo:
        n = todo.pop()
        if n not in closure:
            closure.add(n)
            todo.extend(m for m in needs_for(n, kind) if m not in reasons)
    results: dict[str, CheckResult] = {}
    roots_of: dict[str, tuple[str, ...]] = {}  # a check → the root failures behind it (itself, when it failed)
    for n in CHECKS:
        if n in wanted and n not in applicable:
            results[n] = CheckResult(n, "skipped", f"does not apply to a {kind}", CHECKS[n].summary)
        elif n in wanted and n in reasons:
            results[n] = CheckResult(n, "skipped", reasons[n], CHECKS[n].summary)
        elif n in closure:
            roots = tuple(dict.fromkeys(r for m in needs_for(n, kind) for r in roots_of.get(m, ())))
            if roots:
                results[n] = _blocked(n, roots, results, set(wanted))
                roots_of[n] = roots
                continue
            results[n] = _run_needed(subject, n, requested=n in wanted)
            if results[n].status == "failed" and (results[n].blocking or results[n].kit_error):
                roots_of[n] = (n,)
    return results


def check_plugin(
    plugin: str | AnyPlugin,
    *,
    kind: str | None = None,
    params: Mapping[str, Any] | None = None,
    checks: Iterable[str] | None = None,
    skip: Iterable[str] | Mapping[str, str] = (),
) -> ConformanceReport:
    """Run the conformance checks against one plugin and return a :class:`ConformanceReport` (never raises for a
    failing check; see :func:`assert_conforms`).

    ``plugin`` is a registered name (``kind=`` disambiguates) or a plugin object made by ``@lossplug.gate`` /
    ``advantage`` / ``reduction`` — an unregistered object is registered in-process for the duration of the run.
    ``params`` are the plugin's parameters to test with (default: its defaults). ``checks`` restricts the run to
    these names; ``skip`` lists checks that do not apply by design (a mapping gives the reason for each).

    Checks run after the checks they need (:attr:`Check.needs`), which run too when ``checks`` leaves them out (only
    the requested ones are reported). A check whose needed check fails does not run: it is reported as skipped,
    blocked by that root failure (:attr:`CheckResult.blocked_by`), so one mistake fails one check.
    """
    k, name, obj, source, registered = _find(plugin, kind)
    applicable = [n for n, c in CHECKS.items() if k in c.kinds]
    wanted = list(checks) if checks is not None else applicable
    unknown = [n for n in wanted if n not in CHECKS] + [n for n in skip if n not in CHECKS]
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; checks are: {', '.join(CHECKS)}")
    reasons = dict(skip) if isinstance(skip, Mapping) else {n: "skipped by the caller" for n in skip}
    report = ConformanceReport(k, name, source, dict(params or {}))
    subject = Subject(k, name, obj, dict(params or {}), source)
    with _registered(k, obj, needed=not registered), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        results = _run_in_order(subject, wanted, applicable, reasons)
    report.results.extend(results[n] for n in wanted)
    return report


def run_check(
    plugin: str | AnyPlugin, check: str, *, kind: str | None = None, params: Mapping[str, Any] | None = None
) -> CheckResult:
    """Run one named check; returns its :class:`CheckResult`."""
    return check_plugin(plugin, kind=kind, params=params, checks=[check]).results[0]


def assert_conforms(
    plugin: str | AnyPlugin,
    *,
    kind: str | None = None,
    params: Mapping[str, Any] | None = None,
    checks: Iterable[str] | None = None,
    skip: Iterable[str] | Mapping[str, str] = (),
) -> ConformanceReport:
    """:func:`check_plugin`, raising :class:`ConformanceError` (an ``AssertionError``) listing every failure."""
    return check_plugin(plugin, kind=kind, params=params, checks=checks, skip=skip).raise_for_failures()
