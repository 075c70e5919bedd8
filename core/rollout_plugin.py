"""The rollout side's plugin classes: reward shapers and batch filters, and what they read and return.

Authors write a function and decorate it, as for the other kinds (:mod:`lossplug.plugin`)::

    @lossplug.shaper("finished_bonus", params=BonusParams, requires=("terminated",))
    def finished_bonus(inp: lossplug.RolloutInput, p: BonusParams) -> torch.Tensor:
        return inp.batch.reward + p.bonus * inp.batch.terminated.to(inp.batch.reward.dtype)

    @lossplug.filter("min_length", params=MinLengthParams)
    def min_length(inp: lossplug.RolloutInput, p: MinLengthParams) -> torch.Tensor:
        return inp.batch.action_mask.sum(-1) >= p.tokens

The pipeline runs them once per rollout batch, shapers then filters, before the advantage
(:mod:`lossplug.rollout`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from lossplug.contracts import PolicyBatch

from .peers import LOCAL, Peers
from .plugin import (
    Controller,
    ControllerFactory,
    Lazy,
    NoParams,
    Params,
    Requires,
    StepController,
    _doc,
    _requires,
    _RequiresMixin,
)

Tensor = torch.Tensor
#: a reward's layout: per response (``[B]``) or per token (``[B, T]``)
RewardLayout = Literal["response", "token"]


class RolloutInput:
    """What a shaper or a filter reads: the rollout ``batch`` as the stages before it left it (the reward as shaped
    so far, the action mask as filtered so far), the stage's live ``controller`` (its state across steps, or None)
    and the ``peers`` a statistic is pooled over (the whole rollout batch is usually on every rank already: verl's
    driver, TRL's gathered rewards).

    A filtered response is still a row of ``batch`` (the trainer's tensors keep their shape): its action mask is
    all False. ``rows`` are the responses still in play."""

    def __init__(self, batch: PolicyBatch, controller: Controller | None = None, peers: Peers = LOCAL):
        self.batch = batch
        self.controller = controller
        self.peers = peers

    @property
    def rows(self) -> Tensor:
        """``[B]`` bool: the responses with at least one action token left."""
        return self.batch.action_mask.any(-1)

    @property
    def response_reward(self) -> Tensor:
        """``[B]``: each response's reward — a per-token reward summed over the response (verl's
        ``token_level_rewards.sum(-1)``, what its DAPO filter and GRPO score)."""
        reward = self.batch.reward
        assert reward is not None  # (the pipeline refuses rollout stages on a batch without one)
        return reward.sum(-1) if reward.ndim == 2 else reward

    @property
    def all_reduce(self) -> Callable[[Tensor], Tensor] | None:
        """The sum over the peers (None when this process holds the whole batch): what a shaper that steps its own
        controller passes to ``step``."""
        return None if self.peers.local else self.peers.sum

    @property
    def coefficient(self) -> float | None:
        """The stage's coefficient in force (its controller's), or None without a controller."""
        return None if self.controller is None else self.controller.coefficient


@dataclass(frozen=True)
class ShaperOutput:
    """What a shaper returns.

    * ``reward``: the batch's reward rewritten — the same shape as ``batch.reward`` (``[B]`` per response or
      ``[B, T]`` per token), or ``[B, T]`` when a per-response reward becomes per-token (KL in the reward: the
      score at the last action token, ``-β·KL`` on every action token). Detached; finite on the rows in play.
    * ``metrics``: declared diagnostics (0-d tensors or functions returning one), logged as ``shaper/<name>/<key>``.
    * ``observation``: a detached tensor fed to the stage's controller (``observe``), which the pipeline then
      steps once, after the batch was shaped with the state in force — a shaper runs once per rollout batch, so its
      controller steps once per batch. None: the shaper stepped its controller itself (before shaping, when its
      output needs the updated state), or keeps none."""

    reward: Tensor
    metrics: Mapping[str, Lazy] = field(default_factory=dict)
    observation: Tensor | None = None


#: ``fn(inp, p)`` → a :class:`ShaperOutput`, or the rewritten reward alone
ShaperFn = Callable[[RolloutInput, Any], "ShaperOutput | Tensor"]


@dataclass(frozen=True)
class ShaperPlugin(_RequiresMixin):
    name: str
    fn: ShaperFn
    params: type[Params]
    requires: Requires
    controller: ControllerFactory | None
    doc: str
    kind: Literal["shaper"] = "shaper"
    role: None = None
    #: the reward layouts it takes: ``"response"`` (``[B]``), ``"token"`` (``[B, T]``)
    rewards: tuple[RewardLayout, ...] = ("response", "token")

    def __call__(self, inp: RolloutInput, p: Params) -> ShaperOutput:
        out = self.fn(inp, p)
        return ShaperOutput(reward=out) if isinstance(out, Tensor) else out

    def make_controller(self, p: Params) -> StepController | None:
        """The stage's controller for parameters ``p`` (None: the shaper keeps no state across steps)."""
        return None if self.controller is None else self.controller(p)


def shaper(
    name: str,
    *,
    params: type[Params] = NoParams,
    requires: Requires = (),
    controller: ControllerFactory | None = None,
    rewards: tuple[RewardLayout, ...] = ("response", "token"),
    doc: str | None = None,
) -> Callable[[ShaperFn], ShaperPlugin]:
    """Declare a reward shaper: ``fn(inp: RolloutInput, p)`` returns the rewritten reward (or a
    :class:`ShaperOutput`). ``requires`` names the optional batch fields it reads besides ``reward`` (or is a
    function of the parameters returning them); ``controller`` is a function of the parameters returning the
    stage's :class:`~lossplug.control.StepController` — its state across steps (an adaptive coefficient, running
    statistics), saved with the trainer's checkpoint — or None; ``rewards``: the reward layouts it takes
    (``"response"``: ``[B]``, ``"token"``: ``[B, T]``) — another one is refused before it runs, naming it."""
    return lambda fn: ShaperPlugin(name, fn, params, _requires(requires), controller, _doc(fn, doc), rewards=rewards)


@dataclass(frozen=True)
class FilterOutput:
    """What a filter returns.

    * ``keep``: bool, ``[B]`` (which responses take part) or ``[B, T]`` (which tokens). What it drops leaves every
      denominator: the pipeline narrows the batch's action mask with it, and the adapters hand that mask to the
      trainer (the token mean, the global token and sequence counts) and to the advantage (group statistics).
      Positions already out of play may be anything.
    * ``metrics``: declared diagnostics, logged as ``filter/<name>/<key>`` (the pipeline adds the fractions of
      responses and tokens the filter dropped)."""

    keep: Tensor
    metrics: Mapping[str, Lazy] = field(default_factory=dict)


#: ``fn(inp, p)`` → a :class:`FilterOutput`, or the ``keep`` mask alone
FilterFn = Callable[[RolloutInput, Any], "FilterOutput | Tensor"]


@dataclass(frozen=True)
class FilterPlugin(_RequiresMixin):
    name: str
    fn: FilterFn
    params: type[Params]
    requires: Requires
    doc: str
    kind: Literal["filter"] = "filter"
    role: None = None

    def __call__(self, inp: RolloutInput, p: Params) -> FilterOutput:
        out = self.fn(inp, p)
        return FilterOutput(keep=out) if isinstance(out, Tensor) else out


def filter(  # the kind's name, as lossplug.gate is the gate kind's (shadows the builtin here only)
    name: str, *, params: type[Params] = NoParams, requires: Requires = (), doc: str | None = None
) -> Callable[[FilterFn], FilterPlugin]:
    """Declare a batch filter: ``fn(inp: RolloutInput, p)`` returns which responses (``[B]``) or tokens
    (``[B, T]``) take part in the update (or a :class:`FilterOutput`). ``requires`` names the optional batch
    fields it reads (or is a function of the parameters returning them)."""
    return lambda fn: FilterPlugin(name, fn, params, _requires(requires), _doc(fn, doc))
