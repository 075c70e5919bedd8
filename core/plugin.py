"""What a plugin is: a function plus its parameter model and its declared needs.

Authors write a function and decorate it::

    class TanhParams(lossplug.Params):
        scale: float = Field(1.0, gt=0)

    @lossplug.gate("tanh_clip", params=TanhParams, requires=("old_logp",))
    def tanh_clip(inp: lossplug.GateInput, p: TanhParams) -> lossplug.GateOutput:
        ...

and register it from a hook: ``register(tanh_clip)``.

Sign convention (fixed project-wide): gates return **objectives** — quantities to maximise, per token. The pipeline
reduces the objective and returns ``loss = -objective``. No plugin flips a sign on its own.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict

from lossplug.contracts import AdvantageResult, PackedTransitions, PolicyBatch

Tensor = torch.Tensor


class Params(BaseModel):
    """Base class of plugin parameter models: unknown parameters are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoParams(Params):
    """For plugins without parameters."""


def _doc(fn: Callable, doc: Optional[str]) -> str:
    return inspect.cleandoc(doc or fn.__doc__ or "")


# ---------------------------------------------------------------------------------------------------------------------
# Gates


@dataclass(frozen=True)
class GateInput:
    """The per-micro-batch tensors a gate reads, prepared once by the pipeline.

    Every per-token tensor has its non-action positions replaced by 0 (``logp`` through ``torch.where``, so the
    gradient still flows on action positions): whatever the batch held there — NaN, inf — can neither leak into the
    loss nor into the gradient (0 · NaN in a backward pass is NaN, so masking only the output is not enough).

    ``metrics`` is False when the caller asked for no metrics (``policy_loss(metrics="off")``): a gate then skips its
    diagnostic work — ``GateOutput.metrics`` and ``active`` are not read — and computes only what the objective or
    weight needs. With ``metrics`` True a gate reports its cheap diagnostics: counts and fractions of what it cut,
    each a comparison and a count over ``[B, T]`` (``policy_loss(metrics="basic")``, what the adapters run on every
    micro-batch by default, comparable to the trainers' own clip fractions). ``full_metrics`` is True only for
    ``metrics="full"``: then a gate may add anything costlier (distributions, ratio extremes) and returns
    ``active``, which feeds the pipeline's effective-sample metrics.

    ``seq_advantage`` is the per-response advantage ``[B]`` (detached, in the compute dtype) when the batch holds
    one, else None. ``advantage`` is always there (the ``[B]`` one broadcast over ``[B, T]`` and zeroed off the
    actions); a gate whose advantage enters only through per-response terms may compute those on ``[B]`` and
    broadcast once. Its objective off the actions may then be nonzero (finite): the pipeline zeroes the objective
    off the actions, value and gradient, before any reduction.
    """

    logp: Tensor
    mask: Tensor
    advantage: Tensor
    lengths: Tensor
    old_logp: Optional[Tensor]
    behavior_logp: Optional[Tensor]
    ref_logp: Optional[Tensor]
    batch: PolicyBatch
    metrics: bool = True
    seq_advantage: Optional[Tensor] = None
    full_metrics: bool = True

    def broadcast_advantage(self) -> Tensor:
        """The advantage in the cheapest form that broadcasts against ``[B, T]``: a ``[B, 1]`` column for a ``[B]``
        advantage (its value off the actions is the response's — the pipeline zeroes the objective there), else the
        ``[B, T]`` tensor. Detached."""
        if self.seq_advantage is not None:
            return self.seq_advantage.unsqueeze(-1)
        return self.advantage.detach()

    def update_log_ratio(self) -> Tensor:
        """log(π_θ / π_old) per token; zero off actions. Gradient flows through ``logp`` only.

        Computed once per micro-batch and shared (the update gate and the metrics read the same tensor): do not
        modify it in place."""
        cached = self.__dict__.get("_update_log_ratio")
        if cached is None:
            cached = self.logp - self.old_logp.detach()
            self.__dict__["_update_log_ratio"] = cached  # a frozen dataclass: its fields stay immutable
        return cached

    def engine_log_ratio(self) -> Tensor:
        """log(π_old / π_behaviour) per token, detached; zero off actions."""
        return (self.old_logp - self.behavior_logp).detach()

    def masked_mean(self, x: Tensor) -> Tensor:
        """Mean of ``x`` over the action tokens of this micro-batch (for metrics)."""
        return torch.where(self.mask, x, 0).sum() / self.mask.sum().clamp(min=1)

    def sequence_mean(self, x: Tensor) -> Tensor:
        """Per-response mean of ``x`` over action tokens, ``[B]``."""
        return torch.where(self.mask, x, 0).sum(-1) / self.lengths.clamp(min=1)


@dataclass(frozen=True)
class GateOutput:
    """What a gate returns.

    * update gates set ``objective`` ``[B, T]``: the per-token objective (to maximise), carrying the gradient;
    * corrections set ``weight``: a **detached** coefficient ``[B, T]`` (token level) or ``[B]`` (sequence level)
      that multiplies the objective.

    ``active`` marks what still carries gradient after this gate (``[B, T]`` for token-level gates, ``[B]`` for
    sequence-level ones); it feeds the effective-sample-rate metrics. ``metrics`` are 0-d tensors.
    """

    objective: Optional[Tensor] = None
    weight: Optional[Tensor] = None
    active: Optional[Tensor] = None
    metrics: dict[str, Tensor] = field(default_factory=dict)


GateFn = Callable[[GateInput, Params], GateOutput]
#: the batch fields a plugin reads: fixed, or a function of its parameters (e.g. ``kl_coef`` set → ``ref_logp``)
Requires = Union[tuple[str, ...], Callable[[Params], tuple[str, ...]]]


def _requires(requires: Requires) -> Requires:
    return requires if callable(requires) else tuple(requires)


class _RequiresMixin:
    def required_fields(self, params: Params) -> tuple[str, ...]:
        """The batch fields this plugin reads with these parameters."""
        return tuple(self.requires(params)) if callable(self.requires) else self.requires


@dataclass(frozen=True)
class GatePlugin(_RequiresMixin):
    name: str
    fn: GateFn
    params: type[Params]
    requires: Requires
    role: Literal["update", "correction"]
    level: Literal["token", "sequence"]
    doc: str
    kind: str = "gate"

    def __call__(self, inp: GateInput, p: Params) -> GateOutput:
        return self.fn(inp, p)


def gate(name: str, *, params: type[Params] = NoParams, requires: Requires = (),
         role: Literal["update", "correction"] = "update", level: Literal["token", "sequence"] = "token",
         doc: Optional[str] = None) -> Callable[[GateFn], GatePlugin]:
    """Declare a gate. ``requires`` names the optional :class:`PolicyBatch` fields it reads (e.g. ``old_logp``), or
    is a function of the parameters returning them."""
    return lambda fn: GatePlugin(name, fn, params, _requires(requires), role, level, _doc(fn, doc))


# ---------------------------------------------------------------------------------------------------------------------
# Advantages

AdvantageFn = Callable[[Union[PolicyBatch, PackedTransitions], Params], Union[Tensor, AdvantageResult]]


@dataclass(frozen=True)
class AdvantagePlugin(_RequiresMixin):
    name: str
    fn: AdvantageFn
    params: type[Params]
    requires: Requires
    layouts: tuple[str, ...]
    min_group_size: int
    doc: str
    kind: str = "advantage"
    role: None = None

    def __call__(self, batch, p: Params) -> AdvantageResult:
        out = self.fn(batch, p)
        return out if isinstance(out, AdvantageResult) else AdvantageResult(advantage=out)


def advantage(name: str, *, params: type[Params] = NoParams, requires: Requires = (),
              layouts: tuple[str, ...] = ("padded",), min_group_size: int = 0,
              doc: Optional[str] = None) -> Callable[[AdvantageFn], AdvantagePlugin]:
    """Declare an advantage estimator.

    ``layouts``: ``"padded"`` (:class:`PolicyBatch`) and/or ``"packed"`` (:class:`PackedTransitions`).
    ``min_group_size``: the smallest prompt group it can work with (checked from ``group_id`` before it runs).
    """
    return lambda fn: AdvantagePlugin(name, fn, params, _requires(requires), tuple(layouts), min_group_size,
                                      _doc(fn, doc))


# ---------------------------------------------------------------------------------------------------------------------
# Reductions


@dataclass(frozen=True)
class Population:
    """Denominators of a reduction: the global population when a Normalizer is given, else this micro-batch's."""

    action_tokens: Union[int, Tensor]
    sequences: Union[int, Tensor]
    groups: Optional[int]
    budget: Optional[float]


ReductionFn = Callable[[Tensor, Tensor, Tensor, Population, Params], Tensor]


@dataclass(frozen=True)
class ReductionPlugin:
    """``fn(objective [B,T], mask [B,T], lengths [B], population, params) -> scalar``.

    It must be *additive*: the value of a micro-batch is its share of the full-step reduction, so that summing over
    micro-batches and ranks gives the full-batch value exactly. ``objective`` is already zero off actions.
    """

    name: str
    fn: ReductionFn
    params: type[Params]
    doc: str
    kind: str = "reduction"
    role: None = None

    def __call__(self, objective: Tensor, mask: Tensor, lengths: Tensor, population: Population, p: Params) -> Tensor:
        return self.fn(objective, mask, lengths, population, p)


def reduction(name: str, *, params: type[Params] = NoParams,
              doc: Optional[str] = None) -> Callable[[ReductionFn], ReductionPlugin]:
    """Declare a reduction."""
    return lambda fn: ReductionPlugin(name, fn, params, _doc(fn, doc))


AnyPlugin = Union[AdvantagePlugin, GatePlugin, ReductionPlugin]
