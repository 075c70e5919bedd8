"""TPO, L_g = −Σ_{i∈g} q_i·log softmax_g(ℓ)_i with the target q ∝ p_old·exp(u/η): fit the group's policy to a tilted
target by cross-entropy (Kaddour, 2026, *Target Policy Optimization*, arXiv:2604.06159); re-derived from the
author's code (github.com/JeanKaddour/tpo, ``src/tpo/algorithms.py`` ``tpo_target`` / ``anchored_tpo_cross_entropy_loss``
and ``paper_for_agents/tpo_for_agents.md`` §2, commit 73473b9e5d40abc15c218bbb0225747fda8ce4a9).

For a prompt group ``g`` of ``K`` rollouts (``group_id``), with ``ℓ_i = Σ_t logp_it`` the current log-probability of
response ``i`` (its action tokens), ``ℓ_i^old = Σ_t old_logp_it`` and ``u_i`` its standardised score (the
advantage)::

    p_i = softmax_g(ℓ)_i                                the current policy over the sampled group (Eq. 1)
    q_i = softmax_g(ℓ^old + u/η)_i  = p_i^old·e^{u_i/η} / Σ_j p_j^old·e^{u_j/η}      the target (Eq. 2), frozen
    L_g = −Σ_i q_i·log p_i                              (Eq. 3)          ∂L_g/∂ℓ_i = p_i − q_i

The gradient vanishes once the policy matches the target; on the rollout snapshot a group of equal scores (``u = 0``)
has ``q = p^old`` and contributes nothing. On later epochs (``num_iterations > 1``) ``q`` stays frozen and ``p`` is
recomputed, as the paper's Algorithm 1.

**The score ``u``.** The gate reads it from the advantage (a ``[B]`` advantage as it is, a ``[B, T]`` one as its mean
over the response's action tokens). The paper standardises the raw scores within the group with the *population*
std and maps a zero-variance group to ``u = 0`` (its Appendix A): in lossplug that is the advantage
``{name: grpo, std: population, eps: 1e-6, eps_mode: threshold}`` (the author's ``tpo_skill`` keeps the centred
scores, all ``≤ 1e-6``, where ``std ≤ 1e-6``; the paper and this advantage give 0 — the same target up to
``e^{1e-6}``). ``η`` (``eta``) defaults to the paper's 1.

**Per token, and the reduction.** A sequence-level gate: every action token of response ``i`` carries ::

    J_i = K·(q_i·(ℓ_i − sg(LSE_g ℓ)) − sg(p_i)·(ℓ_i − sg(ℓ_i)))      value K·q_i·log p_i,  ∂J_i/∂ℓ_i = K·(q_i − p_i)

(``sg``: detached). With the ``response`` reduction the loss is ``−Σ_i J_i / S`` over the step's ``S = G·K``
responses, i.e. the paper's ``mean_g L_g`` (its ``-(q * log_p).sum(-1).mean()``), value and gradient. The group's
log-sum-exp and ``p`` enter detached, so the value and the gradient need only detached group statistics: pooled over
``inp.peers`` (the ranks that run at the same time), a group may be spread over them. Token-weighted reductions
weigh ``J_i`` by the response's length (not the paper's).

**Whole groups only.** ``softmax_g`` reads the log-probs of every rollout of the group, which exist only for the
micro-batch being differentiated (pooled over its peers). With ``group_size`` set every group the gate sees must hold
exactly that many rows with an action token, else it refuses (on the CPU with the group, its rows and the setting to
change; on an accelerator through a device-side assert, without a host synchronisation); with ``group_size: null``
each group's ``K`` is its rows there and a group split across micro-batches is not detected — set ``group_size`` in
real runs. TRL holds whole groups with ``steps_per_generation=1`` and ``per_device_train_batch_size`` a multiple of
``num_generations``; verl's ``ppo_loss`` hands a policy loss no prompt ids, so its seam refuses the gate (the paper's
LLM runs used verl, its Appendix G; that code is not in the author's public repository). ``old_logp`` and the advantage are constants;
gradient flows through ``logp`` only. No ratio is exponentiated and the group's softmax is a log-sum-exp: response
log-probs in the thousands stay finite.

>>> import torch, lossplug
>>> logp = torch.log(torch.tensor([[0.5], [0.5]])).requires_grad_()          # one group of two, p = (½, ½)
>>> batch = lossplug.PolicyBatch(logp=logp, old_logp=logp.detach().clone(), advantage=torch.tensor([1.0, -1.0]),
...                              group_id=torch.tensor([0, 0]), action_mask=torch.ones(2, 1, dtype=torch.bool))
>>> result = lossplug.policy_loss(batch, {"gates": [{"name": "tpo", "group_size": 2}], "reduction": "response"})
>>> q = torch.softmax(torch.tensor([1.0, -1.0]), 0)                           # p_old·e^u, normalised
>>> bool(torch.isclose(result.loss, -(q * torch.log(torch.tensor([0.5, 0.5]))).sum()))   # L = −Σ q·log p
True
>>> result.loss.backward()
>>> bool(torch.allclose(logp.grad[:, 0], 0.5 - q))                             # (p − q) / G, G = 1 group
True

Paper: Kaddour, 2026, *Target Policy Optimization*, arXiv:2604.06159.

Reference: JeanKaddour/tpo (commit 73473b9e5d40abc15c218bbb0225747fda8ce4a9) ``src/tpo/algorithms.py``
(``tpo_target``, ``anchored_tpo_cross_entropy_loss``).
"""

from __future__ import annotations

import torch
from pydantic import Field

import lossplug
from lossplug.ops import response_stats

from ._whole_groups import refuse_split_groups


class TPOParams(lossplug.Params):
    eta: float = Field(1.0, gt=0, description="temperature η of the target q ∝ p_old·exp(u/η) (the paper's 1)")
    group_size: int | None = Field(
        None,
        ge=2,
        description="rollouts per prompt (verl's rollout.n, TRL's num_generations): every group the gate sees must "
        "hold exactly this many rows with an action token, else it refuses; null: each group's rows in the "
        "micro-batch (a split group goes undetected)",
    )


def _group_log_sum_exp(same: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """Per own row: log Σ_j exp(pooled_j) over the pooled rows ``j`` of its group (``same`` ``[B, P]``)."""
    return torch.where(same, pooled.unsqueeze(0), float("-inf")).logsumexp(-1)


def _check_whole_groups(inp: lossplug.GateInput, counts: torch.Tensor, valid: torch.Tensor, p: TPOParams) -> None:
    expected = p.group_size
    bad = valid & ((counts != expected) if expected is not None else (counts < 1))

    def describe() -> str:
        row = int(bad.nonzero()[0, 0])
        group_id = inp.batch.group_id
        assert group_id is not None  # required
        return (
            f"gate 'tpo': group_id {int(group_id[row])} has {int(counts[row])} row(s) with an action token in this "
            f"micro-batch{' (pooled over its peers)' if not inp.peers.local else ''}, TPO needs exactly "
            f"group_size={expected}: its softmax over the group reads the current log-probs of every rollout of "
            "the group, so each micro-batch must hold whole groups (TRL: steps_per_generation=1 with "
            "per_device_train_batch_size a multiple of num_generations)"
        )

    refuse_split_groups(bad, "tpo", describe)


@lossplug.gate("tpo", params=TPOParams, requires=("old_logp", "group_id"), level="sequence", pools=True)
def tpo(inp: lossplug.GateInput, p: TPOParams) -> lossplug.GateOutput:
    """TPO: the cross-entropy −Σ q·log softmax_group(Σ_t logp) to the target q ∝ p_old·exp(u/η), per response."""
    group_id = inp.batch.group_id
    assert group_id is not None  # required
    seq_logp = inp.logp.sum(-1)  # ℓ_i, [B], carries the gradient
    seq_old = inp.old_logp.sum(-1) if inp.old_logp is not None else seq_logp.detach()
    if inp.seq_advantage is not None:
        score = inp.seq_advantage
    else:
        score = inp.advantage.sum(-1) / inp.lengths.clamp(min=1).to(inp.advantage.dtype)
    valid = inp.lengths > 0  # a row with no action token is no candidate of its group

    # every peer gathers unconditionally (a rank with nothing still joins the collective)
    pooled_ids = inp.peers.gather(group_id)
    pooled_valid = inp.peers.gather(valid.to(seq_logp.dtype)) > 0  # (a float: every backend gathers it)
    pooled_logp = inp.peers.gather(seq_logp.detach())
    pooled_tilted = inp.peers.gather((seq_old + score / p.eta).detach())
    same = (group_id.unsqueeze(-1) == pooled_ids.unsqueeze(0)) & pooled_valid.unsqueeze(0)  # [B, P]
    counts = same.sum(-1)
    _check_whole_groups(inp, counts, valid, p)

    tilted = (seq_old + score / p.eta).detach()
    log_q = tilted - _group_log_sum_exp(same, pooled_tilted)  # Eq. 2 in log space: p_old·e^{u/η}, normalised
    lse = _group_log_sum_exp(same, pooled_logp)
    log_p = seq_logp.detach() - lse
    q, policy = log_q.exp(), log_p.exp()
    k = counts.to(seq_logp.dtype) if p.group_size is None else torch.full_like(seq_logp, float(p.group_size))
    # value K·q·(ℓ − LSE) = K·q·log p; gradient K·(q − p) on ℓ (the second term is 0 in value)
    per_response = k * (q * (seq_logp - lse) - policy * (seq_logp - seq_logp.detach()))
    per_response = torch.where(valid, per_response, 0.0)
    return lossplug.GateOutput(
        objective=per_response.unsqueeze(-1).expand(inp.mask.shape),
        details={
            **response_stats("target_prob", q, valid),
            **response_stats("policy_prob", policy, valid),
        },
        active=lambda: valid,  # it never cuts: every response with an action token carries gradient
    )
