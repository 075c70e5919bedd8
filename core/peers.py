"""Where a gate's batch-level statistic is pooled: this micro-batch alone, or with its peers on the other ranks.

Most statistics a gate takes are per token or per response and need nothing else. A few are taken over a whole
batch — a quantile, a mean — and there the trainer decides *which* batch: TRL's ``top_entropy_quantile`` takes the
entropy quantile over the current micro-batch of **every process** (``get_high_entropy_mask`` gathers the action
entropies first), verl's bypass-mode ``rollout_is_batch_normalize`` the weights' mean over every rank
(``distributed_masked_mean``). A gate computed on one rank's micro-batch matches the trainer only when it pools
over the same ranks. :class:`Peers` is that pool: the adapter — which knows the process group — builds one per
step and passes it to :func:`lossplug.policy_loss` (``peers=``); a gate reads it as ``inp.peers`` and calls
:meth:`Peers.gather` (a quantile's values) or :meth:`Peers.sum` (a mean's total and count). Without one, a gate
pools over its own micro-batch (:data:`LOCAL`): exactly the trainer on one process.

The pool is the micro-batches that run *at the same time* on the peer ranks — what a collective can reach. A
statistic over every micro-batch of an optimizer step cannot be pooled this way (the later micro-batches' current
log-probs do not exist yet); those are counted beforehand and passed in the :class:`~lossplug.Normalizer` (as
``prompt_mean``'s ``group_tokens``) or computed once per rollout batch
(:func:`lossplug.plugins.gates.whole_batch_weight`).

Every peer must call the same collectives in the same order: a gate calls them unconditionally (never only on the
ranks where some value is non-empty), as the trainers do. :meth:`Peers.gather` costs one host synchronisation (the
peers' lengths decide the padding), as TRL's ``pad_across_processes``; on one rank nothing is called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lossplug.contracts import LossplugError

__all__ = ["LOCAL", "Peers"]

Tensor = torch.Tensor

#: ``tensor → tensor``: the tensors of every peer (each the same shape) concatenated along dimension 0, in rank order
AllGather = Callable[[Tensor], Tensor]
#: ``tensor → tensor``: the element-wise sum over every peer
AllSum = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class Peers:
    """The ranks a batch-level statistic is pooled over, and the two collectives a gate may use on them.

    ``size`` is the number of ranks (this one included). ``all_gather`` and ``all_sum`` are the trainer's own
    collectives (e.g. ``accelerator.gather`` and ``accelerator.reduce(·, "sum")``); :meth:`torch_distributed` builds
    them from a ``torch.distributed`` process group. With ``size == 1`` neither is called."""

    size: int = 1
    all_gather: AllGather | None = None
    all_sum: AllSum | None = None

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise LossplugError(f"Peers.size: must be a whole number ≥ 1 (the ranks pooled), got {self.size!r}")
        if self.size > 1 and (self.all_gather is None or self.all_sum is None):
            missing = " and ".join(n for n in ("all_gather", "all_sum") if getattr(self, n) is None)
            raise LossplugError(f"Peers: size={self.size} needs the collectives to pool with, but {missing} is None")

    @property
    def local(self) -> bool:
        """True when the pool is this micro-batch alone (nothing to communicate)."""
        return self.size == 1

    def gather(self, values: Tensor) -> Tensor:
        """Every peer's 1-D ``values`` (lengths may differ, detached) concatenated in rank order: the population a
        quantile or a top-k is taken over. This rank's own values when :attr:`local`."""
        if values.ndim != 1:
            raise LossplugError(f"Peers.gather: expected a 1-D tensor of values, got shape {tuple(values.shape)}")
        values = values.detach()
        if self.local:
            return values
        gather = self.all_gather
        assert gather is not None  # (checked in __post_init__)
        lengths = gather(torch.tensor([values.numel()], device=values.device))
        longest = int(lengths.max())  # the one host synchronisation: the padding every peer agrees on
        padded = torch.cat([values, values.new_zeros(longest - values.numel())])
        everyone = gather(padded).reshape(self.size, longest)
        present = torch.arange(longest, device=values.device) < lengths.unsqueeze(-1)
        return everyone[present]

    def sum(self, values: Tensor) -> Tensor:
        """The element-wise sum of ``values`` (same shape on every peer, detached) over the peers: the totals and
        counts of a pooled mean. ``values`` itself when :attr:`local`."""
        values = values.detach()
        if self.local:
            return values
        total = self.all_sum
        assert total is not None  # (checked in __post_init__)
        return total(values)

    @classmethod
    def torch_distributed(cls, group: Any = None) -> Peers:
        """The ranks of a ``torch.distributed`` process group (``None``: the default group, as verl's
        ``distributed_masked_mean``); :data:`LOCAL` when ``torch.distributed`` is not initialised or the group has
        one rank."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return LOCAL
        size = dist.get_world_size(group)
        if size == 1:
            return LOCAL

        def all_gather(tensor: Tensor) -> Tensor:
            parts = [torch.empty_like(tensor) for _ in range(size)]
            dist.all_gather(parts, tensor.contiguous(), group=group)
            return torch.cat(parts)

        def all_sum(tensor: Tensor) -> Tensor:
            total = tensor.clone()
            dist.all_reduce(total, group=group)
            return total

        return cls(size=size, all_gather=all_gather, all_sum=all_sum)


#: the default pool: the micro-batch alone
LOCAL = Peers()
