"""lossplug — a pluggable, validated loss layer for LLM reinforcement learning inside TRL and verl.

Public API::

    lossplug.Recipe, lossplug.PolicyBatch, lossplug.PackedTransitions, lossplug.Normalizer
    lossplug.compute_advantages(batch, recipe) -> Tensor
    lossplug.policy_loss(batch, recipe, normalizer=None) -> LossResult   (.loss, .metrics)
    lossplug.hookimpl, lossplug.plugin_manager(), lossplug.list_plugins()

``import lossplug`` imports neither trl nor verl, and builds no plugin registry: that happens on first use.
"""

from __future__ import annotations

import pluggy

from lossplug.contracts import (AdvantageResult, BatchValidationError, LogProbSource, LossplugError, LossResult,
                                Normalizer, PackedTransitions, PluginError, PluginSpec, PolicyBatch, Provenance,
                                Recipe, RecipeError, Violation)

from .pipeline import compile_recipe, compute_advantages, estimate_advantages, policy_loss, reduce
from .plugin import (AdvantagePlugin, GateInput, GateOutput, GatePlugin, NoParams, Params, Population,
                     ReductionPlugin, advantage, gate, reduction)
from .plugin_registry import (LossplugPluginWarning, list_plugins, plugin_manager, register_plugin, registry,
                              unregister_plugin)

__version__ = "0.1.0"

#: marker for hook implementations: ``@lossplug.hookimpl def lossplug_register_gates(register): ...``
hookimpl = pluggy.HookimplMarker("lossplug")

__all__ = [
    "AdvantagePlugin", "AdvantageResult", "BatchValidationError", "GateInput", "GateOutput", "GatePlugin",
    "LogProbSource", "LossResult", "LossplugError", "LossplugPluginWarning", "NoParams", "Normalizer",
    "PackedTransitions", "Params", "PluginError", "PluginSpec", "PolicyBatch", "Population", "Provenance", "Recipe",
    "RecipeError", "ReductionPlugin", "Violation", "advantage", "compile_recipe", "compute_advantages",
    "estimate_advantages", "gate", "hookimpl", "list_plugins", "plugin_manager", "policy_loss", "reduction",
    "reduce", "register_plugin", "registry", "unregister_plugin",
]
