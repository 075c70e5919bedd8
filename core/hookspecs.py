"""Hook specifications of lossplug (pluggy project ``lossplug``).

A plugin is any module or object with functions marked ``@lossplug.hookimpl`` and named after a hook below. Third
parties expose theirs through the ``lossplug`` entry-point group::

    [project.entry-points.lossplug]
    my_gates = "my_package.lossplug_plugin"

Code that is not a package (a notebook, a trainer script, a test) registers the same object in-process with
``lossplug.register_plugin(obj)`` and removes it with ``lossplug.unregister_plugin(obj)``. Built-in plugins register
through exactly the same hooks and are found the same way: lossplug's own distribution declares its plugin modules in
the ``lossplug`` entry-point group (``lossplug.plugins.gates``…; see :mod:`lossplug.plugin_discovery`).

The ``register`` hooks run once, when the plugin registry is built (first recipe, ``lossplug list``…), never per
batch. The batch hooks run per batch, only when some plugin implements them. Every hook is documented with a
runnable example in ``docs/plugin-hooks.md``; ``tests/core/test_hookspecs.py`` keeps the two in step.

A hook implementation may take any subset of a hook's arguments, by name. Hook wrappers are not supported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import pluggy

if TYPE_CHECKING:  # annotations only: the hook specs are loaded with the registry, which must not import torch early
    import torch

    from lossplug.contracts import PackedTransitions, PolicyBatch, Recipe, Violation

    from .plugin import AdvantagePlugin, GatePlugin, ReductionPlugin, RegularizerPlugin
    from .rollout_plugin import FilterPlugin, ShaperPlugin

hookspec = pluggy.HookspecMarker("lossplug")


class RegisterPreset(Protocol):
    """The ``register`` callback of :func:`lossplug_register_presets`."""

    def __call__(self, name: str, recipe: Mapping[str, Any], source: str = "") -> None: ...


@hookspec
def lossplug_register_shapers(register: Callable[[ShaperPlugin], None]) -> None:
    """Register reward shapers (the rollout side: they rewrite the reward before the advantage).

    Called once each time the plugin registry is built, like :func:`lossplug_register_advantages`. Never per batch.

    :param register: Call ``register(plugin)`` once for each :class:`lossplug.ShaperPlugin` (a function decorated
        with ``@lossplug.shaper(name, ...)``). Its name is what recipes list under ``shapers:``.

    :return: Nothing. Return values are ignored; a name registered twice, or an implementation that raises, is
        reported as for :func:`lossplug_register_advantages`.
    """


@hookspec
def lossplug_register_filters(register: Callable[[FilterPlugin], None]) -> None:
    """Register batch filters (the rollout side: which responses and tokens take part in the update).

    Called once each time the plugin registry is built, like :func:`lossplug_register_advantages`. Never per batch.

    :param register: Call ``register(plugin)`` once for each :class:`lossplug.FilterPlugin` (a function decorated
        with ``@lossplug.filter(name, ...)``). Its name is what recipes list under ``filters:``.

    :return: Nothing. Return values are ignored; a name registered twice, or an implementation that raises, is
        reported as for :func:`lossplug_register_advantages`.
    """


@hookspec
def lossplug_register_advantages(register: Callable[[AdvantagePlugin], None]) -> None:
    """Register advantage estimators.

    Called once each time the plugin registry is built: on first use (the first recipe checked, ``lossplug list``)
    and again after ``lossplug.register_plugin`` / ``lossplug.unregister_plugin``. Never per batch.

    :param register: Call ``register(plugin)`` once for each :class:`lossplug.AdvantagePlugin` (a function decorated
        with ``@lossplug.advantage(name, ...)``). Its name is what recipes put under ``advantage:``.

    :return: Nothing. Return values are ignored. A name registered by two plugins is unusable until one of them is
        removed: recipes naming it get a :class:`lossplug.PluginError` naming both.

    If the implementation raises (or registers something that is not an ``AdvantagePlugin``), the plugin is reported
    with a ``LossplugPluginWarning`` naming it, listed as broken by ``lossplug list`` and named again in the error of
    any lookup that misses; every other plugin keeps working.
    """


@hookspec
def lossplug_register_gates(register: Callable[[GatePlugin], None]) -> None:
    """Register gates: update gates (``role="update"``, the first gate of a recipe) and detached corrections
    (``role="correction"``, every later gate).

    Called once each time the plugin registry is built: on first use (the first recipe checked, ``lossplug list``)
    and again after ``lossplug.register_plugin`` / ``lossplug.unregister_plugin``. Never per batch.

    :param register: Call ``register(plugin)`` once for each :class:`lossplug.GatePlugin` (a function decorated
        with ``@lossplug.gate(name, ...)``). Its name is what recipes put under ``gates:``.

    :return: Nothing. Return values are ignored. A name registered by two plugins is unusable until one of them is
        removed: recipes naming it get a :class:`lossplug.PluginError` naming both.

    If the implementation raises (or registers something that is not a ``GatePlugin``), the plugin is reported with
    a ``LossplugPluginWarning`` naming it, listed as broken by ``lossplug list`` and named again in the error of any
    lookup that misses; every other plugin keeps working.
    """


@hookspec
def lossplug_register_reductions(register: Callable[[ReductionPlugin], None]) -> None:
    """Register reductions.

    Called once each time the plugin registry is built: on first use (the first recipe checked, ``lossplug list``)
    and again after ``lossplug.register_plugin`` / ``lossplug.unregister_plugin``. Never per batch.

    :param register: Call ``register(plugin)`` once for each :class:`lossplug.ReductionPlugin` (a function decorated
        with ``@lossplug.reduction(name, ...)``, additive over micro-batches). Its name is what recipes put under
        ``reduction:``.

    :return: Nothing. Return values are ignored. A name registered by two plugins is unusable until one of them is
        removed: recipes naming it get a :class:`lossplug.PluginError` naming both.

    If the implementation raises (or registers something that is not a ``ReductionPlugin``), the plugin is reported
    with a ``LossplugPluginWarning`` naming it, listed as broken by ``lossplug list`` and named again in the error of
    any lookup that misses; every other plugin keeps working.
    """


@hookspec
def lossplug_register_regularizers(register: Callable[[RegularizerPlugin], None]) -> None:
    """Register regularizers: per-token terms added to the loss with a coefficient (a KL to the reference, an
    entropy bonus), ``loss += coef · reduce(term)``.

    Called once each time the plugin registry is built: on first use (the first recipe checked, ``lossplug list``)
    and again after ``lossplug.register_plugin`` / ``lossplug.unregister_plugin``. Never per batch.

    :param register: Call ``register(plugin)`` once for each :class:`lossplug.RegularizerPlugin` (a function
        decorated with ``@lossplug.regularizer(name, ...)``, whose parameter model subclasses
        :class:`lossplug.RegularizerParams`). Its name is what recipes put under ``regularizers:``.

    :return: Nothing. Return values are ignored. A name registered by two plugins is unusable until one of them is
        removed: recipes naming it get a :class:`lossplug.PluginError` naming both.

    If the implementation raises (or registers something that is not a ``RegularizerPlugin``), the plugin is
    reported with a ``LossplugPluginWarning`` naming it, listed as broken by ``lossplug list`` and named again in the
    error of any lookup that misses; every other plugin keeps working.
    """


@hookspec(warn_on_impl=DeprecationWarning("lossplug_register_regularisers is lossplug_register_regularizers now"))
def lossplug_register_regularisers(register: Callable[[RegularizerPlugin], None]) -> None:
    """The earlier spelling of :func:`lossplug_register_regularizers` (lossplug 0.1.0), called the same way and at
    the same time; a plugin that implements it keeps working, with a DeprecationWarning."""


@hookspec
def lossplug_register_presets(register: RegisterPreset) -> None:
    """Register named recipes (``Recipe.preset(name)``, ``Recipe.load(name)``, a bare name wherever a recipe is
    accepted).

    Called once each time the plugin registry is built, after every plugin was registered, so a preset may name
    plugins of any package. Never per batch.

    :param register: Call ``register(name, recipe, source="paper or link")``: ``name`` a ``str``, ``recipe`` a
        mapping with ``advantage`` (optional), ``gates``, ``reduction`` and ``regularizers`` (optional) as in a recipe
        file, ``source`` a ``str``
        shown by ``lossplug list``. The recipe is checked when it is first used, not when it is registered.

    :return: Nothing. Return values are ignored. A preset name registered twice is unusable until one of them is
        removed.

    If the implementation raises, the plugin is reported with a ``LossplugPluginWarning`` naming it and listed as
    broken by ``lossplug list``; the presets of every other plugin keep working.
    """


@hookspec
def lossplug_validate_batch(batch: PolicyBatch | PackedTransitions, recipe: Recipe) -> list[Violation] | None:
    """Extra batch checks beyond the contract.

    Called on every ``policy_loss``, ``compute_advantages`` and ``estimate_advantages`` call with
    ``validate="full"`` (the default), once the batch passed the built-in contract rules, and by
    ``lossplug validate``. Never with ``validate="off"``.

    :param batch: The :class:`lossplug.PolicyBatch` (or, for a packed advantage stage,
        :class:`lossplug.PackedTransitions`) about to be used. Read it; do not modify it.
    :param recipe: The :class:`lossplug.Recipe` it is about to be used with.

    :return: A ``list`` of :class:`lossplug.Violation` — ``Violation(field, rule, where)`` — for every rule the batch
        breaks; an empty list or ``None`` when all is well. The violations of all plugins, and any fields the
        recipe's plugins require but the batch lacks, are raised together as one
        :class:`lossplug.BatchValidationError`. Returning anything else is a :class:`lossplug.PluginError`.

    If the implementation raises, the call fails with a :class:`lossplug.PluginError` naming the plugin (its entry
    point and distribution, and how to leave it out), with the original exception as its ``__cause__``; a
    ``LossplugError`` it raises, and ``MemoryError`` / out-of-memory, pass through unchanged.
    """


@hookspec
def lossplug_extra_metrics(
    batch: PolicyBatch, objective: torch.Tensor, recipe: Recipe
) -> dict[str, torch.Tensor] | None:
    """Extra metrics for a policy-loss call.

    Called once per ``policy_loss`` call with metrics on (``metrics="basic"`` or ``"full"``), after the gates and the
    reduction ran, under ``torch.no_grad()``. Never with ``metrics="off"``.

    :param batch: The :class:`lossplug.PolicyBatch` of the call (a micro-batch, as the trainer passed it).
    :param objective: The per-token objective ``[B, T]`` after every gate, before the reduction; detached, zero off
        the action mask.
    :param recipe: The :class:`lossplug.Recipe` of the call.

    :return: A ``dict`` of metric name → 0-d tensor, merged into ``LossResult.metrics`` (converted to floats there,
        in one transfer with the built-in metrics), or ``None`` for no metrics. Names are used as given — a name
        equal to a built-in metric replaces it — so prefix them with your plugin's name. Returning anything else is
        a :class:`lossplug.PluginError`.

    If the implementation raises, the call fails with a :class:`lossplug.PluginError` naming the plugin (its entry
    point and distribution, and how to leave it out), with the original exception as its ``__cause__``; a
    ``LossplugError`` it raises, and ``MemoryError`` / out-of-memory, pass through unchanged.
    """
