"""lossplug's metrics in TRL's logs: ``lossplug/<name>`` in ``trainer._metrics[mode]``, averaged over processes (TRL's
own keys, reduced as TRL reduces them, are :mod:`lossplug.adapters.trl.dashboard`'s)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from lossplug.adapters.common import stack_metrics

if TYPE_CHECKING:
    from trl import GRPOTrainer

__all__ = ["log_metrics"]


def log_metrics(trainer: GRPOTrainer, mode: str, metrics: Mapping[str, torch.Tensor]) -> None:
    """Append ``lossplug/<name>`` to TRL's metric lists, averaged over processes.

    Processes may hold different metric names (a micro-batch whose rows were all masked out computes no policy
    metrics), so with several processes the names are agreed on first and a missing value is NaN (ignored by the
    nan-mean here and by TRL's ``log``).
    """
    accelerator = trainer.accelerator
    names = sorted(metrics)
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        names = sorted({n for names_r in gather_object([names]) for n in names_r})
    if not names:
        return
    device = accelerator.device
    wide = torch.float32 if torch.device(device).type == "mps" else torch.float64  # e^100 stays a number
    nan = torch.tensor(float("nan"), device=device, dtype=wide)
    values = stack_metrics([metrics[k] if k in metrics else nan for k in names], dtype=wide, device=device)
    if accelerator.num_processes > 1:
        values = accelerator.gather(values.unsqueeze(0)).nanmean(0)
    for name, value in zip(names, values.tolist()):
        trainer._metrics[mode][f"lossplug/{name}"].append(value)
