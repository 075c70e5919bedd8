"""lossplug.plugins — the built-in advantage, gate, reduction and regularizer plugins, and the named presets.

They are found the way a third-party plugin is: lossplug's ``pyproject.toml`` declares each family's plugin module
(``lossplug.plugins.gates``, ``lossplug.plugins.reductions``…) in the ``lossplug`` entry-point group, and each module
implements the registration hook for what it defines. The registry tells them apart from third-party plugins by their
distribution, ``lossplug`` (:mod:`lossplug.plugin_discovery`).
"""
