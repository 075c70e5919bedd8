"""Which optional batch fields a plugin reads — its ``requires`` declaration, answered without importing torch.

The registry's listing, :mod:`lossplug.needs` (the CLI's and the adapters' questions about whole recipes) and the
conformance kit ask it here; it reads only attributes, so the torch-free CLI paths can ask it too.
"""

from __future__ import annotations

from typing import Any


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
