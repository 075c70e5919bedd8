"""Refusing a micro-batch that splits a prompt group, for gates whose statistics couple a group's rollouts (gvpo,
tpo): one decision, taken without a host synchronisation on an accelerator."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lossplug.contracts import LossplugError


def refuse_split_groups(bad: torch.Tensor, gate: str, describe: Callable[[], str]) -> None:
    """Refuse when any of ``bad`` (rows of a group that is not whole) is set: on the CPU a :class:`LossplugError`
    with ``describe()``'s message; elsewhere a device-side assert naming the gate and the setting (no host sync)."""
    if bad.device.type != "cpu":
        torch._assert_async(~bad.any(), f"gate '{gate}': a prompt group is not whole in this micro-batch (group_size)")
        return
    if bool(bad.any()):
        raise LossplugError(describe())
