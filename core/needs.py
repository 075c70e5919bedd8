"""Which batch fields a plugin or a whole recipe needs.

The CLI (``show``, ``recipe explain``, ``validate``), the registry's plugin listing, the adapters and the conformance
kit all ask this question; they ask it here so that every answer is the same. The plugin-level primitive is the
plugin's own ``required_fields(params)``; this module adds what callers kept re-deriving around it: the default
parameters when none are given, the fields every policy batch carries anyway, and which stage of a recipe wants what.
"""

from __future__ import annotations

from typing import Any

from lossplug.missing_fields import ON_POLICY_HINT, MissingField, missing_field, one_line_each
from lossplug.requires import required_fields

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

#: what each batch field is, for people reading ``recipe explain`` and ``validate`` output
FIELD_SHAPES = {
    "logp": "[B, T] float — current policy, carries the gradient",
    "action_mask": "[B, T] bool — True on policy actions",
    "old_logp": "[B, T] float — training engine before the update",
    "behavior_logp": "[B, T] float — rollout engine that sampled the tokens",
    "ref_logp": "[B, T] float — frozen reference policy",
    "entropy": "[B, T] float — per-token entropy of the current policy (carries the gradient for a bonus)",
    "advantage": "[B] or [B, T] float",
    "reward": "[B] or [B, T] float",
    "value": "[B, T] float — critic V_old",
    "group_id": "[B] int — prompt group",
    "trajectory_id": "[B] int",
    "terminated": "[B] bool — ended in a terminal state",
    "final_value": "[B] float — value of the real final observation (truncated rows)",
    "next_value": "[N] float — V(s_{t+1})",
    "boundary": "[N] bool — the trace resets after this transition",
}

#: every PolicyBatch carries these, whatever the recipe
ALWAYS = ("logp", "action_mask")


def batch_fields(plugin: Any, params: Any | None = None) -> tuple[str, ...]:
    """Every field a batch must carry for ``plugin`` alone (with ``params``, or its defaults), in a stable order.

    A gate also needs the log-probs, the mask and the advantages it weights; a padded advantage estimator the
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
    if plugin.kind == "advantage":
        base = list(ALWAYS) if "padded" in plugin.layouts else []
        groups = ["group_id"] if plugin.min_group_size > 0 else []
        return tuple(dict.fromkeys([*base, *requires, *groups]))
    return ()


def recipe_needs(recipe: Any) -> dict[str, tuple[str, ...]]:
    """What a :class:`PolicyBatch` must contain for ``recipe``: field → the stages that need it, in recipe order.

    ``recipe`` is a :class:`Recipe`, a preset name or anything ``Recipe.load`` accepts. Stages are described as
    people read a recipe (``advantage 'grpo'``, ``gates[1] 'icepop'``, ``regularizers[0] 'kl'``); ``logp`` and ``action_mask`` are needed
    ``always``. Without an advantage stage the advantages come with the batch.
    """
    from lossplug.contracts import Recipe
    from lossplug.pipeline import compile_recipe

    compiled = compile_recipe(recipe if isinstance(recipe, Recipe) else Recipe.load(recipe))
    needs: dict[str, list[str]] = {field: ["always"] for field in ALWAYS}

    def add(field: str, who: str) -> None:
        stages = needs.setdefault(field, [])
        if who not in stages:
            stages.append(who)

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
