"""Errors raised by lossplug.

Every error a user can trigger with bad input is a :class:`LossplugError`. They deliberately do not subclass
``ValueError``: pydantic wraps ``ValueError`` raised inside validators into its own ``ValidationError``, and we want
our messages — field, rule, position — to reach the user as written, not buried in pydantic's report.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class LossplugError(Exception):
    """Base class of every error lossplug raises on bad input or bad configuration."""


@dataclass(frozen=True)
class Violation:
    """One broken contract rule: which field, which rule, and where (rows / positions / groups)."""

    field: str
    rule: str
    where: str = ""

    def __str__(self) -> str:
        return f"{self.field}: {self.rule}" + (f" — {self.where}" if self.where else "")


class BatchValidationError(LossplugError):
    """A batch broke one or more contract rules. ``violations`` lists every one of them, not just the first."""

    def __init__(self, contract: str, violations: Sequence[Violation]):
        self.contract = contract
        self.violations = list(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        n = len(self.violations)
        super().__init__(f"{contract} failed {n} contract check{'s' if n != 1 else ''}:\n{lines}")


class RecipeError(LossplugError):
    """A recipe names an unknown plugin, an unknown parameter, or a parameter value the plugin refuses."""


class PluginError(LossplugError):
    """A plugin could not be loaded or registered (import error, bad hook, duplicate name)."""


class MissingExtra(LossplugError, ModuleNotFoundError):
    """An optional package a helper or command needs is not installed; the message names it and the extra that
    installs it: ``lossplug.demo.run_demo needs trl, which is not installed: pip install 'lossplug[demo]'``.

    Also a ``ModuleNotFoundError`` (``name`` is the package), so code that guards an optional import with
    ``except ImportError`` keeps working."""

    def __init__(self, package: str, extra: str, needed_by: str):
        super().__init__(f"{needed_by} needs {package}, which is not installed: pip install 'lossplug[{extra}]'")
        self.name = package
        self.package, self.extra, self.needed_by = package, extra, needed_by

    def __reduce__(self) -> tuple[type[MissingExtra], tuple[str, str, str]]:
        # pickled as its fields, not its message: an error raised in a Ray worker reaches the driver whole
        return type(self), (self.package, self.extra, self.needed_by)


def _typo_distance(a: str, b: str) -> int:
    """Edits between ``a`` and ``b`` where swapping two neighbouring letters is one edit (optimal string alignment):
    'gpro' is one edit from 'grpo', two from 'igpo'."""
    rows = [list(range(len(b) + 1))]
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(rows[i - 1][j] + 1, row[j - 1] + 1, rows[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], rows[i - 2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """A ' (did you mean 'x'?)' suffix for typos, or '': the choice fewest typing edits away (a swap of neighbouring
    letters counts one) when it is within a third of the word, else difflib's closest."""
    options = list(choices)
    if not options:
        return ""
    best = min(options, key=lambda c: (_typo_distance(word, c), -difflib.SequenceMatcher(None, word, c).ratio()))
    if _typo_distance(word, best) <= max(1, len(word) // 3):
        return f" (did you mean '{best}'?)"
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def describe_positions(index: torch.Tensor, limit: int = 8, noun: str = "rows") -> str:
    """Render the offending places of a boolean mask or an index tensor: 'rows [1, 4]' / '(row 2, pos 5), …'."""
    import torch

    if index.dtype == torch.bool:
        index = index.nonzero()
    index = index.cpu()
    total = index.shape[0]
    if index.ndim == 1 or index.shape[-1] == 1:
        items = [str(int(i)) for i in index.reshape(-1)[:limit]]
        noun = noun if total != 1 else noun.rstrip("s")
        text = f"{noun} [{', '.join(items)}{', …' if total > limit else ''}]"
    else:
        items = [f"(row {int(r)}, pos {int(c)})" for r, c in index[:limit].tolist()]
        text = ", ".join(items) + (", …" if total > limit else "")
    return text + (f" ({total} in all)" if total > limit else "")
