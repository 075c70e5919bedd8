"""Per-response rewards normalised by running statistics over every batch seen so far — ROLL's ``norm_mean_type:
running`` / ``norm_std_type: running``::

    (μ, σ) ← update(μ, σ, this batch's rewards)                      (the batch counts: updated first)
    r ← (r − μ) / (σ + 1e-6)                                         (center / scale each optional)

with the streaming update of Chan et al. (parallel variance): for a batch of ``n`` rewards with mean ``m`` and
population variance ``v``, ``δ = m − μ``, ``N' = N + n``, ``μ ← μ + δ·n/N'``,
``var ← (var·N + δ²·N·n/N' + v·n) / N'``, ``σ = sqrt(var · N'/(N' − 1))``, starting from ``μ = 0``, ``var = 1``,
``N = 1e-24`` (ROLL's initial values). The statistics are the stage's state: the same on every rank (each rank's
``[n, Σr, Σr²]`` is summed over the peers before the update) and saved with the checkpoint
(``lossplug.controller_state``), so a resumed run normalises as an uninterrupted one.

Per-response rewards only (``[B]``): put it before ``kl_in_reward``, as ROLL normalises the response-level rewards
before the KL is added.

Reference: ROLL ``reward_norm`` and ``RunningMoments`` (alibaba/ROLL 4142237, ``roll/utils/functionals.py``:
``running.update(response_level_rewards)``, then ``(rewards − running.mean) / (running.std + 1e-6)``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from pydantic import Field

import lossplug
from lossplug.control import WindowController

Tensor = torch.Tensor


class RunningNormParams(lossplug.Params):
    center: bool = Field(True, description="subtract the running mean (ROLL's norm_mean_type: running)")
    scale: bool = Field(True, description="divide by the running std + 1e-6 (ROLL's norm_std_type: running)")


class RunningMoments(WindowController[tuple[float, float, float]]):
    """The running mean and variance of every reward seen (a :class:`lossplug.StepController`; ``coefficient`` is
    the running std). ``observe([n, Σr, Σr²])``, then ``step(all_reduce)`` updates with the (rank-summed) batch."""

    def __init__(self, p: RunningNormParams | None = None):
        super().__init__()
        self.mean, self.var, self.count = 0.0, 1.0, 1e-24
        self.std = 1.0

    @property
    def coefficient(self) -> float:
        return self.std

    def measure(self, window: Tensor) -> tuple[float, float, float]:
        """``(n, mean, population variance)`` of the window's ``[n, Σr, Σr²]``."""
        n, total, squares = window.tolist()
        if n <= 0:
            return 0.0, 0.0, 0.0
        mean = total / n
        return n, mean, max(squares / n - mean**2, 0.0)

    def update(self, measured: tuple[float, float, float]) -> float:
        """Fold in a batch of ``n`` values with mean ``m`` and population variance ``v`` (ROLL's update)."""
        n, batch_mean, batch_var = measured
        if n > 0:
            delta = batch_mean - self.mean
            total = self.count + n
            old_sum = self.var * self.count + delta**2 * self.count * n / total
            self.mean += delta * n / total
            self.var = (old_sum + batch_var * n) / total
            self.std = math.sqrt(self.var * total / (total - 1)) if total > 1 else 0.0
            self.count = total
        return self.std

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "var": self.var, "count": self.count, "std": self.std}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.mean, self.var = float(state["mean"]), float(state["var"])
        self.count, self.std = float(state["count"]), float(state["std"])
        self.reset_window()


@lossplug.shaper("running_norm", params=RunningNormParams, controller=RunningMoments, rewards=("response",))
def running_norm(inp: lossplug.RolloutInput, p: RunningNormParams) -> lossplug.ShaperOutput:
    """r ← (r − μ) / (σ + 1e-6) with μ, σ running over every batch so far, this one included (ROLL's running norm)."""
    reward = inp.batch.reward
    assert reward is not None and reward.ndim == 1  # (rewards=("response",): the pipeline refused the others)
    moments = inp.controller
    assert isinstance(moments, RunningMoments)
    r = reward.to(torch.float64)
    moments.observe(torch.stack([torch.tensor(float(r.numel()), dtype=torch.float64), r.sum(), (r * r).sum()]))
    moments.step(inp.all_reduce)
    shaped = reward
    if p.center:
        shaped = shaped - moments.mean
    if p.scale:
        shaped = shaped / (moments.std + 1e-6)
    return lossplug.ShaperOutput(
        reward=shaped,
        metrics={
            "running_mean": torch.tensor(moments.mean, dtype=torch.float64),
            "running_std": torch.tensor(moments.std, dtype=torch.float64),
        },
    )
