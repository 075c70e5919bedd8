"""The keys of verl's configuration: a key verl does not know is refused, naming it, where it is and the closest
valid key.

Why: :func:`~lossplug.adapters.verl.equivalent.verl_equivalent` reads plain mappings and takes verl's default for
every key it does not find, so a misspelt ``clip_ratio_hgh`` or ``adv_estimatr`` would silently become the default.
verl itself is strict where it builds a dataclass from a section — ``verl.utils.config.omega_conf_to_dataclass``
merges it into ``OmegaConf.structured(<the dataclass>)``, which raises on an unknown key, and Hydra's ``instantiate``
refuses an unexpected argument; its driver does that for the actor (``validate_config``) — but other code reads
sections such as ``algorithm`` as a ``DictConfig`` with defaults, where a misspelling passes. Here one rule holds for
every section lossplug reads, before a recipe is written.

The valid keys are read off verl's own config dataclasses, so they follow the installed verl (every field of the
class and of its subclasses: the FSDP, Megatron, VeOmni and TorchTitan actors share one set; ``_target_`` is a field
of verl's ``BaseConfig``), plus lossplug's own keys (the fields of
:class:`~lossplug.adapters.verl.LossplugPolicyLossConfig`, and ``algorithm.lossplug``, the estimator's recipe). A
key verl accepts and lossplug does not read (``ppo_mini_batch_size``, ``optim``…) is valid. The sections checked are
the ones lossplug reads (:data:`SECTIONS`); the others (``optim``, ``fsdp_config``, ``checkpoint``…) are verl's
business alone.

Without verl (this module imports it only when called; the package ``lossplug.adapters.verl`` imports it anyway)
the valid keys are those lossplug reads (:func:`keys_lossplug_reads`), so any other key is refused: install verl to
check a whole verl config.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Mapping
from typing import Any

from lossplug.adapters.verl.equivalent.advantages import ALGORITHM_KEYS, KL_CTRL_KEYS
from lossplug.adapters.verl.equivalent.settings import (
    ACTOR_DEFAULTS,
    LOSSPLUG_POLICY_LOSS_KEYS,
    ROLLOUT_CORRECTION_DEFAULTS,
)
from lossplug.contracts import LossplugError

__all__ = ["ACTOR", "ALGORITHM", "SECTIONS", "check_keys", "keys_lossplug_reads", "unknown_keys", "valid_keys"]

#: where the two arguments of verl_equivalent sit in verl's composed config (``ppo_trainer.yaml``)
ACTOR = "actor_rollout_ref.actor"
ALGORITHM = "algorithm"
#: the sections lossplug reads: (argument, path of keys below it, the section's name in :func:`valid_keys`)
SECTIONS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("actor", (), "actor"),
    ("actor", ("policy_loss",), "policy_loss"),
    ("actor", ("policy_loss", "rollout_correction"), "rollout_correction"),
    ("algorithm", (), "algorithm"),
    ("algorithm", ("kl_ctrl",), "kl_ctrl"),
    ("algorithm", ("rollout_correction",), "rollout_correction"),
)
#: lossplug's own key in verl's ``algorithm`` section: the recipe whose advantage stage ``adv_estimator=lossplug`` runs
ALGORITHM_LOSSPLUG_KEY = "lossplug"
#: lossplug's key in ``algorithm``: resume without the controllers' saved state (:mod:`lossplug.adapters.verl.checkpoint`)
ALGORITHM_FRESH_CONTROLLERS_KEY = "lossplug_fresh_controllers"


def _fields(cls: type) -> set[str]:
    """The dataclass fields of ``cls`` and of every subclass defined so far."""
    names = {f.name for f in dataclasses.fields(cls)}
    subclasses: list[type] = type.__subclasses__(cls)
    for sub in subclasses:
        names |= _fields(sub)
    return names


@functools.cache
def _verl_keys() -> tuple[str, dict[str, frozenset[str]]] | None:
    """(where the keys come from, section → keys) from the installed verl's dataclasses; None without verl."""
    try:
        from importlib.metadata import version

        from verl.trainer.config.algorithm import AlgoConfig, KLControlConfig, RolloutCorrectionConfig
        from verl.workers.config.actor import ActorConfig, PolicyLossConfig
    except ImportError:
        return None
    keys = {
        "actor": _fields(ActorConfig),
        # (lossplug's own keys: LossplugPolicyLossConfig is a subclass, but this holds before it is defined)
        "policy_loss": _fields(PolicyLossConfig) | LOSSPLUG_POLICY_LOSS_KEYS,
        "rollout_correction": _fields(RolloutCorrectionConfig),
        "algorithm": _fields(AlgoConfig) | {ALGORITHM_LOSSPLUG_KEY, ALGORITHM_FRESH_CONTROLLERS_KEY},
        "kl_ctrl": _fields(KLControlConfig),
    }
    return f"verl {version('verl')}'s config dataclasses", {name: frozenset(names) for name, names in keys.items()}


def keys_lossplug_reads() -> dict[str, frozenset[str]]:
    """Section → the keys verl_equivalent reads (and lossplug's own): the valid keys where verl is not installed."""
    return {
        "actor": frozenset(set(ACTOR_DEFAULTS) | {"_target_"}),
        "policy_loss": frozenset(
            set(ACTOR_DEFAULTS["policy_loss"]) | {"_target_", "rollout_correction"} | LOSSPLUG_POLICY_LOSS_KEYS
        ),
        "rollout_correction": frozenset(set(ROLLOUT_CORRECTION_DEFAULTS) | {"_target_"}),
        "algorithm": frozenset(
            set(ALGORITHM_KEYS) | {"_target_", ALGORITHM_LOSSPLUG_KEY, ALGORITHM_FRESH_CONTROLLERS_KEY}
        ),
        "kl_ctrl": frozenset(set(KL_CTRL_KEYS) | {"_target_"}),
    }


def valid_keys() -> tuple[str, dict[str, frozenset[str]]]:
    """(where they come from, section → valid keys): the installed verl's schema, else :func:`keys_lossplug_reads`."""
    derived = _verl_keys()
    if derived is not None:
        return derived
    return "the keys lossplug reads (verl is not installed)", keys_lossplug_reads()


def unknown_keys(section: Mapping[Any, Any], where: str, valid: frozenset[str]) -> list[str]:
    """One line per key of ``section`` not in ``valid``: its full path and the closest valid key."""
    lines = []
    for key in section:
        if key in valid:
            continue
        close = difflib.get_close_matches(str(key), sorted(valid), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else f"no valid key is close; valid: {', '.join(sorted(valid))}"
        lines.append(f"{where}.{key} ({hint})")
    return lines


def _section(root: Mapping[str, Any] | None, path: tuple[str, ...]) -> Mapping[Any, Any] | None:
    node: Any = root
    for key in path:
        node = node.get(key) if isinstance(node, Mapping) else None
    return node if isinstance(node, Mapping) else None


def check_keys(actor: Mapping[str, Any] | None, algorithm: Mapping[str, Any] | None) -> None:
    """Raise a :class:`~lossplug.LossplugError` listing every key of the sections lossplug reads (:data:`SECTIONS`)
    that verl's config does not have, each with where it is and the closest valid key."""
    source, valid = valid_keys()
    roots = {"actor": (actor, ACTOR), "algorithm": (algorithm, ALGORITHM)}
    lines: list[str] = []
    for argument, path, name in SECTIONS:
        root, prefix = roots[argument]
        section = _section(root, path)
        if section is not None:
            lines += unknown_keys(section, ".".join((prefix, *path)), valid[name])
    if lines:
        raise LossplugError(
            f"verl_equivalent: unknown key{'s' if len(lines) > 1 else ''} in verl's config (checked against "
            f"{source}; a misspelt key would read as verl's default):\n  " + "\n  ".join(lines)
        )
