"""AReaL's own loss functions, for the oracles of the gates that reproduce them (decoupled_ppo, m2po).

AReaL's package imports its whole trainer stack (colorlog, hydra, ray, …) on ``import areal``; the loss functions
themselves need only torch. So the functions are taken from the source files of AReaL's wheel (``origins``,
``tests/_origins.py``: downloaded, never installed nor imported) and executed alone, with the few names they read.
Every test that uses it has a transcribed oracle beside it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from ..._origins import Origins

#: the functions taken from each of AReaL's files
FUNCTIONAL = ("RejectionSamplingResult", "_check_bounds", "apply_rejection_sampling", "ppo_actor_loss_fn")
ACTOR = ("compute_prox_logp_approximations", "_apply_m2po_masking", "_get_m2po_loss_mask")
#: AReaL's two float32 casts, whatever the log-probs' dtype (the behaviour weight's log-ratio, the versions' α), and
#: the same lines in float64: with them the oracles can demand float64 agreement, which shows those casts are the
#: only difference
FLOAT32_CASTS = {
    "functional.py": (
        "proximal_logprobs.detach().float() - old_logprobs.detach().float()",
        "proximal_logprobs.detach() - old_logprobs.detach()",
    ),
    "actor.py": ("v_behave = versions.float()", "v_behave = versions.double()"),
}


def _definitions(
    path: Path, names: tuple[str, ...], module_name: str, namespace: dict[str, Any], float64: bool = False
) -> dict[str, Any]:
    """Execute the top-level definitions ``names`` of the Python file ``path`` in a module ``module_name`` that
    holds ``namespace`` (registered in ``sys.modules``: a dataclass looks its module up); ``float64``: with
    :data:`FLOAT32_CASTS` in float64."""
    text = path.read_text()
    if float64:
        cast, wide = FLOAT32_CASTS[path.name]
        assert cast in text, f"AReaL's {path.name} no longer reads {cast!r}"
        text = text.replace(cast, wide)
    tree = ast.parse(text, str(path))
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name in names]
    missing = set(names) - {n.name for n in nodes}
    assert not missing, f"AReaL's {path.name} no longer defines {sorted(missing)}"
    module_name += "_float64" if float64 else ""
    module = types.ModuleType(module_name)
    module.__dict__.update(namespace)
    sys.modules[module_name] = module
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), module.__dict__)
    return module.__dict__


@pytest.fixture(scope="session")
def areal(origins: Origins) -> types.SimpleNamespace:
    """AReaL's ``ppo_actor_loss_fn``, ``apply_rejection_sampling``, ``compute_prox_logp_approximations`` and the
    M2PO mask, plus ``rejection_config(**kw)`` building the ``RejectionSamplingConfig`` they read."""
    return _load_areal(origins.package("areal"), float64=False)


@pytest.fixture(scope="session")
def areal_float64(origins: Origins) -> types.SimpleNamespace:
    """:func:`areal` with its two float32 casts in float64 (:data:`FLOAT32_CASTS`)."""
    return _load_areal(origins.package("areal"), float64=True)


def _load_areal(root: Path, float64: bool) -> types.SimpleNamespace:
    """The functions from AReaL's package folder ``root`` (its pinned version: ``ORIGINS["areal"]``)."""
    constants_spec = importlib.util.spec_from_file_location("areal_oracle_constants", root / "utils" / "constants.py")
    assert constants_spec is not None and constants_spec.loader is not None
    constants = importlib.util.module_from_spec(constants_spec)
    constants_spec.loader.exec_module(constants)
    base: dict[str, Any] = {"torch": torch, "dataclass": dataclasses.dataclass, "Any": Any, "functools": functools}
    functional = _definitions(
        root / "utils" / "functional" / "functional.py",
        FUNCTIONAL,
        "areal_oracle_functional",
        {**base, "RejectionSamplingConfig": object, "KLEstimator": None},
        float64,
    )
    actor = _definitions(
        root / "trainer" / "ppo" / "actor.py",
        ACTOR,
        "areal_oracle_actor",
        {**base, **{k: v for k, v in vars(constants).items() if not k.startswith("__")}},
        float64,
    )

    def rejection_config(
        upper: float, lower: float | None = None, action: str = "mask", level: str = "token"
    ) -> types.SimpleNamespace:
        return types.SimpleNamespace(upper=upper, lower=lower, action=action, level=level, metric="ratio", agg="mean")

    return types.SimpleNamespace(
        ppo_actor_loss_fn=functional["ppo_actor_loss_fn"],
        apply_rejection_sampling=functional["apply_rejection_sampling"],
        compute_prox_logp_approximations=actor["compute_prox_logp_approximations"],
        apply_m2po_masking=actor["_apply_m2po_masking"],
        rejection_config=rejection_config,
    )
