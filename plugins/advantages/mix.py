"""A = Σ_j w_j · A_j: a weighted mix of advantage estimators (Hübotter et al., 2026, arXiv:2601.20802, Eq. 3, the
λ-mix A = λ·A_GRPO + (1 − λ)·A_SDPO that TRL issue #7291 asks for); no trainer ships it (TRL 1.16, verl 0.9.1).

Each component ``j`` is a registered advantage estimator with its own parameters — validated by that estimator's
own parameter model, its errors naming the component's position — run alone on the batch, then weighted::

    A_i = Σ_j w_j · A_j,i          in the recipe's order, each A_j exactly what the estimator gives on its own

``reward_column: k`` makes a component read column ``k`` of ``PolicyBatch.reward_components`` ``[B, K]`` (one column
per reward function) as its reward, so that each reward goes through its own estimator and normalisation before the
weighted sum — the decoupled normalisation of GDPO (Liu et al., 2026, arXiv:2601.05242) with any estimator per
reward, e.g. GRPO for correctness and RLOO for a format reward; without it a component reads ``reward``.

* Shapes: all ``[B]`` advantages mix to ``[B]``; when one component is per token (``[B, T]``, e.g. ``opd``), every
  ``[B]`` advantage is broadcast over its response and the mix is ``[B, T]``, 0 off the action tokens (a gate
  broadcasts a ``[B]`` advantage the same way). Padded batches only (a component must accept the padded layout).
* Groups: each component's ``min_group_size`` is checked before it runs (RLOO: 2), naming the component.
* Returns: a critic-based estimator (``gae``) also returns the critic's targets ``A + V_old``; a mix has no single
  such target, so ``returns_from: j`` must name the component whose returns the critic learns (the policy learns
  from the mix, the critic from its own estimator's targets); a component that returns targets when
  ``returns_from`` names another one, or none, is refused.
* Metrics: ``mix/<name>/mean`` and ``std`` of each component's advantage (``<name>.<j>`` when an estimator appears
  twice) and that component's own metrics under the same prefix.
* A mix inside a mix is refused (write its components out, the weights multiplied): one level keeps the recipe's
  record and ``recipe explain`` flat.

The parameters sit beside ``name`` as in any stage; ``weight`` and ``reward_column`` are the mix's own keys::

    advantage:
      name: mix
      components:
        - {name: grpo, weight: 0.5, scale: none}
        - {name: rloo, weight: 0.5}

Paper: Hübotter et al., 2026, *Reinforcement Learning via Self-Distillation*, arXiv:2601.20802 (Eq. 3, the λ-mix of
advantages); GDPO (Liu et al., 2026, arXiv:2601.05242) for normalising each reward separately before the sum.

Reference: TRL issue #7291 (*Support custom/composable advantage computation across trainers*, the requested
feature; TRL 1.16 has no such hook, #4525); TRL 1.16 ``multi_objective_aggregation="normalize_then_sum"`` and verl
0.9.1 ``compute_gdpo_outcome_advantage`` (one GRPO per reward, then a weighted sum) for the per-reward form.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import torch
from pydantic import Field, ValidationError, field_validator, model_validator

import lossplug
from lossplug import plugin_registry
from lossplug.contracts import BatchValidationError, LossplugError, PluginError
from lossplug.plugin import AdvantagePlugin
from lossplug.recipe_catalogue import format_param_errors
from lossplug.stages import PASS_THROUGH, Stage
from lossplug.validation import check_advantage_output, group_violations

Tensor = torch.Tensor

#: the mix's own keys in a component, beside the estimator's ``name`` and parameters
OWN_KEYS = ("weight", "reward_column")
#: where the mix sits in a recipe (an advantage stage has one place), so errors from inside it name the component
WHERE = "recipe.advantage (mix)"


def _component_error(i: int, name: object, message: str) -> str:
    label = f"components[{i}]" + (f" ({name})" if isinstance(name, str) else "")
    return f"{label}: {message}"


def _check_component(i: int, raw: object) -> dict[str, Any]:
    """Component ``i`` with its estimator's parameters validated and their defaults filled in; a ValueError naming
    the component's position otherwise."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("name"), str):
        raise ValueError(
            _component_error(
                i,
                None,
                f"give a mapping with the estimator's name and a weight, e.g. {{name: grpo, weight: 0.5}}, got {raw!r}",
            )
        )
    name = cast(str, raw["name"])
    if name == "mix":
        raise ValueError(
            _component_error(
                i,
                name,
                "a mix cannot contain a mix: write its components out here, each weight "
                "multiplied by the inner mix's weight",
            )
        )
    try:
        plugin = plugin_registry.registry().lookup("advantage", name, f"components[{i}]")
    except LossplugError as err:
        raise ValueError(str(err)) from None
    if "padded" not in plugin.layouts:
        raise ValueError(
            _component_error(
                i,
                name,
                f"works on the {' / '.join(plugin.layouts)} layout only; a mix combines "
                "advantages of a padded PolicyBatch",
            )
        )
    clash = [key for key in OWN_KEYS if key in plugin.params.model_fields]
    if clash:
        raise ValueError(
            _component_error(
                i,
                name,
                f"its parameter(s) {clash} have the name of the mix's own keys {list(OWN_KEYS)}; it cannot be mixed",
            )
        )
    if "weight" not in raw:
        raise ValueError(_component_error(i, name, "weight is required (the component's w_j in Σ_j w_j · A_j)"))
    weight = raw["weight"]
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise ValueError(_component_error(i, name, f"weight must be a finite number, got {weight!r}"))
    column = raw.get("reward_column")
    if column is not None and (isinstance(column, bool) or not isinstance(column, int) or column < 0):
        raise ValueError(
            _component_error(
                i,
                name,
                f"reward_column must be a column index ≥ 0 of reward_components (or null: read reward), got {column!r}",
            )
        )
    own = {k: v for k, v in raw.items() if k not in ("name", *OWN_KEYS)}
    try:
        params = plugin.params.model_validate(own)
    except ValidationError as err:
        raise ValueError(format_param_errors(err, f"components[{i}]", name, list(plugin.params.model_fields))) from None
    # the record names every parameter, defaults included, as a stage's does
    return {"name": name, "weight": float(weight), "reward_column": column, **params.model_dump()}


#: (registry generation, the components' record) → their plugins and parameters: resolved once, not per batch (keyed
#: by value, never by id(), which Python reuses)
_RESOLVED: dict[tuple[int, str], tuple[tuple[AdvantagePlugin, lossplug.Params], ...]] = {}


class MixParams(lossplug.Params):
    components: tuple[dict[str, Any], ...] = Field(
        (
            {"name": "grpo", "weight": 0.5, "reward_column": None},
            {"name": "rloo", "weight": 0.5, "reward_column": None},
        ),
        description=(
            "the estimators mixed, in order: each {name, weight, reward_column (null: reward; k: column k of "
            "reward_components), and that estimator's own parameters}; default: an even mix of grpo and rloo"
        ),
        min_length=1,
        validate_default=True,  # the default is recorded like a given value: every parameter named
    )
    returns_from: int | None = Field(
        None,
        ge=0,
        description="the component whose returns (a critic's targets A + V_old) the mix returns; needed when one "
        "component has a critic (gae)",
    )

    @field_validator("components", mode="before")
    @classmethod
    def _check_components(cls, value: Any) -> tuple[dict[str, Any], ...]:
        if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
            raise ValueError(f"components must be a list of {{name, weight, ...}} mappings, got {value!r}")
        items = list(value)
        problems: list[str] = []
        checked: list[dict[str, Any]] = []
        for i, raw in enumerate(items):
            try:
                checked.append(_check_component(i, raw))
            except ValueError as err:
                problems.append(str(err))
        if problems:  # every component's problems at once, without pydantic's "Value error," prefix
            raise ValueError("; ".join(problems))
        return tuple(checked)

    @model_validator(mode="after")
    def _returns_from_names_a_component(self) -> MixParams:
        if self.returns_from is not None and self.returns_from >= len(self.components):
            raise ValueError(
                f"returns_from is {self.returns_from}, but there are {len(self.components)} components "
                f"(0 … {len(self.components) - 1})"
            )
        return self

    def resolved(self) -> tuple[tuple[AdvantagePlugin, lossplug.Params], ...]:
        """Each component's plugin and validated parameters (cached per registry generation)."""
        reg = plugin_registry.registry()
        key = (reg.generation, repr(self.components))
        found = _RESOLVED.get(key)
        if found is None:
            out = []
            for i, component in enumerate(self.components):
                plugin = reg.lookup("advantage", component["name"], f"{WHERE}: components[{i}]")
                own = {k: v for k, v in component.items() if k not in ("name", *OWN_KEYS)}
                out.append((plugin, plugin.params.model_validate(own)))
            if len(_RESOLVED) >= 64:  # a bound: recipes are few, a long sweep must not grow it without end
                _RESOLVED.clear()
            found = _RESOLVED[key] = tuple(out)
        return found

    def sub_stages(self) -> list[tuple[str, AdvantagePlugin, lossplug.Params, str]]:
        """``(label, plugin, params, role)`` of each component, for ``recipe explain``."""
        rows = []
        for i, ((plugin, params), component) in enumerate(zip(self.resolved(), self.components)):
            column = component["reward_column"]
            reads = "reward" if column is None else f"reward_components[:, {column}]"
            rows.append((f"components[{i}]", plugin, params, f"× {component['weight']:g} · reads {reads}"))
        return rows


def _requires(p: MixParams) -> tuple[str, ...]:
    """The union of what the components read; a component with a ``reward_column`` reads ``reward_components``
    instead of ``reward``."""
    needed: list[str] = []
    for (plugin, params), component in zip(p.resolved(), p.components):
        fields = list(plugin.required_fields(params))
        if component["reward_column"] is not None:
            fields = ["reward_components" if f == "reward" else f for f in fields]
            fields.append("reward_components")
        needed += fields
    return tuple(dict.fromkeys(needed))


def _metric_names(components: tuple[dict[str, Any], ...]) -> list[str]:
    names = [c["name"] for c in components]
    return [n if names.count(n) == 1 else f"{n}.{j}" for j, n in enumerate(names)]


def _component_batch(batch: lossplug.PolicyBatch, j: int, component: dict[str, Any]) -> lossplug.PolicyBatch:
    column = component["reward_column"]
    if column is None:
        return batch
    components = cast(Tensor, batch.reward_components)  # set: required when a component names a column
    if column >= components.shape[1]:
        raise LossplugError(
            f"{WHERE}: components[{j}] ({component['name']}) reads reward_column {column}, but reward_components "
            f"has {components.shape[1]} columns (0 … {components.shape[1] - 1})"
        )
    return lossplug.PolicyBatch.unchecked(**{**batch.fields(), "reward": components[:, column]})


def _run_component(
    j: int, plugin: AdvantagePlugin, params: lossplug.Params, batch: lossplug.PolicyBatch
) -> lossplug.AdvantageResult:
    where = f"{WHERE}: components[{j}]"
    too_small = group_violations(batch, plugin, where)
    if too_small:
        raise BatchValidationError(type(batch).__name__, too_small)
    try:
        result = plugin(batch, params)
    except PASS_THROUGH:
        raise
    except Exception as err:
        origin = plugin_registry.registry().origin("advantage", plugin.name)
        raise PluginError(f"{where} ({plugin.name}, from {origin}) raised {type(err).__name__}: {err}") from err
    stage = Stage(plugin, params, where)
    check_advantage_output(result.advantage, batch, stage, "advantages")
    if result.returns is not None:
        check_advantage_output(result.returns, batch, stage, "returns")
    return result


@lossplug.advantage("mix", params=MixParams, requires=_requires)
def mix(batch: lossplug.PolicyBatch, p: MixParams) -> lossplug.AdvantageResult:
    """A = Σ_j w_j · A_j: registered estimators, each with its own parameters and reward (column), weighted and summed.

    >>> import torch, lossplug
    >>> batch = lossplug.PolicyBatch(
    ...     logp=torch.zeros(4, 1), action_mask=torch.ones(4, 1, dtype=torch.bool),
    ...     reward=torch.tensor([1.0, 0.0, 0.0, 0.0]), group_id=torch.tensor([0, 0, 0, 0]))
    >>> recipe = {"advantage": {"name": "mix", "components": [
    ...     {"name": "grpo", "weight": 0.5, "scale": "none"}, {"name": "rloo", "weight": 0.5}]},
    ...     "gates": ["reinforce"], "reduction": "token"}
    >>> lossplug.compute_advantages(batch, recipe)  # 0.5·(R − mean) + 0.5·(R − mean of the others)
    tensor([ 0.8750, -0.2917, -0.2917, -0.2917])

    Paper: Hübotter et al., 2026, arXiv:2601.20802, Eq. 3.

    Reference: TRL issue #7291 (the requested λ-mix of advantages).
    """
    advantages: list[Tensor] = []
    metrics: dict[str, Tensor] = {}
    returns: Tensor | None = None
    names = _metric_names(p.components)
    for j, ((plugin, params), component) in enumerate(zip(p.resolved(), p.components)):
        result = _run_component(j, plugin, params, _component_batch(batch, j, component))
        adv = result.advantage
        if result.returns is not None and p.returns_from != j:
            raise LossplugError(
                f"{WHERE}: components[{j}] ({plugin.name}) returns critic targets (returns = A + V_old), and a mix of "
                f"advantages has no single target: set returns_from: {j} to train the critic on this component's "
                f"returns" + (f" (returns_from is {p.returns_from})" if p.returns_from is not None else "")
            )
        if p.returns_from == j:
            if result.returns is None:
                raise LossplugError(
                    f"{WHERE}: returns_from is {j}, but components[{j}] ({plugin.name}) returns no critic targets "
                    "(only a critic-based estimator such as gae does): name that component, or leave returns_from null"
                )
            returns = result.returns
        advantages.append(adv)
        prefix = f"mix/{names[j]}"
        if adv.numel():
            values = adv[batch.action_mask] if adv.ndim == 2 else adv
            metrics[f"{prefix}/mean"] = values.mean()
            metrics[f"{prefix}/std"] = values.std() if values.numel() > 1 else torch.zeros((), dtype=adv.dtype)
        for key, value in result.metric_tensors.items():
            metrics[f"{prefix}/{key}"] = value
    per_token = any(a.ndim == 2 for a in advantages)
    total: Tensor | None = None
    for component, adv in zip(p.components, advantages):
        term = component["weight"] * (adv.unsqueeze(-1) if per_token and adv.ndim == 1 else adv)
        total = term if total is None else total + term  # in the recipe's order
    assert total is not None  # at least one component (min_length=1)
    if per_token:
        total = torch.where(batch.action_mask, total, torch.zeros_like(total))
    return lossplug.AdvantageResult(advantage=total, returns=returns, metric_tensors=metrics)
