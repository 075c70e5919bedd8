"""The compiled form of a recipe and how its plugins are called.

A :class:`Stage` is one resolved plugin with its validated parameters and where the recipe names it; a
:class:`CompiledRecipe` holds a recipe's stages (built by :func:`lossplug.pipeline.compile_recipe`). Plugin code is
called through :func:`run_stage` and :func:`evaluate_declared`, which report a bug inside a plugin as a
:class:`~lossplug.PluginError` naming the stage, the plugin and where it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import torch

from lossplug.contracts import Recipe
from lossplug.contracts.errors import LossplugError, PluginError

from . import plugin_registry as _registry
from .plugin import (
    AdvantagePlugin,
    GatePlugin,
    Lazy,
    Params,
    ReductionPlugin,
    RegularizerParams,
    RegularizerPlugin,
    StepController,
    evaluate,
)

Tensor = torch.Tensor
#: the plugin class of a stage: a CompiledRecipe's advantage stage holds an AdvantagePlugin, and so on
_P = TypeVar("_P", bound=AdvantagePlugin | GatePlugin | ReductionPlugin | RegularizerPlugin, covariant=True)


@dataclass(frozen=True)
class Stage(Generic[_P]):
    plugin: _P
    params: Params
    where: str


@dataclass(frozen=True)
class RegularizerStage(Stage[RegularizerPlugin]):
    """A regularizer stage: its plugin and parameters, the reduction of its term (its own, else the recipe's), its
    live controller (None: the coefficient is ``params.coef``) and the name its metrics go under (``reg/<name>/``;
    ``<name>.<i>`` when the recipe has the same regularizer twice)."""

    reduction: Stage[ReductionPlugin]
    controller: StepController | None
    metric_name: str

    @property
    def coefficient(self) -> float:
        """The coefficient in force: the controller's, else the recipe's ``coef``."""
        if self.controller is not None:
            return self.controller.coefficient
        return cast(RegularizerParams, self.params).coef


@dataclass(frozen=True)
class CompiledRecipe:
    recipe: Recipe
    advantage: Stage[AdvantagePlugin] | None
    update: Stage[GatePlugin]
    corrections: tuple[Stage[GatePlugin], ...]
    reduction: Stage[ReductionPlugin]
    has_validators: bool
    has_metric_hooks: bool
    generation: int
    regularizers: tuple[RegularizerStage, ...] = ()

    @property
    def gates(self) -> tuple[Stage[GatePlugin], ...]:
        return (self.update,) + self.corrections


# ---------------------------------------------------------------------------------------------------------------------
# Running plugin code: a bug inside a plugin is reported as a PluginError naming the plugin and where it came from

#: exceptions that pass through unchanged: trainers handle them themselves (e.g. skip a batch on out-of-memory)
PASS_THROUGH = tuple(t for t in (LossplugError, MemoryError, getattr(torch, "OutOfMemoryError", None)) if t)


def describe_value(value: object) -> str:
    inner = ""
    if isinstance(value, (list, tuple)) and value:
        inner = f" of {', '.join(sorted({type(v).__name__ for v in value}))}"
    return f"a {type(value).__name__}{inner}"


def plugin_failed(stage: Stage[Any], err: Exception, validate: str, what: str = "") -> PluginError:
    plugin = stage.plugin
    origin = _registry.registry().origin(plugin.kind, plugin.name)
    hint = (
        " (the batch was not validated: run once with validate='full' to rule out bad input)"
        if validate == "off"
        else ""
    )
    what = f" {what}" if what else ""
    return PluginError(f"{stage.where} ({plugin.name}, from {origin}){what} raised {type(err).__name__}: {err}{hint}")


def run_stage(stage: Stage[Any], validate: str, *args: Any) -> Any:
    """Call a stage's plugin with its parameters."""
    try:
        return stage.plugin(*args, stage.params)
    except PASS_THROUGH:
        raise
    except Exception as err:
        raise plugin_failed(stage, err, validate) from err


def evaluate_declared(stage: Stage[GatePlugin | RegularizerPlugin], what: str, value: Lazy, validate: str) -> Tensor:
    try:
        return evaluate(value)
    except PASS_THROUGH:
        raise
    except Exception as err:
        raise plugin_failed(stage, err, validate, what=f"evaluating {what}") from err
