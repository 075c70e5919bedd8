"""The global population of one optimizer step.

A reduction divides by a population: action tokens (token mean), sequences (response mean, per-response sums) or a
fixed budget. Under gradient accumulation and data parallelism each micro-batch only sees part of that population,
and dividing by the part is the bug every peer framework has shipped ("token-mean" silently becoming a mean of
per-micro-batch means). A :class:`Normalizer` carries the counts of the **whole** step, so that the sum of the
micro-batch losses over all micro-batches and all ranks equals the full-batch reduction exactly.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import LossplugError


def whole_count(value: Any, where: str) -> int:
    """``value`` as an ``int`` if it is a whole number (``3`` or ``3.0``), else a :class:`LossplugError` naming
    ``where``. A count is never rounded: ``int(3.5)`` would silently shrink the population."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value).is_integer():
        raise LossplugError(f"{where}: must be a whole number, got {type(value).__name__} {value!r}")
    return int(float(value))


class Normalizer(BaseModel):
    """Counts of the global population of one optimizer step (all micro-batches, all data-parallel ranks).

    ``sequences`` is whatever the trainer divides by. lossplug's own rule, used when no ``Normalizer`` is given and
    by :meth:`for_masks`, counts only responses with at least one action token (a fully masked row is not a response
    of the population — verl's and OpenRLHF's convention); a trainer that keeps such rows in its mean (TRL, whose
    ``mask_truncated_completions`` rows stay in the mean) counts them here — the TRL adapter does.

    ``micro_batches`` is the number of micro-batches the step is split into, over all ranks. A regularizer with
    ``population: micro_batch`` (a per-micro-batch mean, like TRL's entropy bonus) is weighted by ``1 /
    micro_batches`` when it is given — exactly the trainer's mean of per-micro-batch values, whatever rows a
    micro-batch holds — else by the micro-batch's share of the responses, ``rows / sequences`` (the same when every
    micro-batch has the same number of rows and none is left out of a micro-batch).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: action tokens in the whole step
    action_tokens: int = Field(gt=0)
    #: responses (sequences) in the whole step
    sequences: int = Field(gt=0)
    #: prompt groups in the whole step, where known
    groups: int | None = Field(default=None, gt=0)
    #: the fixed generation budget per response (e.g. ``max_completion_length``) used by the ``fixed`` reduction
    #: when its recipe gives none
    budget: float | None = Field(default=None, gt=0)
    #: micro-batches in the whole step (all ranks), where known: the weight ``1 / micro_batches`` of a regularizer
    #: whose population is its micro-batch
    micro_batches: int | None = Field(default=None, gt=0)
    #: ``(group id, action tokens)`` of every prompt group in the whole step, sorted by id, where known: the
    #: denominators of the ``prompt_mean`` reduction (a group's tokens may lie in several micro-batches)
    group_tokens: tuple[tuple[int, int], ...] | None = None

    @model_validator(mode="before")
    @classmethod
    def _positive_counts(cls, data: Any) -> Any:
        # our own message instead of pydantic's report: a zero or missing population is the bug this class exists
        # to catch, and the user should read which count and why
        if not isinstance(data, dict):
            raise LossplugError(f"Normalizer: expected keyword counts, got {type(data).__name__}")
        data = dict(data)
        for name in ("action_tokens", "sequences", "groups", "budget", "micro_batches"):
            value = data.get(name)
            if value is None:
                if name in ("action_tokens", "sequences"):
                    raise LossplugError(f"Normalizer.{name}: required (the count of the whole optimizer step)")
                continue
            if name == "budget":
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise LossplugError(f"Normalizer.{name}: must be a number, got {type(value).__name__} {value!r}")
            else:
                value = data[name] = whole_count(value, f"Normalizer.{name}")
            if not value > 0:
                hint = (
                    " — the step has no action tokens (every response fully masked?)" if name == "action_tokens" else ""
                )
                raise LossplugError(f"Normalizer.{name}: must be greater than 0, got {value!r}{hint}")
        return data

    @classmethod
    def for_masks(
        cls,
        action_masks: Iterable[torch.Tensor],
        *,
        budget: float | None = None,
        group_ids: Iterable[torch.Tensor] | None = None,
        count_empty_responses: bool = False,
        micro_batches: int | None = None,
    ) -> Normalizer:
        """The population of the micro-batches whose action masks are given (e.g. all micro-batches of a step).

        Responses without an action token are not counted unless ``count_empty_responses`` (TRL's convention).
        ``micro_batches`` is passed through, not counted from the masks: the masks given may be the whole step's in
        one tensor while the step runs as several micro-batches."""
        masks = list(action_masks)
        tokens = sum(int(m.sum()) for m in masks)
        sequences = sum(
            int(m.shape[0]) if count_empty_responses else int(m.reshape(m.shape[0], -1).any(-1).sum()) for m in masks
        )
        groups = group_tokens = None
        if group_ids is not None:
            ids = torch.cat([g.reshape(-1).cpu() for g in group_ids])
            rows = torch.cat([m.reshape(m.shape[0], -1).sum(-1).cpu() for m in masks])
            unique, inverse = torch.unique(ids, return_inverse=True)
            counts = torch.zeros(len(unique), dtype=torch.int64).index_add_(0, inverse, rows.to(torch.int64))
            groups = int(unique.numel())
            group_tokens = tuple(zip(unique.tolist(), counts.tolist()))
        return cls(
            action_tokens=tokens,
            sequences=sequences,
            groups=groups,
            budget=budget,
            micro_batches=micro_batches,
            group_tokens=group_tokens,
        )

    @classmethod
    def all_reduce(cls, local: Normalizer, group: Any = None) -> Normalizer:
        """Sum this rank's local population over a ``torch.distributed`` process group.

        ``groups`` is summed too, which is exact when every prompt group lives on one rank (as in TRL and verl,
        where the rollouts of a prompt are scattered only within the rank's generation batch); under the same
        condition ``group_tokens`` stays the rank's own (a rank only ever looks up its own groups). ``micro_batches``
        (this rank's, where given) is summed into the step's count over all ranks; every rank must then give it.
        """
        import torch.distributed as dist

        counts = torch.tensor(
            [local.action_tokens, local.sequences, local.groups or 0, local.micro_batches or 0], dtype=torch.float64
        )
        if dist.get_backend(group) == "nccl":
            counts = counts.cuda()
        dist.all_reduce(counts, group=group)
        tokens, sequences, groups, micro_batches = (int(round(v)) for v in counts.tolist())
        return cls(
            action_tokens=tokens,
            sequences=sequences,
            groups=groups or None,
            budget=local.budget,
            micro_batches=(micro_batches or None) if local.micro_batches is not None else None,
            group_tokens=local.group_tokens,
        )

    def check_covers(self, action_tokens: int, sequences: int) -> None:
        """Refuse a population smaller than the micro-batch it normalises — a denominator that cannot be right."""
        if action_tokens > self.action_tokens or sequences > self.sequences:
            raise LossplugError(
                f"Normalizer: the global population (action_tokens={self.action_tokens}, sequences={self.sequences}) "
                f"is smaller than this micro-batch alone (action_tokens={action_tokens}, sequences={sequences}); "
                "the normaliser must count the whole optimizer step (all micro-batches and ranks)"
            )
