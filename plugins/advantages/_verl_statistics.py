"""Statistics verl 0.9.1's estimators share, reproduced to the last bits (helpers, no plugin).

* :func:`masked_whiten` — verl's ``verl_F.masked_whiten`` over the action tokens of the batch::

      n = Σ mask        μ = Σ x·mask / (n + 1e-8)        σ² = Σ (x − μ)²·mask / (n + 1e-8) · n / (n − 1)
      whiten(x) = (x − μ) · rsqrt(σ² + 1e-8)

  verl's response mask is an integer tensor, so ``n + 1e-8`` and the Bessel factor ``n / (n − 1)`` are computed in
  torch's default float dtype (float32) — kept here (the mask is summed as an integer too), otherwise float64
  results would differ from verl's by up to ~3e-8 relative. One difference: verl raises when the batch holds a
  single action token (``n − 1 = 0``); here the Bessel factor is then 1 (no division by zero).
* :func:`whiten_rows` — the same for a per-response value broadcast over its action tokens (each response weighs
  by its number of action tokens, as in verl's ``[B, T]`` tensors); returns ``[B]``.
* :func:`masked_center`, :func:`center_rows` — the same mean without the division (``whiten: center``): OpenRLHF
  0.11.2's ``no_std_norm`` (``openrlhf/trainer/ppo_utils/experience_maker.py``, ``compute_advantages_and_returns``)::

      μ = Σ x·mask / Σ mask        center(x) = x − μ

  OpenRLHF divides by the exact count (no ``+ 1e-8``) and computes ``μ`` in float32 (``.float()``) whatever the
  advantages' dtype; here ``μ`` is in the advantages' dtype (at least float32), so float64 advantages get a float64
  mean (OpenRLHF's then differ by its float32 rounding, ~1e-8 relative).
* :func:`at_least_float32` — the estimators compute in float32 or wider (bf16 rewards are upcast).
* :func:`group_mean_or_zero` — verl's outcome baselines: the group mean, and 0 for a group of one (verl sets
  ``mean = 0, std = 1`` for singletons instead of giving them no signal).

Reference: verl 0.9.1 ``verl/utils/torch_functional.py`` (``masked_mean``, ``masked_var``, ``masked_whiten``) and
``verl/trainer/ppo/core_algos.py`` (``id2mean``/``id2std`` of the outcome estimators).
"""

from __future__ import annotations

import torch

from lossplug.ops import Groups

Tensor = torch.Tensor


def at_least_float32(x: Tensor) -> Tensor:
    """``x`` in float32 or wider: group statistics and whitening of bf16/fp16 rewards would round visibly."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_whiten(values: Tensor, mask: Tensor) -> Tensor:
    """verl's ``masked_whiten(values, mask)`` for a bool ``mask`` (statistics over action tokens only; NaN/inf off
    the mask never enter them). The result is not zeroed off the mask (verl's is not either)."""
    count = mask.sum()  # an integer, like verl's int64 response_mask: count + 1e-8 is float32 in both
    mean = torch.where(mask, values, 0).sum() / (count + 1e-8)
    centered = values - mean
    var = torch.where(mask, centered * centered, 0).sum() / (count + 1e-8)
    var = var * (count / (count - 1).clamp(min=1))  # Bessel factor: float32, as verl's mask_sum / (mask_sum - 1)
    return centered * torch.rsqrt(var + 1e-8)


def masked_center(values: Tensor, mask: Tensor) -> Tensor:
    """``values − μ``, ``μ`` the mean of ``values`` over the action tokens of the batch (OpenRLHF's ``no_std_norm``);
    not zeroed off the mask (NaN/inf there never enter ``μ``)."""
    return values - torch.where(mask, values, 0).sum() / mask.sum()


def center_rows(row_values: Tensor, mask: Tensor) -> Tensor:
    """:func:`masked_center` of ``row_values[:, None]`` over ``mask`` ``[B, T]``, as the ``[B]`` per-row value: each
    row weighs by its number of action tokens."""
    return row_values - (row_values * mask.sum(-1)).sum() / mask.sum()


def whiten_rows(row_values: Tensor, mask: Tensor) -> Tensor:
    """:func:`masked_whiten` of ``row_values[:, None]`` over ``mask`` ``[B, T]``, as the ``[B]`` per-row value."""
    tokens = torch.where(mask, row_values.unsqueeze(-1), 0)
    count = mask.sum()
    mean = tokens.sum() / (count + 1e-8)
    centered = tokens - mean
    var = torch.where(mask, centered * centered, 0).sum() / (count + 1e-8)
    var = var * (count / (count - 1).clamp(min=1))
    return (row_values - mean) * torch.rsqrt(var + 1e-8)


def group_mean_or_zero(groups: Groups, x: Tensor) -> Tensor:
    """The ``[B]`` mean of each row's group, 0 for a group of one (verl's singleton convention)."""
    mean = groups.mean(x)
    return torch.where(groups.counts > 1, mean, torch.zeros_like(mean))[groups.inverse]


def constant_group(groups: Groups, x: Tensor) -> Tensor:
    """``[B]`` bool: the row's group has ≥ 2 rows and all its values are exactly equal.

    verl subtracts a mean computed in floating point, which can leave rounding noise (then divided by a small
    std + ε); lossplug gives such a group exactly 0, the value of its exact arithmetic."""
    return (groups.constant(x) & (groups.counts > 1))[groups.inverse]
