"""The batch contracts as one JSON schema document (``lossplug schema``).

Everything in it comes from the contracts' declarations (:mod:`lossplug.contracts.batch`): pydantic's
``model_json_schema()`` of each contract, each field described with its shape, kind, log-prob source and rules under
``x-lossplug``. A field's JSON value is what a JSON batch file holds: nested arrays of the field's kind, or
``{"data": …, "dtype": "…"}``.
"""

from __future__ import annotations

from typing import Any

from .batch import LOGP_TOLERANCE, PackedTransitions, PolicyBatch

#: the JSON Schema dialect pydantic writes
DIALECT = "https://json-schema.org/draft/2020-12/schema"

_CONTRACTS: dict[str, type[PolicyBatch] | type[PackedTransitions]] = {
    "policy": PolicyBatch,
    "packed": PackedTransitions,
}


def batch_json_schema(contract: str = "all") -> dict[str, Any]:
    """The JSON schema of one contract (``"policy"``, ``"packed"``) or of both (``"all"``: either, under ``$defs``)."""
    if contract not in ("all", *_CONTRACTS):
        raise ValueError(f"contract must be 'all', 'policy' or 'packed', got {contract!r}")
    meta = {"logp_tolerance": LOGP_TOLERANCE, "masked_positions": "may hold anything except a token reward (0)"}
    if contract != "all":
        return {"$schema": DIALECT, **_CONTRACTS[contract].model_json_schema(), "x-lossplug": meta}
    defs = {cls.__name__: cls.model_json_schema() for cls in _CONTRACTS.values()}
    return {
        "$schema": DIALECT,
        "title": "lossplug batch",
        "description": "A lossplug batch: a padded PolicyBatch ([B, T] and [B] fields) or PackedTransitions ([N]).",
        "anyOf": [{"$ref": f"#/$defs/{name}"} for name in defs],
        "$defs": defs,
        "x-lossplug": meta,
    }
