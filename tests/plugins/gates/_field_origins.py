"""The field's own loss code, loaded where it is installed — for the origin oracles of the gates ported from it.

Neither SkyRL nor OpenRLHF is a dependency of lossplug (nor of its tests): each oracle against their code runs when
the package is importable (``pip install --no-deps skyrl==0.3.0 openrlhf==0.11.0``, e.g. into a folder on
``PYTHONPATH``) and is skipped otherwise; the oracle against the formula transcribed in each test always runs.

Only the one module holding the losses is loaded, from its file: its package's ``__init__`` pulls in a whole
trainer (Ray actors, DeepSpeed, vLLM, a Tinker API server). The imports that module makes for type annotations or
logging only (``jaxtyping``, ``loguru``, SkyRL's config classes, DeepSpeed in OpenRLHF's model utilities) are
stubbed for the duration of the import, and ``sys.modules`` is restored afterwards.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest


class _AnyAnnotation:
    """Stands in for ``jaxtyping.Float[...]`` and the like: subscriptable, never checked."""

    def __class_getitem__(cls, item: Any) -> type:
        return cls


def _package_stub(name: str, root: Path) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
    return module


def _load(top: str, module: str, stubs: dict[str, types.ModuleType]) -> types.ModuleType:
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{top} is not installed here (pip install --no-deps {top}): its origin oracle does not run")
    saved = dict(sys.modules)
    try:
        for name, stub in stubs.items():
            if name not in sys.modules or name.startswith(top):
                sys.modules[name] = stub
        return importlib.import_module(module)
    except ImportError as err:  # another version, laid out differently
        pytest.skip(f"{module} does not import here ({err}): its origin oracle does not run")
    finally:
        # forget the stubs and the package's own modules (what else the import loaded, e.g. torch's, stays loaded:
        # some register global state once per process)
        for name in [n for n in sys.modules if n in stubs or n == top or n.startswith(top + ".")]:
            del sys.modules[name]
        sys.modules.update({n: m for n, m in saved.items() if n in stubs or n == top or n.startswith(top + ".")})


def skyrl_ppo_utils() -> types.ModuleType:
    """SkyRL's ``skyrl/backends/skyrl_train/utils/ppo_utils.py`` (0.3.0)."""
    spec = importlib.util.find_spec("skyrl")
    root = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else Path()
    jaxtyping = types.ModuleType("jaxtyping")
    jaxtyping.Float = jaxtyping.Int = jaxtyping.Integer = jaxtyping.Bool = _AnyAnnotation  # type: ignore[attr-defined]
    jaxtyping.jaxtyped = lambda *a, **k: lambda f: f  # type: ignore[attr-defined]
    loguru = types.ModuleType("loguru")
    loguru.logger = logging.getLogger("skyrl")  # type: ignore[attr-defined]
    config = types.ModuleType("skyrl.train.config")
    config.AlgorithmConfig = object  # type: ignore[attr-defined]
    stubs = {"jaxtyping": jaxtyping, "loguru": loguru, "skyrl.train.config": config}
    for pkg in ("skyrl.backends", "skyrl.backends.skyrl_train", "skyrl.backends.skyrl_train.utils", "skyrl.train"):
        stubs[pkg] = _package_stub(pkg, root)
    return _load("skyrl", "skyrl.backends.skyrl_train.utils.ppo_utils", stubs)


def openrlhf_loss() -> types.ModuleType:
    """OpenRLHF's ``openrlhf/models/loss.py`` (0.11.0)."""
    spec = importlib.util.find_spec("openrlhf")
    root = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else Path()
    stubs = {"deepspeed": types.ModuleType("deepspeed"), "openrlhf.models": _package_stub("openrlhf.models", root)}
    return _load("openrlhf", "openrlhf.models.loss", stubs)


def skyrl_config(**values: Any) -> types.SimpleNamespace:
    """A SkyRL ``AlgorithmConfig`` stand-in with the attributes its policy losses read, off-policy correction off."""
    off_policy = types.SimpleNamespace(
        tis_ratio_type=None,
        sequence_mask_metric=None,
        outlier_token_is_threshold_low=None,
        outlier_token_is_threshold_high=None,
        token_mask_is_threshold_low=None,
        token_mask_is_threshold_high=None,
    )
    nested = {k: types.SimpleNamespace(**v) for k, v in values.items() if isinstance(v, dict)}
    flat = {k: v for k, v in values.items() if not isinstance(v, dict)}
    return types.SimpleNamespace(off_policy_correction=off_policy, **flat, **nested)
