"""Hook specifications of lossplug (pluggy project ``lossplug``).

A plugin is any module or object with functions marked ``@lossplug.hookimpl`` and named after a hook below. Third
parties expose theirs through the ``lossplug`` entry-point group::

    [project.entry-points.lossplug]
    my_gates = "my_package.lossplug_plugin"

Built-in plugins register through exactly the same hooks (see ``lossplug.plugins.builtin``).

The ``register`` hooks run once, when the plugin registry is first built (first recipe, ``lossplug list``…), never
per batch. The batch hooks run per batch, only when some plugin implements them.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("lossplug")


@hookspec
def lossplug_register_advantages(register):
    """Register advantage estimators.

    Called once when the registry is built. Call ``register(plugin)`` for each :class:`lossplug.AdvantagePlugin`
    (made with the ``@lossplug.advantage(...)`` decorator). Returns nothing.
    """


@hookspec
def lossplug_register_gates(register):
    """Register gates (update gates and detached corrections).

    Called once when the registry is built. Call ``register(plugin)`` for each :class:`lossplug.GatePlugin` (made
    with ``@lossplug.gate(...)``). Returns nothing.
    """


@hookspec
def lossplug_register_reductions(register):
    """Register reductions.

    Called once when the registry is built. Call ``register(plugin)`` for each :class:`lossplug.ReductionPlugin`
    (made with ``@lossplug.reduction(...)``). Returns nothing.
    """


@hookspec
def lossplug_register_presets(register):
    """Register named recipes.

    Called once when the registry is built. Call ``register(name, recipe_dict, source="paper or link")``; the
    recipe is validated when it is first used. Returns nothing.
    """


@hookspec
def lossplug_validate_batch(batch, recipe):
    """Extra batch checks beyond the contract.

    Called for every batch validated with ``validate="full"`` (after the built-in contract rules passed), with the
    :class:`~lossplug.PolicyBatch` or :class:`~lossplug.PackedTransitions` and the :class:`~lossplug.Recipe` it is
    about to be used with. Return a list of :class:`~lossplug.Violation` (empty or ``None`` when all is well); all
    violations of all plugins are raised together as one :class:`~lossplug.BatchValidationError`.
    """


@hookspec
def lossplug_extra_metrics(batch, objective, recipe):
    """Extra metrics for a policy-loss call.

    Called once per ``policy_loss`` call with metrics on (``"basic"`` or ``"full"``) after the gates ran, with the batch, the per-token objective
    ``[B, T]`` (after every gate, before the reduction) and the recipe. Return a dict of metric name → 0-d tensor
    (computed without gradient) or ``None``. Names are used as given; prefix them with your plugin's name.
    """
