"""The versions a run depends on, read from the installed distributions' metadata (no import of any of them).

What ``lossplug --version`` prints and what the TRL adapter writes into a run's ``versions.json``.
"""

from __future__ import annotations

import importlib.metadata as md
import platform

#: the distributions whose versions decide a run's numbers, in the order they are reported
DISTRIBUTIONS = ("torch", "trl", "transformers", "accelerate", "peft", "vllm", "verl", "tensordict")


def installed() -> dict[str, str]:
    """``{"lossplug": …, "python": …, "torch": …, …}``: lossplug, python, then each of :data:`DISTRIBUTIONS` that
    is installed."""
    from lossplug import __version__

    out = {"lossplug": __version__, "python": platform.python_version()}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out
