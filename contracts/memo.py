"""The memo of checked tensors: a step's constant tensors are read once, not once per micro-batch.

A training step validates the same constant tensors over and over: every micro-batch of every epoch slices its
``old_logp``, advantages, reference log-probs out of the step's batch (TRL's buffered generation batch, verl's
``DataProto``). The first check of such a slice checks its whole base tensor once (one pass) and remembers the outcome
in :data:`CHECKED`; later slices of it — views of the same base — skip the pass. Only ``logp``, new on every
forward, is read again.

A remembered tensor is trusted while it lives: the trainers never write into a step's tensors, and torch offers no
public way to see that a tensor was written in place (its version counter is private). What such a write would
break is still caught where it matters: ``policy_loss(validate="full")`` checks that the loss and the update's
log-ratio sum it computes anyway are finite, and when one is not, checks the batch again without the memo
(:meth:`lossplug.PolicyBatch.recheck`), naming the field and the positions. Outside ``policy_loss``, call
:func:`forget_checked` after writing into a checked tensor in place.
"""

from __future__ import annotations

import weakref

import torch

Tensor = torch.Tensor


class CheckedTensors:
    """Tensors whose *every* element passed the value rules, remembered weakly by object.

    * an in-place write into a remembered tensor is not seen (see the module docstring): :func:`forget_checked`, or
      :meth:`forget` for one tensor, reads it again;
    * an entry dies with its tensor (weak reference), so a later tensor at the same address is never mistaken for it;
    * a base that fails the whole-tensor check (garbage off the actions) is remembered too: its slices are then
      checked on their own, on the action positions, without reading the base again;
    * bases much larger than the slice (above ``BASE_READ_LIMIT`` times its size) are not read; the slice is.
    """

    BASE_READ_LIMIT = 256

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Tensor], bool, bool]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, t: Tensor) -> tuple[bool, bool] | None:
        """``(finite, at_most_tolerance)`` of every element of ``t``, or None if ``t`` was not checked."""
        entry = self._entries.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        return entry[1], entry[2]

    def to_read(self, t: Tensor, whole: Tensor, *, below_too: bool = False) -> Tensor | None:
        """What a check of ``t`` must read, ``whole`` being the tensor whose remembered outcome covers it (its base):
        None when ``whole`` passed (the tolerance rule too if ``below_too``); ``whole`` when it was not checked; ``t`` itself when ``whole`` failed (garbage elsewhere in it: this slice on its own)."""
        known = self.get(whole)
        if known is None:
            return whole
        if known[0] and (known[1] or not below_too):
            return None
        return t

    def put(self, t: Tensor, finite: bool, below: bool) -> None:
        key = id(t)
        self._entries[key] = (
            weakref.ref(t, lambda _, key=key: self._entries.pop(key, None)),  # type: ignore[misc]
            finite,
            below,
        )

    def forget(self, t: Tensor) -> None:
        """Forget ``t`` and the tensors whose outcome covers it (its view base, the base of its rows)."""
        for known in (t, base_of(t), rows_of(t)):
            entry = self._entries.get(id(known))
            if entry is not None and entry[0]() is known:
                del self._entries[id(known)]

    def clear(self) -> None:
        self._entries.clear()


#: the process's memo: every contract check reads and fills it
CHECKED = CheckedTensors()


def forget_checked() -> None:
    """Forget every remembered whole-tensor check: the next validation reads every field again."""
    CHECKED.clear()


def base_of(t: Tensor) -> Tensor:
    """The tensor whose whole-tensor check covers ``t``: its view base when that is not much larger, else ``t``."""
    base = t._base
    if (
        base is None
        or base.dtype != t.dtype
        or base.device != t.device
        or base.layout != torch.strided
        or base.numel() > CheckedTensors.BASE_READ_LIMIT * max(t.numel(), 1)
    ):
        return t
    return base


def rows_of(t: Tensor) -> Tensor:
    """The tensor whose per-row outcome covers ``t``'s rows: its base when ``t`` is a range of the base's rows (a
    micro-batch sliced from the step's batch: same row layout), else ``t`` itself."""
    base = t._base
    if (
        base is None
        or base.dtype != t.dtype
        or base.ndim != t.ndim
        or base.shape[1:] != t.shape[1:]
        or base.stride() != t.stride()
        or base.numel() > CheckedTensors.BASE_READ_LIMIT * max(t.numel(), 1)
    ):
        return t
    return base
