"""Sequential reference loops, the oracles the vectorised code is tested and benchmarked against.

They are deliberately naive — one Python step per transition — so that they are obviously the formula.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


@torch.no_grad()
def sequential_packed_gae(
    reward: Tensor,
    value: Tensor,
    next_value: Tensor,
    terminated: Tensor,
    boundary: Tensor,
    gamma: float = 0.99,
    lam: float = 0.95,
) -> Tensor:
    """GAE (Schulman et al., arXiv:1506.02438) over packed transitions, a Python loop over time: ``terminated``
    decides the bootstrap (Gymnasium's terminated/truncated split), ``boundary`` resets the trace."""
    if not all(x.shape == reward.shape for x in (value, next_value, terminated, boundary)):
        raise ValueError("all transition tensors must align")
    if reward.ndim != 1 or reward.numel() == 0 or not boundary[-1]:
        raise ValueError("packed fragments must be non-empty, one-dimensional and closed")
    if terminated.dtype != torch.bool or boundary.dtype != torch.bool:
        raise ValueError("terminated and boundary must be boolean")
    if torch.any(terminated & ~boundary):
        raise ValueError("terminal transitions must close their trajectory")
    bootstrap = torch.where(terminated, torch.zeros_like(next_value), next_value)
    delta = reward + gamma * bootstrap - value
    advantage = torch.empty_like(delta)
    carry = delta.new_zeros(())
    for t in range(delta.numel() - 1, -1, -1):
        carry = delta[t] if boundary[t] else delta[t] + gamma * lam * carry
        advantage[t] = carry
    return advantage
