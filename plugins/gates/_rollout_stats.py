"""Masked statistics computed the way verl's ``rollout_corr_helper`` computes them, for the rollout-correction gates'
metrics (``tis``/``icepop``, ``rollout_rs``, ``offpolicy_metrics``).

verl reduces with ``masked_mean(x, mask) = Σ_mask x / (Σ mask + 1e-8)``. With the integer response mask of its
trainer the ``+ 1e-8`` is added in float32 and vanishes for any count ≥ 1, so the exact denominators are the plain
counts used here: the action tokens ``N`` of the batch (a token mean) and the action tokens ``L_i`` of a response (a
response's own mean; ``0`` for a response without any, as in verl). A per-response value ``x_i`` (a sequence-level
weight, which verl broadcasts over the response) enters a token mean once per action token: ``Σ_i L_i x_i / N``.
Fractions are counts divided in float32, as verl's ``(hit).float()`` means are. Everything is tensor code: no
host synchronisation.

Reference: verl 0.9.1 ``verl/trainer/ppo/rollout_corr_helper.py`` and ``verl/utils/torch_functional.py``
(``masked_sum``, ``masked_mean``).
"""

from __future__ import annotations

import functools

import torch

import lossplug

Tensor = torch.Tensor

#: verl's ``SAFETY_BOUND``: log-ratios are clamped to ± this before ``exp``
SAFETY_BOUND = 20.0


def wide(x: Tensor) -> Tensor:
    """``x`` in float64 (float32 on Apple's MPS, which has no float64), for metrics that exponentiate or invert: a
    perplexity ``exp(100)`` overflows float32 (max ≈ e^88.7) but not float64 (≈ e^709)."""
    return x.to(torch.float32 if x.device.type == "mps" else torch.float64)


def token_mean(inp: lossplug.GateInput, x: Tensor) -> Tensor:
    """Mean over the action tokens of ``x`` ``[B, T]``, or of a per-response ``x`` ``[B]`` repeated over each
    response's action tokens."""
    if x.ndim == 1:
        return (x * inp.lengths.to(x.dtype)).sum() / inp.action_tokens
    return torch.where(inp.mask, x, 0).sum() / inp.action_tokens


def token_fraction(inp: lossplug.GateInput, hit: Tensor) -> Tensor:
    """The fraction of action tokens that ``hit`` ``[B, T]`` (or per response, ``[B]``) marks, in float32."""
    if hit.ndim == 1:
        count = (hit.to(inp.lengths.dtype) * inp.lengths).sum()
    else:
        count = torch.count_nonzero(hit & inp.mask)
    return count.to(torch.float32) / inp.action_tokens.to(torch.float32)


def row_mean(inp: lossplug.GateInput, x: Tensor) -> Tensor:
    """Each response's mean of ``x`` ``[B, T]`` over its action tokens, ``[B]`` (0 for a response without any)."""
    return torch.where(inp.mask, x, 0).sum(-1) / inp.lengths.clamp(min=1)


def token_max(inp: lossplug.GateInput, x: Tensor) -> Tensor:
    return torch.where(inp.mask, x, float("-inf")).max()


def token_min(inp: lossplug.GateInput, x: Tensor) -> Tensor:
    return torch.where(inp.mask, x, float("inf")).min()


def std_or_zero(x: Tensor) -> Tensor:
    """``x.std()`` (unbiased) over the rows, 0 for a single row (verl's ``.std() if numel > 1 else 0.0``)."""
    return x.std() if x.shape[0] > 1 else torch.zeros((), dtype=x.dtype, device=x.device)


def clamped_std(inp: lossplug.GateInput, x: Tensor, low: float, high: float) -> Tensor:
    """verl's ``_std`` metrics: the population standard deviation over the action tokens of ``x`` clamped to
    ``[low, high]``, as ``sqrt(max(E[x²] − E[x]², 0))``; 0 when the batch has a single action token."""
    clamped = x.clamp(min=low, max=high)
    mean = token_mean(inp, clamped)
    std = (token_mean(inp, clamped.square()) - mean.square()).clamp(min=0.0).sqrt()
    return torch.where(inp.lengths.sum() > 1, std, torch.zeros_like(std))


@functools.lru_cache(maxsize=256)
def float32_log(value: float) -> float:
    """``log(value)`` as verl computes its log thresholds: ``torch.log(torch.tensor(value))``, in float32."""
    return float(torch.tensor(value, dtype=torch.float32).log())


class ValidRows:
    """Statistics over the responses with at least one action token (verl's ``seq_values[seq_valid_mask]``), without
    selecting them (no data-dependent shapes): sums with the others left out; every statistic is 0 when there is no
    such response, as in verl."""

    def __init__(self, inp: lossplug.GateInput, values: Tensor):
        self.values = values
        self.valid = inp.lengths > 0
        self.count = torch.count_nonzero(self.valid)
        self._any = self.count > 0

    def _or_zero(self, x: Tensor) -> Tensor:
        return torch.where(self._any, x, torch.zeros_like(x))

    def mean(self) -> Tensor:
        return torch.where(self.valid, self.values, 0).sum() / self.count.clamp(min=1)

    def std(self) -> Tensor:
        """Unbiased standard deviation (0 for fewer than two responses)."""
        centered = torch.where(self.valid, self.values - self.mean(), 0)
        std = (centered.square().sum() / (self.count - 1).clamp(min=1)).sqrt()
        return torch.where(self.count > 1, std, torch.zeros_like(std))

    def max(self) -> Tensor:
        return self._or_zero(torch.where(self.valid, self.values, float("-inf")).max())

    def min(self) -> Tensor:
        return self._or_zero(torch.where(self.valid, self.values, float("inf")).min())

    def abs_max(self) -> Tensor:
        return self._or_zero(torch.where(self.valid, self.values.abs(), float("-inf")).max())

    def fraction(self, hit: Tensor) -> Tensor:
        """The fraction of these responses where ``hit`` ``[B]`` holds, in float32."""
        count = torch.count_nonzero(hit & self.valid).to(torch.float32)
        return count / self.count.clamp(min=1).to(torch.float32)
