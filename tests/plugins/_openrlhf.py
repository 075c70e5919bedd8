"""OpenRLHF 0.11.2's advantage and KL code, loaded from its wheel (``tests/_origins.py``), run in float64.

OpenRLHF casts with ``Tensor.float()`` — float32 — where it means "at least float32": ``compute_approx_kl`` starts
with ``log_probs.float() − log_probs_base.float()`` and ``compute_advantages_and_returns`` takes the batch mean of the
advantages on ``torch.cat(...).float()``. Fed float64, both therefore answer in (or through) float32, ~1e-7 relative
from the float64 value: the whole gap of an oracle that calls them on plain float64 tensors. :class:`KeepsFloat64`
is a float64 tensor whose ``.float()`` is itself, so that their code, unchanged, runs in float64 end to end (every
other operation is torch's own, autograd included).

``experience_maker.py`` imports Ray, the Ray launcher and its logging helpers at module level: they are stubbed for
the import (its advantage methods use none of them), as ``tests/plugins/gates/_field_origins.py`` stubs DeepSpeed.
"""

from __future__ import annotations

import itertools
import types
from pathlib import Path
from typing import Any

import torch

from .._origins import Origins


class KeepsFloat64(torch.Tensor):
    """A tensor whose ``.float()`` returns it unchanged (no cast to float32); everything else is torch's."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def, override]
        if func is torch.Tensor.float:
            return args[0]
        return super().__torch_function__(func, types, args, kwargs or {})


def f64(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float64, or a bool mask) as a :class:`KeepsFloat64`, attached to ``x``'s autograd graph."""
    return x.as_subclass(KeepsFloat64)


def plain(x: torch.Tensor) -> torch.Tensor:
    """A :class:`KeepsFloat64` back as a plain tensor (for comparisons)."""
    return x.as_subclass(torch.Tensor)


def _package(name: str, root: Path) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
    return module


def openrlhf_model_utils(origins: Origins) -> types.ModuleType:
    """``openrlhf/models/utils.py``: ``compute_approx_kl``, ``KL_IS_WEIGHT_CLIP``, ``compute_reward``."""
    return origins.module("openrlhf.models.utils", {"deepspeed": types.ModuleType("deepspeed")})


def openrlhf_experience_maker(origins: Origins) -> types.ModuleType:
    """``openrlhf/trainer/ppo_utils/experience_maker.py``: ``RemoteExperienceMaker.compute_advantages_and_returns``."""
    root = origins.package("openrlhf")
    launcher = types.ModuleType("openrlhf.trainer.ray.launcher")
    launcher.RayActorGroup = object  # type: ignore[attr-defined]  # an annotation of __init__ only
    utils = types.ModuleType("openrlhf.utils.utils")
    utils.zero_pad_sequences = None  # type: ignore[attr-defined]  # Experience's padding helper, never called here
    stubs = {
        "ray": types.ModuleType("ray"),
        "deepspeed": types.ModuleType("deepspeed"),
        "openrlhf.models": _package("openrlhf.models", root),
        "openrlhf.utils": _package("openrlhf.utils", root),
        "openrlhf.utils.utils": utils,
        "openrlhf.trainer.ray": _package("openrlhf.trainer.ray", root),
        "openrlhf.trainer.ray.launcher": launcher,
    }
    return origins.module("openrlhf.trainer.ppo_utils.experience_maker", stubs)


def openrlhf_advantages(
    maker_module: types.ModuleType,
    estimator: str,
    score: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    n_samples_per_prompt: int,
    no_std_norm: bool = True,
    values: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lambd: float = 1.0,
    chunks: int = 2,
    keep_float64: bool = True,
) -> torch.Tensor:
    """OpenRLHF's ``compute_advantages_and_returns`` on one rollout batch: ``score`` ``[B]`` (rows in prompt order,
    ``n_samples_per_prompt`` consecutive rows a prompt), right-padded ``action_mask`` ``[B, T]``, ``values`` (gae)
    and the per-token ``kl`` of the KL-shaped reward (``kl_coef``); the batch is dealt to ``chunks`` experiences in
    a shuffled order (OpenRLHF's ``index`` puts it back). Returns the ``[B, T]`` advantages in prompt order.
    ``keep_float64``: run in float64 (:class:`KeepsFloat64`), else on plain tensors (their float32 mean)."""
    wrap = f64 if keep_float64 else (lambda x: x)
    B, T = action_mask.shape
    args = types.SimpleNamespace(
        algo=types.SimpleNamespace(
            advantage=types.SimpleNamespace(estimator=estimator, gamma=gamma, lambd=lambd, no_std_norm=no_std_norm)
        ),
        rollout=types.SimpleNamespace(n_samples_per_prompt=n_samples_per_prompt),
        reward=types.SimpleNamespace(clip_range=None),  # no overlong / stop-properly penalties either
    )
    cls = maker_module.RemoteExperienceMaker
    maker: Any = types.SimpleNamespace(
        strategy=types.SimpleNamespace(args=args),
        advantage_estimator=estimator,
        kl_ctl=types.SimpleNamespace(value=kl_coef),
    )
    maker.get_advantages_and_returns = types.MethodType(cls.get_advantages_and_returns, maker)
    maker.get_cumulative_returns = types.MethodType(cls.get_cumulative_returns, maker)
    order = torch.randperm(B, generator=torch.Generator().manual_seed(B * T))
    kl = torch.zeros(B, T, dtype=score.dtype) if kl is None else kl
    experiences = []
    for rows in order.chunk(chunks):
        experiences.append(
            types.SimpleNamespace(
                index=rows.tolist(),
                rewards=wrap(score[rows].clone()),
                action_mask=action_mask[rows],
                values=None if values is None else wrap(values[rows].clone()),
                kl=wrap(kl[rows].clone()),
                info={},
            )
        )
    out = cls.compute_advantages_and_returns(maker, experiences)
    advantages = torch.empty(B, T, dtype=score.dtype)
    for exp, rows in zip(out, order.chunk(chunks)):
        advantages[rows] = plain(exp.advantages).to(score.dtype)
    assert sorted(itertools.chain.from_iterable(e.index for e in experiences)) == list(range(B))
    return advantages
