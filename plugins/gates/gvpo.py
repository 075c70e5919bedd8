"""GVPO (arXiv:2504.19599, jszkc/GVPO): J = −½((β·Σ_t log(π_θ/π_old) − mean_g) − (R − R̄_g))² / (n − 1) per response.

Paper: Zhang et al., 2025, *GVPO: Group Variance Policy Optimization for Large Language Model Post-Training*,
arXiv:2504.19599. Reference code re-derived from: github.com/jszkc/GVPO, ``GVPO/gvpo_core_algos.py``
``compute_policy_loss_gvpo`` and ``GVPO/gvpo_dp_actor.py`` (commit 627aa25e32acdaaa2c374946ccc703a7848ec8c1, on
verl 0.6.0).

With ``|y_i|`` the action tokens of response ``i``, ``g`` its prompt group of ``n`` rollouts (``group_id``) and
``A_it`` the advantage::

    r_i = β · Σ_t (logp_it − old_logp_it)                 implicit reward (sum over the response's action tokens)
    a_i = Σ_t A_it / |y_i|                                the centred reward R_i − R̄_g (the advantage's token mean)
    c_i = r_i − sg(mean_{j∈g} r_j)                        the centred implicit reward
    ℓ_i = ½ · (c_i − a_i)² / (n − 1)
    J_it = −ℓ_i                                           on every action token of response i (a sequence-level gate)

The MSE couples the rollouts of a group: ``c_i`` reads every rollout's current log-probs. What the paper leaves open
and this gate takes from the authors' code:

* the reference of the implicit reward is ``old_logp`` (π_θ', the policy before the update: the authors' objective
  is ``E[R] − β·KL[π_θ ‖ π_θ']``, their code reads ``old_log_prob``, i.e. ``logp.detach()`` on-policy, where
  ``r_i = 0`` and only its gradient ``β·Σ_t ∇logp_it`` remains); ``β`` defaults to their 0.1 (``gvpo_beta``);
* the centred reward is the advantage, not recomputed: their script runs verl's GRPO estimator with
  ``norm_adv_by_std_in_grpo=False`` (``R_i − R̄_g``) — here ``{name: grpo, scale: none}``; ``a_i`` is the advantage's
  mean over the response's action tokens (``[B]`` advantages are taken as they are);
* the group mean of ``r`` is detached (they all-gather a detached copy over the data-parallel ranks). With a centred
  advantage and every rollout of the group in the loss, Σ_{i∈g} (c_i − a_i) = 0, so the detached and the attached
  mean give the same gradient, and the value does not depend on it;
* ``1 / (n − 1)`` (their Bessel-like factor, ``n = rollout.n``).

**Whole groups only.** ``mean_g`` needs the current log-probs of every rollout of the group, which exist only for
the micro-batch being differentiated (pooled over ``inp.peers``: the ranks that run at the same time, as the
authors' all-gather). The authors reorder verl's batch so that each micro-step holds whole groups (``gvpo_ray_trainer
._balance_batch``, requiring ``world_size · ppo_micro_batch_size_per_gpu`` divisible by ``n``). Here: with
``group_size`` set, every group in the pool must hold exactly ``group_size`` rows, else the gate refuses (on the CPU
naming the group, its rows and the setting to change; on an accelerator through a device-side assert, without a host
synchronisation); with ``group_size: null`` each group's ``n`` is its rows in the pool
and a group split across micro-batches cannot be detected — set ``group_size`` in real runs. A group of one row is
refused either way (``1 / (n − 1)``).

**Reduction.** ``J_it = −ℓ_i`` is constant over the response, so the ``response`` reduction gives
``Σ_i ℓ_i / S`` (``S`` the step's responses): every response weighs the same, as the paper's Σ_i. The authors' verl
code sums ``ℓ_i`` over each micro-batch and verl divides by the gradient-accumulation steps and FSDP averages over
the ranks, i.e. ``ppo_micro_batch_size_per_gpu · Σ_i ℓ_i / S``: the same loss times a constant (a learning-rate
scale). Token-weighted reductions weigh ``ℓ_i`` by ``|y_i|`` (not the paper's).

Gradient: ∂J_it/∂logp_iu = −β·(c_i − a_i)/(n − 1) for each action token ``u`` of response ``i``. ``old_logp`` and the
advantage are constants (detached); gradient flows through ``logp`` only. No ratio is exponentiated: log-ratios of
±100 give finite values.

Examples:

>>> import torch, lossplug
>>> logp = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]], requires_grad=True)
>>> batch = lossplug.PolicyBatch(
...     logp=logp, old_logp=torch.full((2, 2), -1.5), action_mask=torch.ones(2, 2, dtype=torch.bool),
...     advantage=torch.tensor([0.5, -0.5]), group_id=torch.tensor([0, 0]))
>>> recipe = {"gates": [{"name": "gvpo", "beta": 0.1, "group_size": 2}], "reduction": "response"}
>>> round(lossplug.policy_loss(batch, recipe).loss.item(), 4)  # r = (0.1, −0.1), c = r, ℓ_i = ½(0.4)² / 1
0.08
"""

from __future__ import annotations

import torch
from pydantic import Field

import lossplug
from lossplug.ops import response_stats

from ._whole_groups import refuse_split_groups


class GVPOParams(lossplug.Params):
    beta: float = Field(0.1, gt=0, description="β of the implicit reward β·Σ_t log(π_θ/π_old) (the authors': 0.1)")
    group_size: int | None = Field(
        None,
        ge=2,
        description="rollouts per prompt (verl's rollout.n, TRL's num_generations): every group the gate sees must "
        "hold exactly this many rows, else it refuses; null: each group's rows in the micro-batch (a split group "
        "goes undetected)",
    )


def _refuse_split_groups(inp: lossplug.GateInput, pooled_ids: torch.Tensor, p: GVPOParams) -> None:
    """Refuse a pooled group that is not whole: a named error on the CPU; on an accelerator a device-side assert
    (no host synchronisation). Every peer checks the whole pool, so all of them refuse alike."""
    expected = p.group_size
    pooled_counts = (pooled_ids.unsqueeze(-1) == pooled_ids.unsqueeze(0)).sum(-1)  # [P]: each pooled row's group size
    bad = pooled_counts != expected if expected is not None else pooled_counts < 2

    def describe() -> str:
        row = int(bad.nonzero()[:, 0][pooled_ids[bad].argmin()])  # the smallest group id that is not whole
        want = f"exactly group_size={expected}" if expected is not None else "at least 2 (1 / (n − 1))"
        return (
            f"gate 'gvpo': group_id {int(pooled_ids[row])} has {int(pooled_counts[row])} row(s) in this micro-batch"
            f"{' (pooled over its peers)' if not inp.peers.local else ''}, GVPO needs {want}: its centred implicit "
            "reward reads the current log-probs of every rollout of the group, so each micro-batch must hold whole "
            "groups (TRL: steps_per_generation=1 with per_device_train_batch_size a multiple of num_generations; "
            "the authors' verl: _balance_batch with world_size·ppo_micro_batch_size_per_gpu divisible by rollout.n)"
        )

    refuse_split_groups(bad, "gvpo", describe)


def _group_statistics(inp: lossplug.GateInput, implicit: torch.Tensor, p: GVPOParams) -> tuple[torch.Tensor, ...]:
    """Per row: the detached mean of the implicit reward over its group and the group's size ``n``, pooled over
    ``inp.peers`` (every peer gathers unconditionally); refuses a group that is not whole.

    Groups are matched by comparing ids (``[B, P]``), not by ``torch.unique``: no data-dependent shape, so no host
    synchronisation on an accelerator."""
    group_id = inp.batch.group_id
    assert group_id is not None  # required
    pooled_ids = inp.peers.gather(group_id)
    pooled_values = inp.peers.gather(implicit.detach())
    _refuse_split_groups(inp, pooled_ids, p)
    same = group_id.unsqueeze(-1) == pooled_ids.unsqueeze(0)  # [B, P]: the pooled rows of each own row's group
    counts = same.sum(-1)  # ≥ 1: a row is in its own group
    sums = torch.where(same, pooled_values.unsqueeze(0), 0).sum(-1)
    mean = sums / counts.to(sums.dtype)
    n = counts.to(implicit.dtype) if p.group_size is None else torch.full_like(implicit, float(p.group_size))
    return mean.to(implicit.dtype), n


@lossplug.gate("gvpo", params=GVPOParams, requires=("old_logp", "group_id"), level="sequence", pools=True)
def gvpo(inp: lossplug.GateInput, p: GVPOParams) -> lossplug.GateOutput:
    """GVPO: −½((β·Σ_t log r_t − mean_group) − (R − R̄))² / (n − 1) per response, on each of its action tokens."""
    implicit = p.beta * inp.update_log_ratio().sum(-1)  # [B], carries the gradient of logp
    if inp.seq_advantage is not None:
        centred_reward = inp.seq_advantage
    else:
        centred_reward = inp.advantage.sum(-1) / inp.lengths.clamp(min=1).to(inp.advantage.dtype)
    group_mean, n = _group_statistics(inp, implicit, p)
    error = (implicit - group_mean) - centred_reward
    per_response = 0.5 * error.square() / (n - 1)
    return lossplug.GateOutput(
        objective=(-per_response).unsqueeze(-1).expand(inp.mask.shape),
        details={
            **response_stats("centred_implicit_reward", (implicit - group_mean).detach(), inp.lengths > 0),
            **response_stats("squared_error", per_response.detach(), inp.lengths > 0),
        },
        active=lambda: inp.lengths > 0,  # it never cuts: every response with an action token carries gradient
    )
