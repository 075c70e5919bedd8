"""The ``lossplug`` command line: :mod:`.app` wires the commands (typer + rich); the modules beside it compute what
they print — :mod:`.catalogue` (the plugin catalogue, cached in the user's cache directory once built),
:mod:`.describe` (plugins and recipes as plain data), :mod:`.batch_files` (reading and checking batch dumps) and
:mod:`.gate_curves` (gate gradient curves). ``import lossplug.cli`` imports no torch: a command imports it when it
computes.
"""

from .app import app, main

__all__ = ["app", "main"]
