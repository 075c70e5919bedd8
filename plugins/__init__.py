"""lossplug.plugins — the built-in advantage, gate and reduction plugins.

They register through the same hooks a third-party package uses (see :mod:`lossplug.plugins.builtin`).
"""
