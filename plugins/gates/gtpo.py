"""GTPO: ``J_it = [H̄_i ≤ τ]·(A_i − s·H̄_i) · δ_it / n_i · exp(logp − logp^detach)`` — conflict tokens of a prompt
group protected (negative completions) or amplified (positive ones), high-entropy completions filtered out
(Simoni et al., arXiv:2508.03772; code: github.com/winstonsmith1897/GTPO ``gtpo/gtpo_training.py``, commit
5d33811e8ea1cf76c665db65b247cef9d1e436dd).

Per prompt group (``group_id``), with ``A_i`` the response's advantage (the authors: ``r_i − mean_group r``, no std),
``v_ik`` the ``k``-th sampled token of response ``i`` (``token_ids`` on its action tokens) and ``L_i`` its number of
action tokens, the authors' ``build_conflict_mask`` and ``UnslothEfficientGTPO.forward`` compute:

* **Conflict tokens.** Among the responses with ``A ≠ 0`` (the others take no part), ``(k, v)`` is a conflict
  when a response with ``A > 0`` and one with ``A < 0`` both sampled ``v`` as their ``k``-th token. Only the
  **leading run** counts (``cumprod`` along ``k``: positions ``0..k`` all conflicts), and the same from the end —
  the ``k``-th token from the last, ``v_i,L_i−1−k`` — for the **trailing run**.
* **Weights.** ``δ_fwd = 1`` off the leading run; on it ``w`` (``conflict_weight``, the code's ``W_RAW`` = 2) for a
  positive response and 0 for a negative one; ``δ_rev`` the same on the trailing run; ``δ = δ_fwd · δ_rev`` (``w²``
  on a token in both runs of a positive response). A response with ``A = 0`` keeps ``δ = 1``.
* **Per-response divisor.** ``n_i = max(1, a_i, b_i)`` with ``a_i``, ``b_i`` the lengths of the leading and the
  trailing run (1 when ``A_i = 0``). The code counts ``(conflict_fwd | conflict_rev) & mask`` with ``conflict_rev``
  still in its reversed coordinates (the ``k``-th token from the last at column ``k``): two runs that both start at
  column 0, whose union is the longer one. This follows the code; the tokens in either run, aligned
  (``conflict_frac``), are ``a_i + b_i`` minus their overlap.
* **Entropy control.** ``H̄_i`` = the mean over its action tokens of the current policy's per-token entropy (read
  without gradient); a response with ``H̄_i > τ`` (``entropy_threshold``, ``ENT_THRESHOLD`` = 0.7) gets advantage 0,
  the others ``A_i − s·H̄_i`` (``entropy_scale``, ``ENT_SCALE`` = 0.1) — zero-advantage responses included.
* **Objective.** ``exp(logp − logp^detach)`` has value 1 and gradient ``∇logp`` (the code's ``ratio``: no
  ``old_logp``, no clip — on-policy, as its ``num_iterations: 1``), times the detached coefficient
  ``Ã_i·δ_it/n_i``. The code's per-response loss is ``−Σ_t ratio·Ã_i·δ_it / L_i / n_i`` (its ``n_tok``, then
  ``n_conflict``): the recipe's ``response`` reduction gives exactly that per response. The code **sums** the
  responses of its batch (``acc_loss.add_`` per completion) where ``response`` takes their mean: a constant factor,
  the number of responses in the step (8 in the authors' config), i.e. the same update at an 8× smaller learning
  rate.

This follows the code. The paper's objective (as the repository's README writes it) is
``1/G Σ_i δ_i·(A_i − γ·⟨H⟩_i)/|o_i| · Σ_t r_it·λ_it``: the same conflict weights ``λ`` and shaping ``A − γ·H̄``, and
the ``response`` reduction's ``1/G``; but its filter ``δ_i`` cuts at ``ln 2`` and only when the policy's initial
entropy was below ``ln 2`` (set ``entropy_threshold: 0.6931`` for the cut, a threshold above any entropy for a
policy that started above it), and it has neither the code's ``1/n_i`` nor its sum over responses.

Three readings of the code:

* The code's advantage is one number per completion. A per-token advantage (verl broadcasts GRPO's over the
  response) is read per token in ``A − s·H̄``, and a response is positive or negative by the sign of its mean over
  the actions: the code's ``A_i`` wherever the advantage is constant along the response.
* Positions are counted over each response's action tokens (``k``-th action token, ``k``-th from the last): for
  TRL's and verl's right-padded responses that is the code's column index and its right-aligned reverse; the code
  tells real tokens from padding by ``ids ≠ PAD_ID`` where this reads the action mask (the same wherever the pad id
  is never sampled, as in the authors' Llama-3.1 runs: pad ``128004``).
* ``H̄_i`` is read from the batch's ``entropy`` (the exact entropy of the policy's distribution, TRL's
  ``_get_per_token_logps_and_entropies``); the code computes ``−Σ p·log max(p, 1e-6)``, which differs only by the
  probabilities below ``1e-6`` (at most ``Σ_{p<1e-6} p·log(1e-6/p)`` per token).

The conflicts compare the responses of a whole prompt group, so the gate must see whole groups: ``group_size`` (the
trainer's number of generations) makes it refuse a micro-batch holding part of a group; without it, the groups it
is given are taken as whole. In TRL that means one micro-batch per generation batch on one process
(``steps_per_generation=1``, ``per_device_train_batch_size`` a multiple of ``num_generations``). verl's policy-loss
seam receives no entropies, token ids or prompt groups, and its adapter refuses the gate.

Paper: Simoni et al., 2025, *GTPO: Stabilizing Group Relative Policy Optimization via Gradient and Entropy
Control* (first titled *GTPO: Trajectory-Based Policy Optimization in Large Language Models*), arXiv:2508.03772.

Reference: winstonsmith1897/GTPO, commit 5d33811e8ea1cf76c665db65b247cef9d1e436dd, ``gtpo/gtpo_training.py``:
``build_conflict_mask``, ``gtpo_compute_loss``, ``UnslothEfficientGTPO.forward``; ``config.yaml``'s
``gtpo_runtime`` (``ent_threshold: 0.7``, ``ent_scale: 0.1``, ``w_raw: 2.0``).

Two responses of one group, a positive (``A = 1``) and a negative (``A = −1``), share their first two tokens (7, 8)
and their last (5): a leading run of 2 and a trailing run of 1, so ``n = max(2, 1) = 2``. The positive response's
shared tokens weigh ``w = 2``, the negative's 0; both have mean entropy 0.5 ≤ 0.7, so ``Ã = A − 0.05``:

>>> import torch, lossplug
>>> batch = lossplug.PolicyBatch(
...     logp=torch.full((2, 4), -1.0, dtype=torch.float64), action_mask=torch.ones(2, 4, dtype=torch.bool),
...     advantage=torch.tensor([1.0, -1.0], dtype=torch.float64), group_id=torch.tensor([0, 0]),
...     token_ids=torch.tensor([[7, 8, 1, 5], [7, 8, 2, 5]]), entropy=torch.full((2, 4), 0.5, dtype=torch.float64))
>>> plugin = lossplug.registry().plugins["gate"]["gtpo"]
>>> out = plugin(lossplug.GateInput.from_batch(batch), plugin.params())
>>> [[round(v, 4) for v in row] for row in out.objective.tolist()]     # 0.95·δ/2, −1.05·δ/2
[[0.95, 0.95, 0.475, 0.95], [-0.0, -0.0, -0.525, -0.0]]
"""

from __future__ import annotations

from typing import cast

import torch
from pydantic import Field

import lossplug
from lossplug.contracts import LossplugError

Tensor = torch.Tensor


class GTPOParams(lossplug.Params):
    conflict_weight: float = Field(
        2.0,
        ge=0,
        allow_inf_nan=False,
        description="w: the weight of a positive response's conflict token, per run (the code's W_RAW: 2.0)",
    )
    entropy_threshold: float = Field(
        0.7,
        ge=0,
        allow_inf_nan=False,
        description="τ: a response whose mean token entropy exceeds it gets advantage 0 (ENT_THRESHOLD: 0.7)",
    )
    entropy_scale: float = Field(
        0.1,
        ge=0,
        allow_inf_nan=False,
        description="s: the advantage of a kept response becomes A − s·(its mean entropy) (ENT_SCALE: 0.1)",
    )
    group_size: int | None = Field(
        None,
        ge=1,
        description="the responses per prompt group (the trainer's num_generations): a micro-batch holding part "
        "of a group is refused; null: the groups given are taken as whole",
    )


def compact(values: Tensor, mask: Tensor, lengths: Tensor, *, reverse: bool) -> tuple[Tensor, Tensor]:
    """Each row's action-token values packed to the left, ``[B, T]`` (the ``k``-th action token at ``k``; from the
    last one when ``reverse``), with the columns they came from (``cols``, meaningful where ``k < L_i``)."""
    cols = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices  # action columns first, in order
    if reverse:  # the actions last-first, then the other columns as before: still a permutation of each row
        k = torch.arange(mask.shape[-1], device=mask.device)
        backwards = cols.gather(-1, (lengths[:, None] - 1 - k).clamp(min=0))
        cols = torch.where(k < lengths[:, None], backwards, cols)
    return values.gather(-1, cols), cols


def leading_conflict_run(ids: Tensor, valid: Tensor, group: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
    """``[B, T]`` bool, in packed coordinates: ``(k, ids_ik)`` was sampled at ``k`` by a positive and by a negative
    response of the row's group, at every ``k' ≤ k`` of the row (the code's ``cumprod``), for rows with ``A ≠ 0``."""
    shared = (ids[:, None, :] == ids[None, :, :]) & valid[None, :, :] & group[:, :, None]  # [i, j, k]
    by_positive = (shared & pos[None, :, None]).any(1)
    by_negative = (shared & neg[None, :, None]).any(1)
    raw = by_positive & by_negative & valid & (pos | neg)[:, None]
    return torch.cumprod(raw.to(torch.int8), dim=-1).bool() & valid


def _check_whole_groups(group_id: Tensor, group_size: int) -> None:
    counts = (group_id[:, None] == group_id[None, :]).sum(-1)
    partial = counts != group_size
    if bool(partial.any()):
        row = int(partial.nonzero()[0])
        raise LossplugError(
            f"gate 'gtpo': group_id must give whole prompt groups of group_size={group_size} (its conflict tokens "
            f"compare every response of a group); group {int(group_id[row])} has {int(counts[row])} rows in this "
            f"micro-batch (first at row {row}). Next step: give the loss whole groups (TRL: steps_per_generation=1 "
            "on one process, per_device_train_batch_size a multiple of num_generations)"
        )


@lossplug.gate("gtpo", params=GTPOParams, requires=("entropy", "group_id", "token_ids"))
def gtpo(inp: lossplug.GateInput, p: GTPOParams) -> lossplug.GateOutput:
    """GTPO's objective: conflict tokens weighted (``w`` / 0) and counted (``1/n_i``), high-entropy responses
    filtered, ``A − s·H̄`` on the others; value ``Ã·δ/n``, gradient through ``logp`` only.

    Paper: Simoni et al., 2025, *GTPO*, arXiv:2508.03772.

    Reference: winstonsmith1897/GTPO ``gtpo/gtpo_training.py`` (commit 5d33811).
    """
    batch = inp.batch
    mask, lengths = inp.mask, inp.lengths
    group_id = cast(Tensor, batch.group_id)  # required
    if p.group_size is not None:
        _check_whole_groups(group_id, p.group_size)
    with torch.no_grad():
        # a response is positive or negative by its advantage (a per-token one: by its mean over the actions)
        adv = inp.broadcast_advantage()  # [B, 1] or [B, T]
        sign = inp.seq_advantage if inp.seq_advantage is not None else inp.sequence_mean(adv)
        pos, neg = sign > 0, sign < 0
        group = group_id[:, None] == group_id[None, :]
        token_ids = cast(Tensor, batch.token_ids).to(mask.device)
        valid = torch.arange(mask.shape[-1], device=mask.device) < lengths[:, None]  # packed: k < L_i
        on_run = torch.where(pos, p.conflict_weight, 0.0).to(inp.compute_dtype)[:, None]  # w (A > 0), 0 (A < 0)
        delta = torch.ones(mask.shape, dtype=inp.compute_dtype, device=mask.device)
        conflict = torch.zeros_like(mask)
        run_lengths = []
        for reverse in (False, True):
            ids, cols = compact(token_ids, mask, lengths, reverse=reverse)
            packed = leading_conflict_run(ids, valid, group, pos, neg)
            run_lengths.append(packed.sum(-1))
            # back to the row's columns: the packed k-th token sits at column cols[:, k] (scatter only the valid k)
            run = torch.zeros_like(mask).scatter_(-1, cols, packed) & mask
            conflict |= run
            delta = delta * torch.where(run, on_run, 1.0)
        # the code's n_conflict: its two runs OR-ed in their own coordinates, both from column 0 — the longer one
        n_conflict = torch.maximum(*run_lengths).clamp(min=1).to(delta.dtype)
        entropy = cast(Tensor, inp.entropy).detach()  # required; zero off the actions
        mean_entropy = entropy.sum(-1) / lengths.clamp(min=1)
        kept = mean_entropy <= p.entropy_threshold
        shaped = torch.where(kept[:, None], adv - p.entropy_scale * mean_entropy[:, None], 0.0)
        coefficient = inp.on_actions(shaped * delta / n_conflict[:, None])
    ratio = torch.exp(inp.logp - inp.logp.detach())  # value 1, gradient ∇logp (the code's ``ratio``)
    return lossplug.GateOutput(
        objective=coefficient * ratio,
        metrics={
            "conflict_frac": lambda: inp.token_fraction(conflict, false_off_actions=True),
            "entropy_filtered_frac": lambda: inp.response_fraction(~kept),
        },
        details={"mean_entropy": lambda: inp.sequence_mean(entropy).mean()},
        active=lambda: (coefficient != 0) & mask,
    )
