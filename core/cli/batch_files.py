"""Batch dumps on disk: reading them safely and checking them against the contracts and a recipe.

A dump is a ``.safetensors`` file, or JSON (field → nested lists, or ``{"data": ..., "dtype": ...}``) for small
ones. Nothing here ever unpickles: unpickling runs arbitrary code, so ``.pt``/pickle files are refused with the
one-line fix. ``lossplug validate`` is built on this module; so can be any tool that inspects dumped batches.
Heavy imports (torch, safetensors) happen inside the functions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
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


def _load_json(path: Path) -> BatchFile:
    from lossplug.cli.json_batch import field_tensor

    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UnreadableFile(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise UnreadableFile(
            f"{path}: expected a JSON object mapping field names to (nested) lists, got {type(data).__name__}"
        )
    read = BatchFile({})
    for name, value in data.items():
        tensor, problems = field_tensor(name, value)
        if tensor is not None:
            read.tensors[name] = tensor
        read.problems += problems
    return read


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


@dataclass
class BatchFile:
    """What a batch dump holds: the tensors read, and the fields it holds that could not be read as tensors — a
    JSON field with ragged rows, uneven nesting, a string among its numbers… — each a violation naming the field,
    the rule and the JSON path. A safetensors file has none: its tensors are rectangular by construction."""

    tensors: dict[str, Any]
    problems: list[Violation] = field(default_factory=list)

    @property
    def field_names(self) -> set[str]:
        """Every field the file holds, read or not."""
        return set(self.tensors) | {v.field for v in self.problems}


def read_batch_file(path: Path | str) -> BatchFile:
    """The tensors of a batch dump, and the fields that could not be read (see :class:`BatchFile`). Never unpickles.

    Raises :class:`UnreadableFile` when the file as a whole cannot be read: missing, a directory, a pickle,
    truncated, not safetensors, not JSON, not a JSON object.
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
    return BatchFile(_load_safetensors(path))


def load_batch_file(path: Path | str) -> dict[str, Any]:
    """The tensors of a batch dump: safetensors, or JSON for small ones. Never unpickles.

    Raises :class:`UnreadableFile` saying what is wrong with the file (missing, a directory, a pickle, truncated…),
    or naming every field that cannot be read as a tensor, with its JSON path. :func:`read_batch_file` returns those
    fields' problems beside the tensors instead.
    """
    read = read_batch_file(path)
    if read.problems:
        n = len(read.problems)
        lines = "\n".join(f"  - {v}" for v in read.problems)
        raise UnreadableFile(f"{path}: {n} problem{'s' if n != 1 else ''} in its fields:\n{lines}")
    return read.tensors


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
    #: the fields the file holds but that could not be read as tensors (their problems lead ``violations``)
    unreadable: tuple[str, ...] = ()

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
    if not _anchor_usable(tensors, contract):
        violations.extend(v for v in own_field_violations(tensors, contract) if v not in violations)
    return violations, None


def _anchor_usable(tensors: dict[str, Any], contract: Contract) -> bool:
    """Whether the contract's cross-field rules ran: they measure every field by one (logp; reward when packed), and
    only once that field has its rank and at least one row."""
    import torch

    from lossplug.contracts.batch import SHAPES

    anchor = contract.RULES.anchor
    t = tensors.get(anchor)
    depth = SHAPES[contract.SPECS[anchor].shape][1]
    return t is not None and t.layout == torch.strided and t.ndim == depth and t.shape[0] > 0


def own_field_violations(tensors: dict[str, Any], contract: Contract) -> list[Violation]:
    """Each field's rank and dtype kind, checked against its declaration alone, in the contract's field order.

    The contract measures the fields by one of them (``logp``; ``reward`` when packed) and stops when that one is
    missing or of the wrong rank; these checks need no other field, so that a 3-D ``logp`` does not hide a 1-D
    ``action_mask``. The measuring field's own rank is left to the contract, which names it first.
    """
    from lossplug.contracts.batch import SHAPES
    from lossplug.contracts.checks import Checks

    checks = Checks(contract.__name__)
    for name in contract.FIELD_NAMES:
        t = tensors.get(name)
        if t is None:
            continue
        spec = contract.SPECS[name]
        depth = SHAPES[spec.shape][1]
        if name != contract.RULES.anchor and t.ndim not in (depth if isinstance(depth, tuple) else (depth,)):
            checks.fail(name, f"must be {spec.shape_text}, got shape {list(t.shape)}")
        checks.dtype(name, t, spec.kind)
    return checks.violations


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


#: the log-prob sources that may rightly hold equal values: on a single on-policy step the policy before the update is
#: the current one (TRL's ``old_logp = logp.detach()``), and without a separate rollout engine it sampled the tokens
_ONE_POLICY = frozenset({"current", "old", "behavior"})
#: whose log-probs each source is, as a warning says it
_SOURCE_WORDS = {
    "current": "the current policy",
    "old": "the policy before this update",
    "behavior": "the rollout engine's policy",
    "ref": "the frozen reference",
    "teacher": "the teacher",
}
#: how many times farther from its anchor a log-prob must be than a different policy's for a warning: two orders of
#: magnitude, so that an engine mismatch (a rollout engine against the training engine, one policy) is never taken
#: for the distance to the reference, which is a different policy everywhere but at the first steps
SWAP_RATIO = 100.0
#: (anchor, near, far): ``near`` is the anchor's policy (another engine, or the same weights earlier in the step),
#: ``far`` a different policy; ``near`` far from the anchor while ``far`` sits next to it is a swap of the two
_DISTANCES = (("old_logp", "behavior_logp", "ref_logp"), ("logp", "old_logp", "ref_logp"))


def _logprobs_on_actions(tensors: dict[str, Any]) -> dict[str, Tensor]:
    """Each log-prob field's values on the action positions, for the fields whose shape and kind allow reading them
    (the contract names the others); empty without a usable ``action_mask`` or any action."""
    import torch

    from lossplug.contracts import PolicyBatch

    mask = tensors.get("action_mask")
    if mask is None or mask.ndim != 2 or mask.is_complex() or mask.is_floating_point():
        return {}
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            return {}
        mask = mask.bool()
    if not bool(mask.any()):
        return {}
    out = {}
    for name in PolicyBatch.LOGPROBS:
        t = tensors.get(name)
        if t is not None and t.shape == mask.shape and t.is_floating_point():
            out[name] = t.detach()[mask]
    return out


def _source(name: str) -> str:
    from lossplug.contracts import PolicyBatch

    return PolicyBatch.SPECS[name].source or ""


def _same_values(a: Tensor, b: Tensor) -> bool:
    """Bitwise equal, in the coarser dtype of the two when they differ: a bf16 copy of float32 log-probs is a copy."""
    import torch

    if a.dtype != b.dtype:
        coarser = a.dtype if torch.finfo(a.dtype).eps >= torch.finfo(b.dtype).eps else b.dtype
        a, b = a.to(coarser), b.to(coarser)
    return torch.equal(a, b)


def _equal_logprob_warnings(values: dict[str, Tensor], reads: set[str] | None) -> list[BatchWarning]:
    """One warning per field bitwise equal to fields of other policies (all of them named)."""
    found = []
    names = list(values)
    for i, name in enumerate(names):
        equal = [
            other
            for other in names[:i]
            if not {_source(name), _source(other)} <= _ONE_POLICY
            and (reads is None or {name, other} <= reads)
            and _same_values(values[other], values[name])
        ]
        if not equal:
            continue
        sources = {_source(name), *map(_source, equal)}
        early = (
            " (expected only at the first step, while the policy is still the reference)" if "ref" in sources else ""
        )
        others = " and ".join(f"{other} ({_SOURCE_WORDS[_source(other)]})" for other in equal)
        found.append(
            BatchWarning(
                name,
                f"bitwise equal to {others} on every action position ({values[name].numel()} tokens), yet it should "
                f"hold {_SOURCE_WORDS[_source(name)]}'s log-probs: one was probably passed for the other{early}",
            )
        )
    return found


def _distant_logprob_warnings(values: dict[str, Tensor], reads: set[str] | None) -> list[BatchWarning]:
    found = []
    for anchor, near, far in _DISTANCES:
        if not {anchor, near, far} <= values.keys() or (reads is not None and not {near, far} & reads):
            continue
        if _same_values(values[far], values[anchor]):  # a copy: the warning above says it
            continue
        base = values[anchor].double()
        to_near = float((values[near].double() - base).abs().mean())
        to_far = float((values[far].double() - base).abs().mean())
        if not (0 < to_far < math.inf and to_near >= SWAP_RATIO * to_far):
            continue
        words = {name: _SOURCE_WORDS[_source(name)] for name in (anchor, near, far)}
        found.append(
            BatchWarning(
                near,
                f"{to_near / to_far:.0f}× farther from {anchor} than {far} is (mean |Δ| on the actions {to_near:.3g} "
                f"against {to_far:.3g}), yet {near} ({words[near]}) should sit close to {anchor} ({words[anchor]}) "
                f"and {far} ({words[far]}) farther: {near} and {far} look swapped (unless this is one of the first "
                "steps, while the policy is still close to the reference)",
            )
        )
    return found


def logprob_swap_warnings(tensors: dict[str, Any], reads: set[str] | None = None) -> list[BatchWarning]:
    """Warnings that log-probs of one policy were passed for another's — valid batches that train on the wrong
    numbers. ``reads``: the fields the recipe reads (None without a recipe: every field given counts as read).

    * two fields of different policies bitwise equal on every action position (``ref_logp`` a copy of
      ``old_logp``), when both are read. Fields of the one policy being trained (``logp``, ``old_logp``,
      ``behavior_logp``) may rightly be equal;
    * a field :data:`SWAP_RATIO` times farther (mean absolute difference on the actions) from the field of its own
      policy than a different policy's field is: ``behavior_logp`` far from ``old_logp`` while ``ref_logp`` sits next
      to it, or ``old_logp`` far from ``logp`` while ``ref_logp`` sits next to it — the two look swapped.

    For the validate command and tools that inspect dumps; ``policy_loss`` never runs it (it reads whole tensors).
    """
    values = _logprobs_on_actions(tensors)
    return _equal_logprob_warnings(values, reads) + _distant_logprob_warnings(values, reads)


def check_batch(
    tensors: dict[str, Any],
    contract: Contract,
    recipe: Recipe | None = None,
    *,
    unreadable: Sequence[Violation] = (),
) -> BatchCheck:
    """Every violation of ``contract`` at once, then what ``recipe`` (a :class:`Recipe` or None) adds: the fields
    its stages need, its advantage's group-size rule, its plugins' own validators — and warnings that do not make
    the batch invalid (groups of one rollout under a group-relative advantage, log-probs of one policy passed for
    another's).

    ``unreadable``: the problems of fields the file holds but that could not be read as tensors
    (:attr:`BatchFile.problems`): they come first, and such a field is not called missing.

    Raises a :class:`PluginError` when a plugin validator fails, naming the plugin.
    """
    from lossplug.contracts import PolicyBatch, Violation
    from lossplug.needs import ALWAYS, missing_field, one_line_each, recipe_needs, required_fields
    from lossplug.pipeline import compile_recipe
    from lossplug.validation import group_violations, plugin_validator_violations

    broken = {v.field for v in unreadable}
    violations, batch = _contract_violations(tensors, contract)
    violations = [
        *_known_field_problems(unreadable, contract),
        *(v for v in violations if not (v.field in broken and v.rule == "is required")),
    ]
    result = BatchCheck(contract, violations, batch=batch, unreadable=tuple(dict.fromkeys(v.field for v in unreadable)))
    needs = recipe_needs(recipe) if recipe is not None and contract is PolicyBatch else None
    if contract is PolicyBatch:
        result.warnings += logprob_swap_warnings(tensors, set(needs) if needs is not None else None)
    if recipe is None:
        return result
    compiled = compile_recipe(recipe)
    adv = compiled.advantage
    if needs is not None:
        for field_name, stages in needs.items():
            # (the contract names a missing logp or action_mask already: every recipe needs them)
            if field_name not in tensors and field_name not in ALWAYS and field_name not in broken:
                violations.append(missing_field(field_name, stages, "the file has none"))
        if batch is not None and adv is not None and batch.group_id is not None:
            violations += group_violations(batch, adv.plugin, "recipe.advantage")
        group_id = tensors.get("group_id")
        if adv is not None and _usable_ids(group_id):  # worth saying even when other fields are broken
            warning = singleton_group_warning(group_id, adv.plugin, adv.params)
            if warning is not None:
                result.warnings.insert(0, warning)
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
            if f not in tensors and f not in broken
        ]
    if batch is not None and not violations and compiled.has_validators:
        violations += plugin_validator_violations(batch, recipe)
    result.violations = one_line_each(violations)
    return result


def _known_field_problems(unreadable: Sequence[Violation], contract: Contract) -> list[Violation]:
    """The read problems of the contract's fields; a field it does not know is one line saying so instead (its
    value does not matter), as the contract says it of a field that was read."""
    from lossplug.contracts import Violation
    from lossplug.contracts.errors import did_you_mean

    names = contract.FIELD_NAMES
    out: list[Violation] = []
    for v in unreadable:
        if v.field in names:
            out.append(v)
        else:
            unknown = Violation(
                v.field, "unknown field" + did_you_mean(v.field, names), f"fields are: {', '.join(names)}"
            )
            if unknown not in out:
                out.append(unknown)
    return out
