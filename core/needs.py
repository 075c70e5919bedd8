"""Which batch fields a plugin or a whole recipe needs, and the one wording of a field a batch lacks.

One concept, asked everywhere in the same words: the CLI (``show``, ``recipe explain``, ``validate``), the registry's
plugin listing, the pipeline's checks, the adapters and the conformance kit. The plugin-level primitive is
:func:`required_fields` — the optional fields a plugin declares it reads (its ``requires``, possibly a function of
its parameters); :func:`batch_fields` adds what every batch of the plugin's kind carries; :func:`recipe_needs` says
which stage of a recipe wants what; :func:`missing_field` and :func:`one_line_each` word what a batch lacks, one line
per field naming every stage that needs it. What a field *is* (its shape and kind) comes from the contract's own
declaration (:data:`FIELD_SHAPES`, :meth:`lossplug.PolicyBatch.describe_field`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lossplug.contracts.batch import PackedTransitions, PolicyBatch
from lossplug.contracts.errors import Violation
from lossplug.contracts.recipe import Recipe

from .stages import compile_recipe

__all__ = [
    "ALWAYS",
    "FIELD_SHAPES",
    "ON_POLICY_HINT",
    "MissingField",
    "batch_fields",
    "missing_field",
    "one_line_each",
    "recipe_needs",
    "required_fields",
]

#: what each batch field is, in one line — from the contracts' declarations (a field of both: PolicyBatch's)
FIELD_SHAPES: dict[str, str] = {
    **{name: PackedTransitions.describe_field(name) for name in PackedTransitions.FIELD_NAMES},
    **{name: PolicyBatch.describe_field(name) for name in PolicyBatch.FIELD_NAMES},
}

#: every PolicyBatch carries these, whatever the recipe
ALWAYS = tuple(name for name, info in PolicyBatch.model_fields.items() if info.is_required())


def required_fields(plugin: Any, params: Any | None = None) -> tuple[str, ...]:
    """The optional batch fields ``plugin`` reads with ``params``, or with its default parameters when none are given.

    ``requires`` may be a function of the parameters. When no parameters are given and the plugin's parameter model
    has no defaults to build from, only a fixed declaration can be answered; a parameter-dependent one gives ``()``.
    Objects that only carry a ``requires`` attribute (duck-typed plugins in tests and examples) are answered from it.
    """
    if params is not None:
        if hasattr(plugin, "required_fields"):
            return tuple(plugin.required_fields(params))
        requires = getattr(plugin, "requires", ())
        return tuple(requires(params) if callable(requires) else requires)
    if not hasattr(plugin, "required_fields"):
        requires = getattr(plugin, "requires", ())
        return () if callable(requires) else tuple(requires)
    try:
        return tuple(plugin.required_fields(plugin.params()))
    except Exception:  # a parameter without a default: the defaults cannot be built, let alone judged
        return () if callable(plugin.requires) else tuple(plugin.requires)


def batch_fields(plugin: Any, params: Any | None = None) -> tuple[str, ...]:
    """Every field a batch must carry for ``plugin`` alone (with ``params``, or its defaults), in a stable order.

    A shaper or a filter needs the log-probs, the mask and the reward it rewrites or filters by; a gate also needs the
    log-probs, the mask and the advantages it weights; a padded advantage estimator the
    log-probs and the mask of the batch it scores, and ``group_id`` when it works on prompt groups; a regularizer the
    log-probs and the mask and what it declares. A reduction reads what the gates produce, and what it declares (a
    reduction over prompts: ``group_id``).
    """
    requires = required_fields(plugin, params)
    if plugin.kind == "gate":
        return tuple(dict.fromkeys([*ALWAYS, "advantage", *requires]))
    if plugin.kind == "regularizer":
        return tuple(dict.fromkeys([*ALWAYS, *requires]))
    if plugin.kind == "reduction":
        return tuple(requires)
    if plugin.kind in ("shaper", "filter"):  # the rollout side rewrites or filters the batch's rewards
        return tuple(dict.fromkeys([*ALWAYS, "reward", *requires]))
    if plugin.kind == "advantage":
        base = list(ALWAYS) if "padded" in plugin.layouts else []
        groups = ["group_id"] if plugin.min_group_size > 0 else []
        return tuple(dict.fromkeys([*base, *requires, *groups]))
    return ()


def recipe_needs(recipe: Any) -> dict[str, tuple[str, ...]]:
    """What a :class:`PolicyBatch` must contain for ``recipe``: field → the stages that need it, in recipe order.

    ``recipe`` is a :class:`Recipe`, a preset name or anything ``Recipe.load`` accepts. Stages are described as
    people read a recipe (``shapers[0] 'kl_in_reward'``, ``advantage 'grpo'``, ``gates[1] 'icepop'``,
    ``regularizers[0] 'kl'``); ``logp`` and ``action_mask`` are needed
    ``always``. Without an advantage stage the advantages come with the batch.
    """
    compiled = compile_recipe(recipe if isinstance(recipe, Recipe) else Recipe.load(recipe))
    needs: dict[str, list[str]] = {field: ["always"] for field in ALWAYS}

    def add(field: str, who: str) -> None:
        stages = needs.setdefault(field, [])
        if who not in stages:
            stages.append(who)

    rollout_stages: list[tuple[str, Any]] = [
        *((f"shapers[{i}]", stage) for i, stage in enumerate(compiled.shapers)),
        *((f"filters[{i}]", stage) for i, stage in enumerate(compiled.filters)),
    ]
    for where, rollout_stage in rollout_stages:
        for field in ("reward", *required_fields(rollout_stage.plugin, rollout_stage.params)):
            add(field, f"{where} '{rollout_stage.plugin.name}'")
    if compiled.advantage is not None:
        adv = compiled.advantage.plugin
        label = f"advantage '{adv.name}'"
        # an estimator that sets a group size is named once for group_id, with the size when it is a rule (≥ 2)
        grouped = f"{label} (≥ {adv.min_group_size} rollouts per group)" if adv.min_group_size > 1 else label
        fields = required_fields(adv, compiled.advantage.params)
        for field in (*fields, "group_id") if adv.min_group_size > 0 else fields:
            add(field, grouped if field == "group_id" else label)
    else:
        add("advantage", "the recipe has no advantage stage, so advantages come with the batch")
    for i, stage in enumerate(compiled.gates):
        for field in required_fields(stage.plugin, stage.params):
            add(field, f"gates[{i}] '{stage.plugin.name}'")
    for i, reg_stage in enumerate(compiled.regularizers):
        for field in required_fields(reg_stage.plugin, reg_stage.params):
            add(field, f"regularizers[{i}] '{reg_stage.plugin.name}'")
    for field in compiled.reduction.plugin.requires:
        add(field, f"reduction '{compiled.reduction.plugin.name}'")
    return {field: tuple(stages) for field, stages in needs.items()}


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
