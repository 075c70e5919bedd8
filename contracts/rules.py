"""Contract rules written once, read two ways.

A :class:`Rule` names the field a violation blames, the fields it reads, and two readings of one test:

* ``passes(fields)`` — the quick test: on the host (CPU tensors), a Python bool, nothing built on success. A
  contract runs it once per micro-batch in a trainer's hot loop;
* ``report(checks, fields)`` — the same test recorded on a :class:`~lossplug.contracts.checks.Checks` with the
  offending rows and positions: failures of metadata rules at once, value rules as flags (0-d tensors) that
  :meth:`~lossplug.contracts.checks.Checks.raise_if_any` resolves with the contract's single host synchronisation —
  on an accelerator the quick path does not run and the report path is the check.

Most rules are built by :func:`where_bad` (a vectorised predicate: the positions where the rule is broken) or
:func:`requirement` (a test of shapes, dtypes or presence, with its message); rules whose quick test reads the memo
of checked tensors (:mod:`lossplug.contracts.memo`) give both readings themselves.

A :class:`RuleTable` is a contract's rules in stages: the quick path runs every rule in order and stops at the first
that fails; the report runs them in the same order, and a stage that recorded a violation ends it (later stages
assume it held: value rules read aligned, well-typed tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import checks as checks_module
from .checks import DTYPE_KINDS, Checks, any_of

Tensor = torch.Tensor

#: a contract's fields by name (its ``__dict__``): a tensor, or None where the field is not set
Fields = Mapping[str, Any]


@dataclass(frozen=True)
class Rule:
    """One contract rule: the field it names, the fields it reads (it applies when every one is set), its quick
    host test and its report; ``summary`` states it in words for the schema and the docs (empty for the shape and
    kind rules, which the field's declaration states)."""

    field: str
    reads: tuple[str, ...]
    passes: Callable[[Fields], bool]
    report: Callable[[Checks, Fields], None]
    summary: str = ""


def where_bad(
    field: str, reads: tuple[str, ...], bad: Callable[[Fields], Tensor], rule: str, noun: str = "rows"
) -> Rule:
    """A rule given by where it is broken: ``bad(fields)`` is a boolean tensor, set at the offending places. The
    quick test asks whether any is set; the report names them (looked up only if the flag is set)."""

    def passes(fields: Fields) -> bool:
        return not bool(any_of(bad(fields)))

    def report(checks: Checks, fields: Fields) -> None:
        checks.when_any(bad(fields), field, rule, noun)

    return Rule(field, reads, passes, report, rule)


def requirement(
    field: str, reads: tuple[str, ...], holds: Callable[[Fields], bool], rule: Callable[[Fields], str]
) -> Rule:
    """A rule on metadata (shapes, presence): ``holds(fields)`` without reading values, ``rule(fields)`` the message
    of its violation, built only when it fails."""

    def report(checks: Checks, fields: Fields) -> None:
        if not holds(fields):
            checks.fail(field, rule(fields))

    return Rule(field, reads, holds, report)


def needs(field: str, other: str, rule: str) -> Rule:
    """``field`` is only read together with ``other``: giving it alone is a violation."""
    return Rule(
        field,
        (field,),
        lambda fields: fields[other] is not None,
        lambda checks, fields: None if fields[other] is not None else checks.fail(field, rule),
        f"given only with {other}",
    )


def of_kind(field: str, kind: str) -> Rule:
    """``field``'s dtype is of ``kind`` (see :data:`~lossplug.contracts.checks.DTYPE_KINDS`)."""
    accepts = DTYPE_KINDS[kind][0]

    def report(checks: Checks, fields: Fields) -> None:
        checks.dtype(field, fields[field], kind)

    return Rule(field, (field,), lambda fields: accepts(fields[field]), report)


class RuleTable:
    """A contract's rules in stages (see the module docstring); ``anchor`` is the field whose device decides whether
    the quick path applies (on an accelerator every rule is queued for one synchronisation instead)."""

    def __init__(self, anchor: str, stages: Iterable[Iterable[Rule]]):
        self.anchor = anchor
        self.stages = tuple(tuple(stage) for stage in stages)
        self._rules = tuple(rule for stage in self.stages for rule in stage)
        #: which fields are set (a tuple of bools in the contract's field order) → the quick tests that apply: a
        #: trainer's micro-batches all set the same fields, so the table is looked up, not re-derived, per batch
        self._applicable: dict[tuple[bool, ...], tuple[Callable[[Fields], bool], ...]] = {}

    def passes(self, fields: Fields) -> bool:
        """True when every rule holds, tested the quick way; False when one fails or the quick path does not apply
        (an accelerator) — :meth:`report` then names what is wrong."""
        if not checks_module.on_host(fields[self.anchor]):
            return False
        present = tuple([value is not None for value in fields.values()])
        tests = self._applicable.get(present)
        if tests is None:
            tests = self._applicable[present] = tuple(
                rule.passes for rule in self._rules if all(fields[name] is not None for name in rule.reads)
            )
        for rule_passes in tests:
            if not rule_passes(fields):
                return False
        return True

    def report(self, checks: Checks, fields: Fields) -> None:
        """Record every violated rule on ``checks``, stage by stage."""
        for stage in self.stages:
            recorded = len(checks.violations)
            for rule in stage:
                if all(fields[name] is not None for name in rule.reads):
                    rule.report(checks, fields)
            if len(checks.violations) > recorded:
                return
