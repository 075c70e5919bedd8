"""A JSON batch dump read into tensors, every problem of every field named in lossplug's words.

A JSON dump maps field names to nested lists, or to ``{"data": [...], "dtype": "bfloat16"}``. A field that cannot be
a tensor — ragged rows, uneven nesting, a string among the numbers, an unknown dtype, a value its declared integer
dtype would change — is a :class:`~lossplug.contracts.Violation` naming the field, the rule and the JSON path
(``$.logp[3]``); the other fields are read all the same, so that one run reports everything. torch's own messages
("expected sequence of length 2 at dim 1") never reach the user, and lists torch would accept by dropping values
(``[[], [1.0]]`` becomes a ``[2, 0]`` tensor) are refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from lossplug.contracts import Violation

#: how many offending places one violation lists before it counts the rest
SHOWN_PLACES = 5

RAGGED = "must be a rectangular array: every list at one depth has the same length"
UNEVEN = "must nest evenly: every element at one depth a list, or every one a value"
NOT_A_VALUE = "elements must be numbers or booleans"
TOO_BIG = "integers must fit in 64 bits"

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_INT64 = (-(2**63), 2**63 - 1)


def json_path(field: str) -> str:
    """``$.logp``, or ``$["odd name"]`` for a key that is not an identifier."""
    return f"$.{field}" if _IDENTIFIER.fullmatch(field) else f"$[{json.dumps(field)}]"


def _kind(value: Any) -> str:
    """A JSON value's type as people say it: a list, a boolean, a number, a string, null, an object."""
    if isinstance(value, list):
        return "a list"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "null" if value is None else "an object"


def _first_path(value: Any, path: str) -> list[tuple[str, Any]]:
    """The chain ``value, value[0], value[0][0], …`` down to the first non-list, with paths: the nesting every other
    element is measured against (as torch measures it)."""
    chain = [(path, value)]
    while isinstance(value, list) and value:
        value, path = value[0], f"{path}[0]"
        chain.append((path, value))
    return chain


@dataclass
class _Found:
    """The offending places of one rule, in the order met."""

    rule: str
    places: list[str]

    def where(self) -> str:
        shown = ", ".join(self.places[:SHOWN_PLACES])
        more = len(self.places) - SHOWN_PLACES
        return shown + (f", … and {more} more" if more > 0 else "")


def _walk(value: Any, path: str, depth: int, chain: list[tuple[str, Any]]) -> Iterator[tuple[str, str]]:
    """(rule, place) for every element of ``value`` that breaks the nesting of ``chain`` (see :func:`_first_path`)."""
    reference_path, reference = chain[depth]
    if isinstance(value, list) != isinstance(reference, list):
        yield UNEVEN, f"{path} is {_kind(value)} where {reference_path} is {_kind(reference)}"
        return
    if not isinstance(value, list):
        if isinstance(value, int) and not isinstance(value, bool) and not _INT64[0] <= value <= _INT64[1]:
            yield TOO_BIG, f"{path} is {value}"
        elif not isinstance(value, (bool, int, float)):
            yield NOT_A_VALUE, f"{path} is {_kind(value)}"
        return
    if len(value) != len(reference):
        noun = "element" if len(value) == 1 else "elements"
        yield RAGGED, f"{path} has {len(value)} {noun} where {reference_path} has {len(reference)}"
    if depth + 1 < len(chain):  # (below an empty reference list, any element is one too many: said above)
        for i, item in enumerate(value):
            yield from _walk(item, f"{path}[{i}]", depth + 1, chain)


def array_problems(value: Any, path: str) -> list[tuple[str, str]]:
    """``(rule, where)`` for each way the JSON ``value`` at ``path`` is not a rectangular array of numbers or booleans:
    one pair per rule, listing its offending places; empty when it is one."""
    found: dict[str, _Found] = {}
    for rule, place in _walk(value, path, 0, _first_path(value, path)):
        found.setdefault(rule, _Found(rule, [])).places.append(place)
    return [(f.rule, f.where()) for f in found.values()]


def _index_path(path: str, index: tuple[int, ...]) -> str:
    return path + "".join(f"[{i}]" for i in index)


def _changed_by(data: Any, path: str, dtype: torch.dtype) -> list[tuple[str, str]]:
    """A violation of integer and bool dtypes, which torch fills by truncating: ``1.5`` as int64 would be 1, ``-1`` as
    uint8 255, ``2`` as bool True. Float dtypes round, as any float does, and are not checked."""
    import torch

    if dtype.is_floating_point or dtype.is_complex:
        return []
    exact = torch.tensor(data, dtype=torch.float64 if _has_float(data) else None)
    same = exact.to(dtype).to(exact.dtype) == exact
    if exact.is_floating_point():  # (NaN and inf become arbitrary integers)
        same &= torch.isfinite(exact)
    if bool(same.all()):
        return []
    bad = (~same).nonzero().tolist()
    places = [f"{_index_path(path, tuple(i))} is {_element(data, i)}" for i in bad[:SHOWN_PLACES]]
    more = f", … and {len(bad) - SHOWN_PLACES} more" if len(bad) > SHOWN_PLACES else ""
    return [(f"values must be representable as {str(dtype).removeprefix('torch.')}", ", ".join(places) + more)]


def _has_float(data: Any) -> bool:
    if isinstance(data, list):
        return any(_has_float(item) for item in data)
    return isinstance(data, float)


def _element(data: Any, index: list[int]) -> str:
    for i in index:
        data = data[i]
    return json.dumps(data)


def _dtype_named(name: Any) -> torch.dtype | None:
    import torch

    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _dtype_names() -> list[str]:
    import torch

    return [name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)]


def field_tensor(name: str, value: Any) -> tuple[torch.Tensor | None, list[Violation]]:
    """The tensor of one JSON field (None when it is null), or the violations that keep it from being one."""
    import torch

    from lossplug.contracts import Violation
    from lossplug.contracts.errors import did_you_mean

    path = json_path(name)
    dtype = None
    if isinstance(value, dict):
        problems = []
        for key in value:
            if key not in ("data", "dtype"):
                problems.append(
                    Violation(name, f"unknown key {key!r}: an object holds 'data' and optionally 'dtype'", path)
                )
        if "data" not in value:
            problems.append(Violation(name, "an object needs 'data' (and optionally 'dtype')", path))
        if "dtype" in value and value["dtype"] is not None:
            dtype = _dtype_named(value["dtype"])
            if dtype is None:
                rule = (
                    f"unknown dtype {str(value['dtype'])!r}{did_you_mean(str(value['dtype']), _dtype_names())}: "
                    "a torch dtype name such as float32, bfloat16, int64 or bool"
                )
                problems.append(Violation(name, rule, f"{path}.dtype"))
        if problems:
            return None, problems
        value, path = value["data"], f"{path}.data"
    if value is None:
        return None, []
    found = array_problems(value, path)
    if not found and dtype is not None:
        found = _changed_by(value, path, dtype)
    if not found:
        try:
            return torch.tensor(value, dtype=dtype), []
        except (TypeError, ValueError, RuntimeError):  # what the checks above do not foresee: never torch's words
            what = str(dtype).removeprefix("torch.") if dtype is not None else "tensor"
            found = [(f"cannot be stored as a {what}", path)]
    return None, [Violation(name, rule, where) for rule, where in found]
