"""Checks of what enters and leaves the pipeline under ``validate="full"``.

Before plugin code runs: the batch's contract (once per batch object), the fields the recipe's stages declare they
need, an advantage's group-size rule, a trainer's weight and the plugins' own ``lossplug_validate_batch`` hooks.
After: that each plugin returned what its kind promises. A bad batch is a :class:`~lossplug.BatchValidationError`
listing every violation; a plugin that breaks its promise a :class:`~lossplug.PluginError` naming it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from lossplug.contracts import (
    BatchValidationError,
    PackedTransitions,
    PolicyBatch,
    Recipe,
    Violation,
)
from lossplug.contracts.errors import LossplugError, PluginError, describe_positions

from . import plugin_registry as _registry
from .needs import missing_field, one_line_each
from .ops import Groups
from .plugin import AdvantagePlugin, GateOutput, GatePlugin, RegularizerOutput, RegularizerPlugin
from .rollout_plugin import FilterPlugin, ShaperPlugin
from .stages import CompiledRecipe, RegularizerStage, Stage, describe_value

Tensor = torch.Tensor


def missing_fields(batch: PolicyBatch | PackedTransitions, fields: Iterable[str], who: str) -> list[Violation]:
    """A violation for each of ``fields`` the batch lacks (or its layout has no such field), blamed on ``who``."""
    contract = type(batch)
    out: list[Violation] = []
    for name in fields:
        if name not in contract.FIELD_NAMES:
            out.append(missing_field(name, (who,), f"the {contract.__name__} layout has no such field"))
        elif getattr(batch, name) is None:
            out.append(missing_field(name, (who,), f"this {contract.__name__} has none"))
    return out


def stage_label(
    stage: Stage[AdvantagePlugin | GatePlugin | RegularizerPlugin | ShaperPlugin | FilterPlugin],
) -> str:
    """'recipe.gates[0] (ppo_clip)', with the parameters that differ from the defaults when those decide what the
    plugin needs (``requires`` given as a function of the parameters)."""
    plugin = stage.plugin
    changed = ""
    if callable(plugin.requires):
        defaults = {k: f.default for k, f in type(stage.params).model_fields.items() if not f.is_required()}
        diff = {k: v for k, v in stage.params.model_dump().items() if defaults.get(k, object()) != v}
        changed = " with " + ", ".join(f"{k}={v!r}" for k, v in diff.items()) if diff else ""
    return f"{stage.where} ({plugin.name}{changed})"


def group_violations(batch: Any, plugin: AdvantagePlugin, where: str) -> list[Violation]:
    """The groups of a padded batch smaller than the advantage ``plugin``'s ``min_group_size`` (a violation of
    ``group_id`` listing the first eight), or none."""
    if plugin.min_group_size <= 1 or batch.group_id is None:
        return []
    groups = Groups.from_ids(batch.group_id)
    small = groups.counts < plugin.min_group_size
    if not bool(small.any()):
        return []
    ids = torch.unique(batch.group_id)[small]
    more = f", and {ids.numel() - 8} more groups" if ids.numel() > 8 else ""
    return [
        Violation(
            "group_id",
            f"{where} ({plugin.name}) needs at least {plugin.min_group_size} rollouts per group",
            f"groups {ids.tolist()[:8]} have fewer (sizes {groups.counts[small].tolist()[:8]}){more}",
        )
    ]


def plugin_validator_violations(batch: PolicyBatch | PackedTransitions, recipe: Recipe) -> list[Violation]:
    """What the plugins' ``lossplug_validate_batch`` hooks find in ``batch`` for ``recipe``. A hook that answers
    anything but a list of :class:`~lossplug.Violation` (or None) is a :class:`~lossplug.PluginError` naming it."""
    violations: list[Violation] = []
    for origin, found in _registry.call_hook("lossplug_validate_batch", batch=batch, recipe=recipe):
        if not isinstance(found, (list, tuple)) or not all(isinstance(v, Violation) for v in found):
            raise PluginError(
                f"{origin}: lossplug_validate_batch must return a list of "
                f"lossplug.Violation or None, got {describe_value(found)}"
            )
        violations.extend(found)
    return violations


def raise_violations(
    batch: PolicyBatch | PackedTransitions,
    compiled: CompiledRecipe,
    violations: list[Violation],
    *,
    finite_later: bool = False,
) -> tuple[str, ...]:
    """Check the batch's contract (once per batch object) and the plugins' validators; raise a
    :class:`~lossplug.BatchValidationError` listing ``violations`` and whatever those add, if any. ``finite_later``:
    the caller proves the fresh fields' finiteness itself (see :meth:`lossplug.PolicyBatch.check`); returns their
    names."""
    later: tuple[str, ...] = ()
    if not batch.validated:
        later = batch.check(finite_later=True) if finite_later and isinstance(batch, PolicyBatch) else ()
        if not finite_later or not isinstance(batch, PolicyBatch):
            batch.check()
    if compiled.has_validators:
        violations.extend(plugin_validator_violations(batch, compiled.recipe))
    if violations:  # (a field two stages need is one line naming both)
        raise BatchValidationError(type(batch).__name__, one_line_each(violations))
    return later


def check_advantage_output(
    adv: Tensor, batch: PolicyBatch | PackedTransitions, stage: Stage[AdvantagePlugin], what: str
) -> None:
    where = f"{stage.where} ({stage.plugin.name}) returned {what} that"
    shapes: tuple[tuple[int, ...], ...]
    mask: Tensor | None
    if isinstance(batch, PackedTransitions):
        shapes, mask = ((batch.reward.shape[0],),), None
    else:
        shapes, mask = ((batch.batch_size,), tuple(batch.logp.shape)), batch.action_mask
    if tuple(adv.shape) not in shapes:
        raise LossplugError(f"{where} have shape {list(adv.shape)}, expected one of {[list(s) for s in shapes]}")
    bad = ~torch.isfinite(adv)
    if mask is not None and adv.ndim == 2:
        bad = bad & mask
    if bool(bad.any()):
        raise LossplugError(f"{where} are not finite at {describe_positions(bad)}")


def _check_metric_mappings(where: str, out: GateOutput | RegularizerOutput, output_type: str) -> None:
    """A gate's or regularizer's ``metrics`` and ``details`` are mappings; ``output_type`` names the class in the
    error."""
    for name in ("metrics", "details"):
        value = getattr(out, name)
        if not isinstance(value, Mapping):
            raise PluginError(
                f"{where}: {output_type}.{name} must be a mapping of metric name → 0-d tensor (or a "
                f"function returning one), got {describe_value(value)}"
            )


def check_regularizer_output(stage: RegularizerStage, out: object, batch: PolicyBatch) -> None:
    """A regularizer's output before it is used: a :class:`RegularizerOutput` whose term is ``[B, T]`` like logp and
    finite on the actions, metrics declared as mappings, a detached observation tensor."""
    where = f"{stage.where} ({stage.plugin.name}, from {_registry.registry().origin('regularizer', stage.plugin.name)})"
    if not isinstance(out, RegularizerOutput):
        raise PluginError(
            f"{where} must return a lossplug.RegularizerOutput or a [B, T] tensor, got {type(out).__name__}"
        )
    shape = list(batch.logp.shape)
    term = out.term
    if not isinstance(term, Tensor) or list(term.shape) != shape:
        what = f"shape {list(term.shape)}" if isinstance(term, Tensor) else repr(term)
        raise PluginError(f"{where}: a regularizer's term must be a tensor of shape {shape} like logp, got {what}")
    on = batch.action_mask
    if out.token_mask is not None:
        tokens = out.token_mask
        if not isinstance(tokens, Tensor) or list(tokens.shape) != shape or tokens.dtype != torch.bool:
            what = f"{tokens.dtype} {list(tokens.shape)}" if isinstance(tokens, Tensor) else repr(tokens)
            raise PluginError(
                f"{where}: RegularizerOutput.token_mask must be a bool tensor of shape {shape}, got {what}"
            )
        on = tokens
    bad = ~torch.isfinite(term.detach()) & on
    if bool(bad.any()):
        place = "action" if out.token_mask is None else "its token_mask's"
        raise PluginError(f"{where}: its term is not finite on {place} positions at {describe_positions(bad)}")
    _check_metric_mappings(where, out, "RegularizerOutput")
    if out.observation is not None and not isinstance(out.observation, Tensor):
        raise PluginError(
            f"{where}: RegularizerOutput.observation must be a tensor or None, got {describe_value(out.observation)}"
        )


def check_gate_output(stage: Stage[GatePlugin], out: object, batch: PolicyBatch) -> None:
    """What a gate returned, before it is used: an update gate's objective ``[B, T]``, a correction's weight ``[B, T]``
    or ``[B]`` (a ``[B]`` objective would broadcast against ``[B, T]`` silently wrong when B == T); metrics declared
    as mappings. Shapes are read from the batch, never from the gate input (reading a field there would clean it)."""
    where = f"{stage.where} ({stage.plugin.name}, from {_registry.registry().origin('gate', stage.plugin.name)})"
    if not isinstance(out, GateOutput):
        raise PluginError(f"{where} must return a lossplug.GateOutput, got {type(out).__name__}")
    shape = list(batch.logp.shape)
    if stage.plugin.role == "update":
        got = out.objective
        if not isinstance(got, Tensor) or list(got.shape) != shape:
            what = f"shape {list(got.shape)}" if isinstance(got, Tensor) else repr(got)
            raise PluginError(
                f"{where}: an update gate's objective must be a tensor of shape {shape} like logp, got {what}"
            )
    else:
        got = out.weight
        if not isinstance(got, Tensor) or list(got.shape) not in (shape, shape[:1]):
            what = f"shape {list(got.shape)}" if isinstance(got, Tensor) else repr(got)
            raise PluginError(
                f"{where}: a correction's weight must be a tensor of shape {shape[:1]} or {shape}, got {what}"
            )
        if got.requires_grad:
            raise PluginError(
                f"{where}: a correction's weight must be detached (.detach()): gradient flows through "
                "logp only, via the update gate"
            )
    _check_metric_mappings(where, out, "GateOutput")
    if out.active is not None and not (isinstance(out.active, Tensor) or callable(out.active)):
        raise PluginError(
            f"{where}: GateOutput.active must be a bool tensor, a function returning one, or None, got "
            f"{describe_value(out.active)}"
        )


def weight_violations(weight: Tensor, batch: PolicyBatch) -> list[Violation]:
    shapes = ((batch.batch_size,), tuple(batch.logp.shape))
    if tuple(weight.shape) not in shapes:
        return [
            Violation(
                "weight", f"shape must be [B] or [B, T] like logp {list(batch.logp.shape)}, got {list(weight.shape)}"
            )
        ]
    bad = ~torch.isfinite(weight) | (weight < 0)
    if weight.ndim == 2:
        bad = bad & batch.action_mask
    if bool(bad.any()):
        return [Violation("weight", "must be finite and >= 0 on action positions", describe_positions(bad))]
    return []
