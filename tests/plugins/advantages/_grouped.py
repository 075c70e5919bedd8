"""The grouped rewards the group-relative advantage tests share: groups of the given sizes in shuffled order, random
response lengths, one reward per response."""

from __future__ import annotations

import torch

F64 = torch.float64


def grouped_rewards(
    gen: torch.Generator, sizes, T: int, binary: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(group, lengths, mask, score)`` for ``sum(sizes)`` responses of up to ``T`` tokens; group 0's rewards are
    all 1 (an all-equal group), the rest binary (p 0.4) or uniform on [0, 3)."""
    group = torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])
    group = group[torch.randperm(group.numel(), generator=gen)]
    B = group.numel()
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = torch.arange(T) < lengths[:, None]
    score = (torch.rand(B, generator=gen) < 0.4).to(F64) if binary else torch.rand(B, generator=gen, dtype=F64) * 3
    score[group == 0] = 1.0
    return group, lengths, mask, score
