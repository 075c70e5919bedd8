"""Small, deterministic synthetic batches for plugin tests.

The layouts are deliberately awkward: prompt-like masked prefixes, a masked tool-output block inside a response,
trailing padding of different lengths, prompt groups that are scattered and of unequal size, log-ratios on both
sides of 1 and advantages of both signs. Everything is built from a seeded generator, so two calls with the same
arguments give bit-identical tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lossplug.contracts import LossResult, Normalizer, Recipe
    from lossplug.pipeline import MetricLevel

import torch

Tensor = torch.Tensor

#: per-token fields of :class:`~lossplug.PolicyBatch` whose masked positions the kit poisons
TOKEN_FIELDS = ("logp", "old_logp", "behavior_logp", "ref_logp", "value")


def _action_mask(B: int, T: int, g: torch.Generator) -> Tensor:
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        start = i % 2  # odd rows start with a masked, prompt-like position
        end = T - (i % 3)  # 0, 1 or 2 positions of trailing padding
        mask[i, start:end] = True
        if i % 3 == 1 and end - start > 4:  # a masked tool-output block inside the response
            mid = start + (end - start) // 2
            mask[i, mid : mid + 2] = False
        if i == B - 1:  # one short response
            mask[i] = False
            mask[i, start] = True
    # a few random holes, never emptying a row
    holes = torch.rand(B, T, generator=g) < 0.1
    keep_first = torch.zeros_like(mask)
    keep_first[torch.arange(B), mask.float().argmax(-1)] = True
    return mask & (~holes | keep_first)


def group_ids(B: int, group_size: int = 3, *, seed: int = 0) -> Tensor:
    """``[B]`` int64 prompt groups of (roughly) ``group_size`` rollouts, scattered over the rows (not adjacent)."""
    g = torch.Generator().manual_seed(seed + 1)
    n_groups = max(1, B // group_size)
    ids = torch.arange(B) % n_groups  # unequal sizes when B is not a multiple of group_size
    return (ids[torch.randperm(B, generator=g)] * 7 + 3).to(torch.int64)  # non-contiguous ids too


def policy_fields(
    B: int = 6,
    T: int = 10,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    group_size: int = 3,
    log_ratio_scale: float = 0.4,
    token_advantage: bool = False,
) -> dict[str, Tensor]:
    """Every :class:`~lossplug.PolicyBatch` field, filled and consistent (build one with ``PolicyBatch(**fields)``).

    ``logp`` is a leaf that does not yet require grad (call ``.requires_grad_()``). Log-ratios ``logp − old_logp``
    and ``old_logp − behavior_logp`` are spread by ``log_ratio_scale`` around 0, so gates see ratios both inside and
    outside the usual clip ranges. Advantages are nonzero, of both signs.
    """
    g = torch.Generator().manual_seed(seed)

    def logps(base: Tensor, spread: float) -> Tensor:
        return (base + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)

    mask = _action_mask(B, T, g)
    logp = -(0.05 + 2.0 * torch.rand(B, T, generator=g, dtype=torch.float64))
    old_logp = logps(logp, log_ratio_scale)
    behavior_logp = logps(old_logp, log_ratio_scale / 2)
    ref_logp = logps(old_logp, log_ratio_scale)
    sign = torch.where(torch.arange(B) % 2 == 0, 1.0, -1.0).to(torch.float64)
    magnitude = 0.2 + torch.rand(B, generator=g, dtype=torch.float64)
    if token_advantage:
        advantage = sign[:, None] * (magnitude[:, None] + 0.5 * torch.rand(B, T, generator=g, dtype=torch.float64))
    else:
        advantage = sign * magnitude
    terminated = torch.arange(B) % 3 != 2  # every third response was truncated by a time limit
    fields = dict(
        logp=logp,
        old_logp=old_logp,
        behavior_logp=behavior_logp,
        ref_logp=ref_logp,
        advantage=advantage,
        action_mask=mask,
        reward=torch.randn(B, generator=g, dtype=torch.float64),
        value=torch.randn(B, T, generator=g, dtype=torch.float64),
        group_id=group_ids(B, group_size, seed=seed),
        trajectory_id=torch.arange(B, dtype=torch.int64),
        terminated=terminated,
        final_value=torch.randn(B, generator=g, dtype=torch.float64),
    )
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in fields.items()}


def packed_fields(N: int = 12, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> dict[str, Tensor]:
    """Every :class:`~lossplug.PackedTransitions` field: three trajectories, one of them truncated by a time limit."""
    g = torch.Generator().manual_seed(seed)
    boundary = torch.zeros(N, dtype=torch.bool)
    terminated = torch.zeros(N, dtype=torch.bool)
    cuts = sorted({N // 3 - 1, 2 * N // 3 - 1, N - 1})
    boundary[cuts] = True
    terminated[cuts[0]] = True
    terminated[cuts[-1]] = True  # the middle fragment is a time-limit truncation: boundary, not terminated
    trajectory_id = torch.zeros(N, dtype=torch.int64)
    for k, c in enumerate(cuts[:-1]):
        trajectory_id[c + 1 :] = k + 1
    next_value = torch.randn(N, generator=g, dtype=torch.float64)
    next_value[terminated] = float("nan")  # ignored where terminated: the contract allows anything there
    fields = dict(
        reward=torch.randn(N, generator=g, dtype=torch.float64),
        value=torch.randn(N, generator=g, dtype=torch.float64),
        next_value=next_value,
        terminated=terminated,
        boundary=boundary,
        trajectory_id=trajectory_id,
    )
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in fields.items()}


def poison(t: Tensor, where: Tensor, *, seed: int = 0) -> Tensor:
    """A copy of ``t`` with NaN, +inf, −inf and huge finite values written at the ``where`` positions."""
    g = torch.Generator().manual_seed(seed + 7)
    choices = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e30, -1e30], dtype=t.dtype)
    pick = torch.randint(0, len(choices), t.shape, generator=g)
    return torch.where(where, choices[pick], t.detach()).detach()


def insert_masked_columns(
    fields: dict[str, Tensor], before: int = 2, after: int = 3, fill: float | None = None
) -> dict[str, Tensor]:
    """The same batch with ``before`` masked columns in front (a prompt) and ``after`` behind (padding).

    Per-token fields get ``fill`` (default: poison) in the new columns; ``[B]`` fields are unchanged.
    """
    mask = fields["action_mask"]
    B, T = mask.shape
    out = {}
    for name, t in fields.items():
        if t is None or t.ndim != 2 or t.shape != (B, T):
            out[name] = t
            continue
        if t.dtype == torch.bool:  # action_mask, observation_mask: a new column is neither
            pad = torch.zeros(B, before + after, dtype=torch.bool)
        elif not t.is_floating_point():  # an integer field (behavior_version): any value off the actions
            pad = torch.full((B, before + after), -(2**31), dtype=t.dtype)
        else:
            pad = torch.full((B, before + after), float("nan") if fill is None else fill, dtype=t.dtype)
            if fill is None:
                pad = poison(pad, torch.ones_like(pad, dtype=torch.bool))
        out[name] = torch.cat([pad[:, :before], t.detach(), pad[:, before:]], dim=1)
    return out


def loss_and_grad(
    recipe: Recipe | str,
    *,
    logp: Tensor,
    action_mask: Tensor | None = None,
    normalizer: Normalizer | None = None,
    metrics: bool | MetricLevel = "full",
    **fields: Tensor | None,
) -> tuple[LossResult, Tensor | None]:
    """Run ``policy_loss`` on these tensors (all-True mask by default) and return ``(LossResult, d loss / d logp)``:
    the two things a plugin's own tests usually assert on. Every metric is computed (``metrics="full"``): a test
    wants to see them all."""
    import lossplug

    logp = logp.detach().clone().requires_grad_()
    mask = torch.ones_like(logp, dtype=torch.bool) if action_mask is None else action_mask
    result = lossplug.policy_loss(
        lossplug.PolicyBatch(logp=logp, action_mask=mask, **fields), recipe, normalizer, metrics=metrics
    )
    result.loss.backward()
    return result, logp.grad
