"""Registration with verl: lossplug's policy loss and advantage estimator in verl's registries under the name
``lossplug`` (:func:`install`, called with both functions by :func:`lossplug.adapters.verl.register` when
:mod:`lossplug.adapters.verl` is imported — by ``import verl``, through the ``verl.plugins`` entry point), and the
check that the whole chain works in this process (:func:`check_registration`): verl only logs entry-point failures
at DEBUG level.

The functions are handed in, not imported: the policy loss and the estimator check the registration themselves, so
this module sits below them (the modules of :mod:`lossplug.adapters.verl` import each other without a loop)."""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
from collections.abc import Callable
from typing import Any

from verl.trainer.ppo import core_algos

from lossplug.contracts import LossplugError

__all__ = ["ENTRY_POINT_GROUP", "MODULE", "NAME", "check_once", "check_registration", "entry_point", "install"]

#: the name under which lossplug is registered in both verl registries
NAME = "lossplug"
ENTRY_POINT_GROUP = "verl.plugins"
#: the module verl's entry point names (pyproject.toml): importing it registers lossplug
MODULE = "lossplug.adapters.verl"
#: what marks a function as one of lossplug's (an older copy after importlib.reload may be replaced)
MARK = "__lossplug_verl__"

#: the two registry slots lossplug fills: (what, verl's registry, the config key that selects it)
_SLOTS: dict[str, tuple[dict[str, Any], str]] = {
    "policy loss": (core_algos.POLICY_LOSS_REGISTRY, "actor_rollout_ref.actor.policy_loss.loss_mode"),
    "advantage estimator": (core_algos.ADV_ESTIMATOR_REGISTRY, "algorithm.adv_estimator"),
}
#: what → lossplug's function, as :func:`install` put it in verl's registry in this process
_installed: dict[str, Callable[..., Any]] = {}


def entry_point() -> md.EntryPoint | None:
    """lossplug's entry point in verl's ``verl.plugins`` group, as installed (None: not installed here)."""
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        if ep.value.split(":")[0].strip() == MODULE:
            return ep
    return None


def _loaded_by_import_verl(ep: md.EntryPoint | None) -> tuple[bool, str]:
    """Whether ``import verl`` imports this module in every process, and if not, why not."""
    modules = [m.strip() for m in os.getenv("VERL_USE_EXTERNAL_MODULES", "").split(",") if m.strip()]
    if MODULE in modules:
        return True, ""
    if ep is None:
        return False, (
            f"lossplug's '{ENTRY_POINT_GROUP}' entry point is not installed in this environment "
            f"({sys.prefix}); install lossplug there — pip install 'lossplug[verl]' (or pip install -e "
            f"<lossplug checkout>) — in the environment of the driver and of every Ray worker"
        )
    policy = os.getenv("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    if policy == "auto":
        return True, ""
    allowed = {n.strip() for n in policy.split(",") if n.strip()}
    if policy != "none" and ep.name in allowed:
        return True, ""
    return False, (
        f"VERL_USE_EXTERNAL_PLUGINS={os.getenv('VERL_USE_EXTERNAL_PLUGINS')} stops `import verl` from "
        f"loading lossplug's '{ENTRY_POINT_GROUP}' entry point '{ep.name}'; unset it (or set it to 'auto'),"
        f" or list '{ep.name}' in it — in the driver's environment and the Ray workers' "
        f"(runtime_env env_vars) — or set VERL_USE_EXTERNAL_MODULES={MODULE}"
    )


def _describe(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def check_registration(*, policy_loss: bool = True, estimator: bool = True) -> None:
    """Raise a :class:`~lossplug.LossplugError` naming the missing piece unless ``import verl`` registers lossplug in
    every process of a run (entry point installed and enabled) and both verl registries hold lossplug's functions."""
    problems = []
    ok, why = _loaded_by_import_verl(entry_point())
    if not ok:
        problems.append(why)
    wanted = [what for what, asked in (("policy loss", policy_loss), ("advantage estimator", estimator)) if asked]
    for what in wanted:
        table, key = _SLOTS[what]
        found, ours = table.get(NAME), _installed.get(what)
        if found is None:
            problems.append(
                f"verl's {what} registry has no '{NAME}' in this process ({key}={NAME} cannot "
                f"resolve): the module {MODULE} was not imported by `import verl`"
            )
        elif found is not ours:
            theirs = f"lossplug's {_describe(ours)}" if ours is not None else f"lossplug's (from {MODULE})"
            problems.append(
                f"verl's {what} '{NAME}' is {_describe(found)}, not {theirs}: another package registered the same name"
            )
    if problems:
        raise LossplugError("lossplug is not registered with verl: " + "; ".join(problems))


def install(policy_loss: Callable[..., Any], estimator: Callable[..., Any]) -> None:
    """Put lossplug's policy loss and advantage estimator in verl's registries under :data:`NAME` (idempotent). An
    older copy of lossplug's (after ``importlib.reload``, marked with :data:`MARK`) is replaced; another package's
    function under the name is refused, never overwritten."""
    functions = {"policy loss": policy_loss, "advantage estimator": estimator}
    _installed.update(functions)
    for what, fn in functions.items():
        table, _ = _SLOTS[what]
        found = table.get(NAME)
        if found is fn:
            continue
        if found is not None and not getattr(found, MARK, False):
            raise LossplugError(
                f"cannot register lossplug with verl: the {what} '{NAME}' is already taken by {_describe(found)}"
            )
        if found is not None:  # an older copy of lossplug's own function (importlib.reload): replace it
            del table[NAME]
    core_algos.register_policy_loss(NAME)(policy_loss)
    core_algos.register_adv_est(NAME)(estimator)


_checked_kinds: set[str] = set()


def check_once(kind: str) -> None:
    """The registration check, once per process and function kind (the hot path pays one set lookup)."""
    if kind in _checked_kinds:
        return
    check_registration(policy_loss=kind == "policy", estimator=kind == "estimator")
    _checked_kinds.add(kind)
