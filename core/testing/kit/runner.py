"""Resolving a plugin and running the checks against it: :func:`check_plugin` and friends, and :data:`CHECKS`."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

import lossplug
from lossplug.contracts import LossplugError
from lossplug.kinds import KINDS as KIND_TABLE
from lossplug.plugin import AnyPlugin

from . import advantages, every_kind, gates, loss_checks, reductions, regularizers
from ._common import (
    KINDS,
    Check,
    CheckFailed,
    CheckResult,
    CheckSkipped,
    ConformanceReport,
    Subject,
    format_exception,
)

#: every check by name, in the order they run and are reported
CHECKS: dict[str, Check] = {
    c.name: c
    for c in (
        every_kind.docstring,
        every_kind.params_schema,
        every_kind.output_contract,
        every_kind.requires_declared,
        gates.ratio_one,
        loss_checks.zero_advantage,
        every_kind.masked_poison,
        every_kind.masked_layout,
        loss_checks.detached,
        loss_checks.metric_levels,
        loss_checks.extreme_ratios,
        loss_checks.microbatch_split,
        reductions.positive_weights,
        advantages.row_permutation,
        regularizers.coefficient_linear,
    )
}


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
    check = CHECKS[name]
    try:
        check.fn(subject)
    except CheckSkipped as skip:
        return CheckResult(name, "skipped", str(skip), check.summary)
    except CheckFailed as fail:
        return CheckResult(name, "failed", str(fail), check.summary)
    except Exception as err:  # the plugin (or a contract it feeds) raised: that is a failure, with where
        return CheckResult(name, "failed", f"raised {format_exception(err)}", check.summary)
    return CheckResult(name, "passed", "", check.summary)


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
        for n in wanted:
            if n not in applicable:
                report.results.append(CheckResult(n, "skipped", f"does not apply to a {k}", CHECKS[n].summary))
            elif n in reasons:
                report.results.append(CheckResult(n, "skipped", reasons[n], CHECKS[n].summary))
            else:
                report.results.append(_run_one(subject, n))
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
