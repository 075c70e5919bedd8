"""The one wording of a batch field that is missing, and one line per problem.

Kept apart from :mod:`lossplug.needs` (which compiles recipes) so that :mod:`lossplug.validation` — which the pipeline
imports — can use it without an import cycle.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lossplug.contracts.errors import Violation

__all__ = ["ON_POLICY_HINT", "MissingField", "missing_field", "one_line_each"]

#: how to give ``old_logp`` when no update has happened yet, said wherever it is missing
ON_POLICY_HINT = " (for a single on-policy step pass old_logp=logp.detach())"


@dataclass(frozen=True)
class MissingField(Violation):
    """A field a batch lacks, with every stage that needs it: :func:`one_line_each` merges those of one field into
    a single line, so that a field two gates read is one problem, not two."""

    #: the stages that need the field, as the message names them (``recipe.gates[0] (ppo_clip)``)
    needed_by: tuple[str, ...] = ()
    #: the rest of the sentence: what lacks it (``this PolicyBatch has none``, ``the file has none``)
    lack: str = ""


def missing_field(field: str, needed_by: Sequence[str], lack: str) -> MissingField:
    """``field: required by A, B, but <lack>`` — the one wording of a missing field, for the Python API and the CLI."""
    hint = ON_POLICY_HINT if field == "old_logp" and lack.endswith("has none") else ""
    rule = f"required by {', '.join(needed_by)}, but {lack}{hint}"
    return MissingField(field, rule, needed_by=tuple(needed_by), lack=lack)


def one_line_each(violations: Iterable[Violation]) -> list[Violation]:
    """``violations`` with one line per problem, in their order: the missing-field violations of one field (and one
    reason) merged into one naming every stage that needs it, and repeats of a (field, rule) dropped."""
    merged: dict[tuple[str, str], Violation] = {}
    for violation in violations:
        if isinstance(violation, MissingField):
            key = (violation.field, "missing: " + violation.lack)
            earlier = merged.get(key)
            if isinstance(earlier, MissingField):
                needed_by = tuple(dict.fromkeys(earlier.needed_by + violation.needed_by))
                violation = missing_field(violation.field, needed_by, violation.lack)
        else:
            key = (violation.field, violation.rule)
            if key in merged:
                continue
        merged[key] = violation
    return list(merged.values())
