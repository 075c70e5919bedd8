"""Batch dumps on disk: reading them safely and checking them against the contracts and a recipe.

A dump is a ``.safetensors`` file, or JSON (field → nested lists, or ``{"data": ..., "dtype": ...}``) for small
ones. Nothing here ever unpickles: unpickling runs arbitrary code, so ``.pt``/pickle files are refused with the
one-line fix. ``lossplug validate`` is built on this module; so can be any tool that inspects dumped batches.
Heavy imports (torch, safetensors) happen inside the functions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:
    from torch import Tensor

    from lossplug.contracts import PackedTransitions, PolicyBatch, Recipe, Violation
    from lossplug.plugin import AdvantagePlugin, Params

    Contract = type[PolicyBatch] | type[PackedTransitions]

from lossplug.contracts.errors import LossplugError

#: the contract names ``infer_contract`` accepts besides ``"auto"``
CONTRACTS = ("policy", "packed")
#: how many group ids a warning names before it counts the rest
SHOWN_GROUPS = 10

_PICKLE_HINT = (
    "lossplug never unpickles a file (unpickling runs arbitrary code); save the tensors with "
    "safetensors.torch.save_file(tensors, 'batch.safetensors') instead"
)
_PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt")
#: a safetensors header larger than this is a corrupt length prefix, not a header to read into memory
_MAX_HEADER_BYTES = 100_000_000


class UnreadableFile(LossplugError):
    """A batch file that cannot be read (missing, truncated, not safetensors/JSON, a pickle)."""


# ---------------------------------------------------------------------------------------------------------------------
# Reading


def _load_json(path: Path) -> dict[str, Any]:
    import torch

    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UnreadableFile(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise UnreadableFile(
            f"{path}: expected a JSON object mapping field names to (nested) lists, got {type(data).__name__}"
        )
    out = {}
    for name, value in data.items():
        dtype = None
        if isinstance(value, dict):
            if "data" not in value:
                raise UnreadableFile(f"{path}: field '{name}': an object needs 'data' (and optionally 'dtype')")
            dtype_name = value.get("dtype")
            if dtype_name is not None:
                dtype = getattr(torch, str(dtype_name), None)
                if not isinstance(dtype, torch.dtype):
                    raise UnreadableFile(f"{path}: field '{name}': unknown dtype {dtype_name!r}")
            value = value["data"]
        if value is None:
            continue
        try:
            out[name] = torch.tensor(value, dtype=dtype)
        except (TypeError, ValueError, RuntimeError) as err:
            raise UnreadableFile(
                f"{path}: field '{name}' is not a rectangular array of numbers/booleans ({err})"
            ) from None
    return out


def _looks_pickled(head: bytes) -> bool:
    """A zip (torch.save) or a pickle protocol 2-5 opcode at the start."""
    return head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"))


def _load_safetensors(path: Path) -> dict[str, Any]:
    # The header is checked by hand before safetensors sees the file, so that a truncated or foreign file gets a
    # message saying which, instead of the library's generic one (or a huge allocation from a garbage length).
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(9)
        n = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
        looks_safetensors = len(head) == 9 and head[8:9] == b"{" and 0 < n <= size - 8
        if not looks_safetensors and _looks_pickled(head):
            raise UnreadableFile(f"{path} looks like a pickle or torch.save file. {_PICKLE_HINT}")
        if len(head) < 9:
            raise UnreadableFile(f"{path} is {size} bytes: too short to be a safetensors file")
        if n > size - 8 or n > _MAX_HEADER_BYTES:
            raise UnreadableFile(
                f"{path} is not a safetensors file, or it is truncated: its header claims "
                f"{n} bytes but the file has {size - 8} after the length prefix"
            )
        fh.seek(8)
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise UnreadableFile(f"{path} is not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise UnreadableFile(f"{path} is not a safetensors file: its header is not a JSON object")
    data_size = size - 8 - n
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2):
            raise UnreadableFile(f"{path}: tensor '{key}' has no valid data_offsets: not a safetensors file")
        if offsets[1] > data_size:
            raise UnreadableFile(
                f"{path} is truncated: tensor '{key}' needs bytes up to {offsets[1]} of the data "
                f"section, the file has {data_size}"
            )
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise UnreadableFile("reading .safetensors needs the safetensors package: pip install safetensors") from None
    try:
        return load_file(str(path))
    except Exception as err:  # safetensors' own error type differs across versions
        raise UnreadableFile(f"{path}: safetensors could not read it: {err}") from None


def load_batch_file(path: Path) -> dict[str, Any]:
    """The tensors of a batch dump: safetensors, or JSON for small ones. Never unpickles.

    Raises :class:`UnreadableFile` saying what is wrong with the file (missing, a directory, a pickle, truncated,
    not rectangular...).
    """
    path = Path(path)
    if not path.exists():
        raise UnreadableFile(f"no such file: {path}")
    if path.is_dir():
        raise UnreadableFile(f"{path} is a directory")
    if path.suffix.lower() in _PICKLE_SUFFIXES:
        raise UnreadableFile(f"{path}: refusing a {path.suffix} file. {_PICKLE_HINT}")
    with path.open("rb") as fh:
        first = fh.read(64).lstrip()
    if path.suffix.lower() == ".json" or first[:1] == b"{":
        return _load_json(path)
    return _load_safetensors(path)


# ---------------------------------------------------------------------------------------------------------------------
# Checking


def infer_contract(fields: set[str], choice: str = "auto") -> Contract:
    """The contract a dump is checked against: :class:`PolicyBatch` or :class:`PackedTransitions`.

    ``choice`` is ``"policy"``, ``"packed"`` or ``"auto"`` (decided from the field names; :class:`UnreadableFile`
    when they fit neither).
    """
    from lossplug.contracts import PackedTransitions, PolicyBatch

    if choice == "policy":
        return PolicyBatch
    if choice == "packed":
        return PackedTransitions
    if choice != "auto":
        raise ValueError(f"contract must be 'auto' or one of {CONTRACTS}, got {choice!r}")
    if fields & {"logp", "action_mask", "old_logp", "behavior_logp", "advantage"}:
        return PolicyBatch
    if fields & {"next_value", "boundary"}:
        return PackedTransitions
    raise UnreadableFile(
        f"cannot tell the contract from the fields {sorted(fields)}: a PolicyBatch has logp and "
        "action_mask, PackedTransitions have next_value and boundary; pass --contract policy|packed"
    )


@dataclass(frozen=True)
class BatchWarning:
    """Something valid but probably unintended, e.g. groups that cannot produce a learning signal."""

    field: str
    message: str
    where: str = ""
    #: the values the warning is about in full (``where`` shows only the first few)
    values: tuple[Any, ...] = ()


@dataclass
class BatchCheck:
    """The outcome of :func:`check_batch`: every violation, the warnings, and the batch when the contract built it."""

    contract: Contract
    violations: list[Violation] = field(default_factory=list)
    warnings: list[BatchWarning] = field(default_factory=list)
    batch: Any = None

    @property
    def valid(self) -> bool:
        """No violation; warnings do not count."""
        return not self.violations


def _contract_violations(tensors: dict[str, Any], contract: Contract) -> tuple[list[Violation], Any]:
    import torch

    from lossplug.contracts import BatchValidationError

    try:
        return [], contract(**tensors)
    except BatchValidationError as err:
        violations = list(err.violations)
    # The contract stops at the first layer of problems (unknown fields; then dtypes and shapes, before the value
    # rules). Name everything at once: check again without the unknown fields, then also with 0/1 masks as bool.
    known = {k: v for k, v in tensors.items() if k in contract.FIELD_NAMES}
    as_bool = dict(known)
    for name in ("action_mask", "terminated", "boundary"):
        t = as_bool.get(name)
        if t is not None and t.dtype != torch.bool and not t.is_complex() and bool(((t == 0) | (t == 1)).all()):
            as_bool[name] = t.bool()
    for retry in (known, as_bool):
        if retry.keys() == tensors.keys() and all(retry[k] is tensors[k] for k in retry):
            continue  # nothing removed or converted: the first check already said everything about it
        try:
            contract(**retry)
        except BatchValidationError as err:
            violations.extend(v for v in err.violations if v not in violations)
    return violations, None


def _usable_ids(group_id: Any) -> TypeGuard[Tensor]:
    """A 1-D integer tensor: anything else is the contract's to report, not ours to count."""
    import torch

    return (
        group_id is not None
        and group_id.ndim == 1
        and group_id.dtype != torch.bool
        and not group_id.dtype.is_floating_point
        and not group_id.is_complex()
    )


def name_values(values: list[Any], shown: int = SHOWN_GROUPS) -> str:
    """``"3, 7, 9"``, or the first ``shown`` and how many more: a warning must stay one readable line."""
    head = ", ".join(str(v) for v in values[:shown])
    return head if len(values) <= shown else f"{head} … and {len(values) - shown} more"


def singleton_group_warning(
    group_id: Tensor, plugin: AdvantagePlugin, params: Params | None = None
) -> BatchWarning | None:
    """A warning naming the groups of one rollout, when ``plugin`` (with ``params``, or its defaults) scores
    rollouts against their group.

    An advantage estimator that reads ``group_id`` and accepts groups of one (``grpo``, and so ``dapo``) compares
    each rollout with the others of its prompt: a lone rollout has no others and gets advantage 0, so it costs a
    forward and backward pass and teaches nothing. Estimators that refuse small groups (``min_group_size ≥ 2``, as
    ``rloo``) report a violation instead; estimators that do not read ``group_id`` never see groups.
    """
    import torch

    from lossplug.needs import required_fields

    if plugin.min_group_size >= 2 or "group_id" not in required_fields(plugin, params):
        return None
    ids, counts = torch.unique(group_id, return_counts=True)
    lone = ids[counts == 1].tolist()
    if not lone:
        return None
    return BatchWarning(
        "group_id",
        f"{len(lone)} of {len(ids)} groups have a single rollout: advantage '{plugin.name}' compares each rollout "
        "with the others of its group, so these get advantage 0 and teach nothing (sample several rollouts per "
        "prompt, or use an estimator that needs no groups)",
        f"group_id {name_values(lone)}",
        tuple(lone),
    )


def check_batch(tensors: dict[str, Any], contract: Contract, recipe: Recipe | None = None) -> BatchCheck:
    """Every violation of ``contract`` at once, then what ``recipe`` (a :class:`Recipe` or None) adds: the fields
    its stages need, its advantage's group-size rule, its plugins' own validators — and warnings that do not make
    the batch invalid (groups of one rollout under a group-relative advantage).

    Raises a :class:`PluginError` when a plugin validator fails, naming the plugin.
    """
    from lossplug.contracts import PolicyBatch, Violation
    from lossplug.needs import ALWAYS, missing_field, one_line_each, recipe_needs, required_fields
    from lossplug.pipeline import compile_recipe
    from lossplug.validation import group_violations, plugin_validator_violations

    violations, batch = _contract_violations(tensors, contract)
    result = BatchCheck(contract, violations, batch=batch)
    if recipe is None:
        return result
    compiled = compile_recipe(recipe)
    adv = compiled.advantage
    if contract is PolicyBatch:
        for field_name, stages in recipe_needs(recipe).items():
            # (the contract names a missing logp or action_mask already: every recipe needs them)
            if field_name not in tensors and field_name not in ALWAYS:
                violations.append(missing_field(field_name, stages, "the file has none"))
        if batch is not None and adv is not None and batch.group_id is not None:
            violations += group_violations(batch, adv.plugin, "recipe.advantage")
        group_id = tensors.get("group_id")
        if adv is not None and _usable_ids(group_id):  # worth saying even when other fields are broken
            warning = singleton_group_warning(group_id, adv.plugin, adv.params)
            if warning is not None:
                result.warnings.append(warning)
    elif adv is None or "packed" not in adv.plugin.layouts:
        what = (
            f"advantage '{adv.plugin.name}' works on {', '.join(adv.plugin.layouts)} batches"
            if adv
            else "the recipe has no advantage stage"
        )
        violations.append(
            Violation("<batch>", f"packed transitions feed only an advantage stage that accepts them; {what}")
        )
    else:
        violations += [
            missing_field(f, (f"advantage '{adv.plugin.name}'",), "the file has none")
            for f in required_fields(adv.plugin, adv.params)
            if f not in tensors
        ]
    if batch is not None and not violations and compiled.has_validators:
        violations += plugin_validator_violations(batch, recipe)
    result.violations = one_line_each(violations)
    return result
