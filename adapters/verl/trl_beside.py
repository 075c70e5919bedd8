"""TRL beside verl: verl's FSDP workers import ``AutoModelForCausalLMWithValueHead`` from any importable TRL, which
TRL ≥ 1.0 does not have (:func:`trl_breaks_verl`). The warning speaks where that matters, once per process: when a
verl actor is configured with ``loss_mode=lossplug`` (:class:`~lossplug.adapters.verl.LossplugPolicyLossConfig`,
built in each FSDP worker before its model) — not at every ``import verl``, which a test suite or a TRL run in an
environment holding both may do without ever building a verl actor."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import sys

from lossplug.adapters.common import warn_once

__all__ = ["trl_breaks_verl", "warn_if_trl_breaks_verl"]


def trl_breaks_verl() -> str | None:
    """Why the TRL installed beside verl breaks verl's FSDP workers, or ``None`` when it does not (no TRL, or a TRL
    that still has ``AutoModelForCausalLMWithValueHead``). Reads files only: TRL is not imported.

    verl 0.9.1's ``models/transformers/monkey_patch.py`` imports ``AutoModelForCausalLMWithValueHead`` from
    ``trl.experimental.ppo`` or ``trl`` whenever ``importlib.util.find_spec("trl")`` finds TRL; TRL ≥ 1.0 has
    neither, so building an FSDP actor fails with ImportError — on GPUs too. ``lossplug[all]`` installs exactly
    that combination."""
    try:
        spec = importlib.util.find_spec("trl")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = next(iter(spec.submodule_search_locations))
    if os.path.isdir(os.path.join(root, "experimental", "ppo")):
        return None
    try:
        with open(os.path.join(root, "__init__.py"), encoding="utf-8") as f:
            if "AutoModelForCausalLMWithValueHead" in f.read():
                return None
    except OSError:
        return None
    try:
        version = md.version("trl")
    except md.PackageNotFoundError:
        version = "?"
    return (
        f"lossplug: TRL {version} is installed beside verl in {sys.prefix}: verl's FSDP workers "
        f"(verl/models/transformers/monkey_patch.py) import AutoModelForCausalLMWithValueHead from trl whenever TRL "
        f"is importable, and this TRL has none, so building the actor fails with ImportError (on GPUs too). Run verl "
        f"from an environment without TRL: pip uninstall trl there, and install lossplug with pip install "
        f"'lossplug[verl]' (lossplug[all] brings TRL); TRL runs belong in their own environment"
    )


def warn_if_trl_breaks_verl() -> None:
    """Warn (once) when the TRL installed here breaks verl's FSDP workers."""
    problem = trl_breaks_verl()
    if problem is not None:
        warn_once("trl-beside-verl", problem)
