"""The field's own loss code, loaded from its published wheel — for the origin oracles of the gates ported from it.

Neither SkyRL nor OpenRLHF is a dependency of lossplug (nor of its tests): ``origins`` (``tests/_origins.py``, the
session fixture of ``tests/plugins/conftest.py``) downloads their pinned wheels and loads the one module holding
the losses from its file: its package's ``__init__`` pulls in a whole trainer (Ray actors, DeepSpeed, vLLM, a
Tinker API server) and never runs. The imports that module makes for type annotations or logging only
(``jaxtyping``, ``loguru``, SkyRL's config classes, DeepSpeed in OpenRLHF's model utilities) are stubbed for the
duration of the import, and ``sys.modules`` is restored afterwards. The oracle against the formula transcribed in
each test runs beside it.
"""

from __future__ import annotations

import logging
import types
from pathlib import Path
from typing import Any

from ..._origins import Origins


class _AnyAnnotation:
    """Stands in for ``jaxtyping.Float[...]`` and the like: subscriptable, never checked."""

    def __class_getitem__(cls, item: Any) -> type:
        return cls


def _package_stub(name: str, root: Path) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
    return module


def skyrl_ppo_utils(origins: Origins) -> types.ModuleType:
    """SkyRL's ``skyrl/backends/skyrl_train/utils/ppo_utils.py`` (0.3.0)."""
    jaxtyping = types.ModuleType("jaxtyping")
    jaxtyping.Float = jaxtyping.Int = jaxtyping.Integer = jaxtyping.Bool = _AnyAnnotation  # type: ignore[attr-defined]
    jaxtyping.jaxtyped = lambda *a, **k: lambda f: f  # type: ignore[attr-defined]
    loguru = types.ModuleType("loguru")
    loguru.logger = logging.getLogger("skyrl")  # type: ignore[attr-defined]
    config = types.ModuleType("skyrl.train.config")
    config.AlgorithmConfig = object  # type: ignore[attr-defined]
    stubs = {
        "jaxtyping": jaxtyping,
        "loguru": loguru,
        "skyrl.train": _package_stub("skyrl.train", origins.package("skyrl")),
        "skyrl.train.config": config,
    }
    return origins.module("skyrl.backends.skyrl_train.utils.ppo_utils", stubs)


def openrlhf_loss(origins: Origins) -> types.ModuleType:
    """OpenRLHF's ``openrlhf/models/loss.py`` (0.11.2)."""
    return origins.module("openrlhf.models.loss", {"deepspeed": types.ModuleType("deepspeed")})


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
