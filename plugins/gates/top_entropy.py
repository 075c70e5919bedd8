"""Train only on the high-entropy "forking" tokens: a detached 0/1 weight from the micro-batch's entropy quantile.

With ``H_t`` the current policy's entropy at action token ``t`` (``PolicyBatch.entropy``) and ``ρ`` = ``quantile``
the fraction of tokens to keep, the threshold is the ``(1 − ρ)``-quantile of the entropies of **the micro-batch's
action tokens** (linear interpolation, as ``torch.quantile``; in float32 like TRL, and compared in float32)::

    τ = quantile({H_t : t an action token of the micro-batch}, 1 − ρ)
    w_t = 1  if H_t ≥ τ,   else 0

``ρ = 1`` keeps every action token (τ is the minimum; TRL's default), ``ρ = 0`` only the tokens at the maximum; the
paper keeps the top 20 % (``ρ = 0.2``). ``w`` is a detached weight (``role="correction"``, token level): it multiplies
the update gate's objective exactly as TRL multiplies its per-token loss by ``entropy_mask``, so the reduction's
denominators still count every action token (TRL's too). The entropies are read without gradient.

The threshold is a statistic of the micro-batch, not of each response: splitting a batch into micro-batches changes
it (as in TRL). Under data parallelism the action entropies are pooled over the gate input's ``peers`` — the TRL
adapter passes every process, as TRL's ``get_high_entropy_mask`` gathers them before its quantile, so the threshold
is TRL's on any number of processes; without peers, the micro-batch's own.

No host synchronisation on one rank: on an accelerator the action entropies are sorted with every other position pushed to the
end (+inf) and the two order statistics are gathered at ranks computed on the device from the action-token count;
on the CPU they are selected (``lossplug.ops.quantiles_of``, bit for bit ``torch.quantile``). Pooled over several
ranks, the peers' entropies are gathered (one synchronisation, as TRL's ``pad_across_processes``) and selected.

Paper: Wang et al., 2025, *Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective Reinforcement Learning
for LLM Reasoning*, arXiv:2506.01939.

Reference: TRL ``GRPOTrainer.get_high_entropy_mask`` (``top_entropy_quantile``).
"""

from __future__ import annotations

from typing import cast

import torch
from pydantic import Field

import lossplug
from lossplug.ops import quantiles_of

Tensor = torch.Tensor


class TopEntropyParams(lossplug.Params):
    quantile: float = Field(
        1.0,
        ge=0,
        le=1,
        description="ρ: the fraction of action tokens kept, by entropy (TRL top_entropy_quantile; paper: 0.2; "
        "1.0 keeps every token)",
    )


def masked_quantile(values: Tensor, mask: Tensor, q: float) -> Tensor:
    """``torch.quantile(values[mask].float(), q)`` as a 0-d float32 tensor, without a host synchronisation.

    On the CPU the selected values' quantile (bit for bit ``torch.quantile``); elsewhere a sort of every position
    with the unselected ones pushed to the end (+inf), read at torch's ranks ``q·(n − 1)`` — computed on the device
    from the selected count ``n``, in float32 like ``torch.quantile`` — and interpolated with ``torch.lerp`` as
    ``torch.quantile`` does. With nothing selected the result is NaN (no
    value is ``≥`` it)."""
    if values.device.type == "cpu":
        return quantiles_of(torch.masked_select(values.detach(), mask), (q,))[0]
    return sorted_quantile(values, mask, q)


def sorted_quantile(values: Tensor, mask: Tensor, q: float) -> Tensor:
    """:func:`masked_quantile` by a sort of every position (the accelerator path; any device)."""
    flat = torch.where(mask, values.detach().float(), float("inf")).reshape(-1)
    ordered = flat.sort().values
    count = torch.count_nonzero(mask)
    # torch.quantile's ranks: q (float32) · (n − 1), floored at 0 (nothing selected), truncated and ceiled
    ranks = (torch.full((1,), q, dtype=torch.float32, device=flat.device) * (count - 1)).clamp(min=0)
    below = ranks.to(torch.long)
    above = ranks.ceil().to(torch.long)
    weights = ranks - below
    return torch.lerp(ordered.gather(0, below), ordered.gather(0, above), weights)[0]


def pooled_quantile(values: Tensor, q: float) -> Tensor:
    """``torch.quantile(values, q)`` of the gathered 1-D float32 ``values`` (its length is known on the host after
    the gather); NaN when empty — no value is ``≥`` it, as TRL keeps no token when no process has one."""
    if values.numel() == 0:
        return torch.full((), float("nan"), device=values.device)
    if values.device.type == "cpu":
        return quantiles_of(values, (q,))[0]
    return torch.quantile(values, q)


@lossplug.gate(
    "top_entropy", params=TopEntropyParams, requires=("entropy",), role="correction", level="token", pools=True
)
def top_entropy(inp: lossplug.GateInput, p: TopEntropyParams) -> lossplug.GateOutput:
    """Detached weight 1 on the action tokens whose entropy is ≥ the (1 − quantile)-quantile of the micro-batch's
    (pooled over ``inp.peers``), else 0.

    Paper: Wang et al., 2025, *Beyond the 80/20 Rule*, arXiv:2506.01939.

    Reference: TRL ``GRPOTrainer.get_high_entropy_mask``.
    """
    with torch.no_grad():
        entropy = cast(torch.Tensor, inp.entropy).detach()  # set: required
        if inp.peers.local:
            threshold = masked_quantile(entropy, inp.mask, 1 - p.quantile)
        else:  # every rank's action entropies, as the trainer pools them (TRL: all processes)
            threshold = pooled_quantile(
                inp.peers.gather(torch.masked_select(entropy, inp.mask).float()), 1 - p.quantile
            )
        # compared in float32, the quantile's dtype: the minimum is then always ≥ the 0-quantile (ρ = 1 keeps every
        # token). TRL compares in the entropies' dtype — the same for float32 or bf16 entropies; float64 ones would
        # be compared against their float32 rounding
        keep = (entropy.float() >= threshold) & inp.mask
        weight = keep.to(entropy.dtype)
    return lossplug.GateOutput(
        weight=weight,
        metrics={"keep_frac": lambda: inp.token_fraction(keep, false_off_actions=True)},
        details={"threshold": lambda: threshold},
        active=lambda: keep,
    )
