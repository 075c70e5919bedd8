"""REINFORCE++ and REINFORCE++-baseline (verl's ``reinforce_plus_plus`` and ``reinforce_plus_plus_baseline``).

REINFORCE++ (token level, no critic, no group)::

    G_t = r_t + γ · G_{t+1}          over the response's action tokens (G = 0 after its last one)
    A_t = whiten(G)_t                whitened over every action token of the batch (verl's masked_whiten)

The discount advances once per **action token**: observation/tool tokens inside a multi-turn response
(``action_mask`` False) are skipped, their return carried through unchanged (verl 0.9.1 does the same). Rewards are
read on action positions only: a ``[B]`` score sits on the last action token, a ``[B, T]`` token reward is read
where ``action_mask`` is True. ``returns`` are the un-whitened ``G`` (verl's second output).

REINFORCE++-baseline (outcome level)::

    A_i = whiten(R_i − mean_g(R))    the centred score of each response, broadcast over its action tokens and
                                      whitened over every action token of the batch; a group of one keeps R_i
                                      (verl: its mean is 0); no γ

Both return advantages that carry no gradient; REINFORCE++-baseline's are ``[B]`` (one value per response).

REINFORCE++-baseline with the KL in the advantage (``kl_coef`` β > 0; NeMo-RL's ``use_kl_in_reward``)::

    δ_t = clamp(ref_logp_t − old_logp_t, ± kl_input_clamp)
    k_t = clamp(k(δ_t), ± kl_output_clamp)        k1 = −δ, k2 = δ²/2, k3 = exp(δ) − 1 − δ  (kl_estimator)
    A_t = whiten(R_i − mean_g(R) − β · k_t)       over every action token of the batch; ``[B, T]``

Each token's own β·k_t is subtracted — no sum over the later tokens, so ``kl_in_reward`` (whose KL rewards a
return-to-go would sum) followed by this estimator is another one. ``old_logp`` is the training engine's log-prob
before the update (NeMo-RL passes ``prev_logprobs``), ``ref_logp`` the reference's; both are then required. It is an
option of this estimator, not a plugin of its own, because with β = 0 it is this estimator exactly (the KL term
vanishes, and the ``[B]`` result is returned as before). NeMo-RL's β is ``reference_policy_kl_penalty`` (0.01 there),
its estimator ``reference_policy_kl_type`` (k3), its clamps ``kl_input_clamp_value``/``kl_output_clamp_value`` (20/10;
NeMo-RL's estimator calls ``calculate_kl`` with these defaults, whatever the loss's own clamps) — the defaults here
except β (0: off). NeMo-RL turns the loss's KL term off when it is in the advantage (recipe: no ``kl`` regularizer).

``variance: biased`` whitens as NeMo-RL: ``μ = Σ x·mask / Σ mask``, ``σ² = Σ (x − μ)²·mask / Σ mask`` (÷N),
``whiten(x) = (x − μ) · rsqrt(max(σ², 1e-8))``; ``unbiased`` (default) is verl's ``masked_whiten`` (÷(N − 1), ε
added). Two differences from NeMo-RL remain: a group of one keeps ``R_i`` here (verl's convention; NeMo-RL's
``calculate_baseline_and_std_per_prompt`` makes its baseline ``R_i``, so ``R_i − mean = 0``), and the advantage is 0
off the action tokens (NeMo-RL leaves the whitened ``−μ·rsqrt`` there, which its loss masks out).

Examples (β = 0.5, no whitening: the first response's second token loses β·k3(−1) = β·e⁻¹):

>>> import torch, lossplug
>>> batch = lossplug.PolicyBatch(
...     logp=torch.zeros(2, 2), action_mask=torch.tensor([[True, True], [True, False]]),
...     reward=torch.tensor([1.0, 0.0]), group_id=torch.tensor([0, 0]),
...     old_logp=torch.tensor([[-1.0, -1.0], [-1.0, 0.0]]), ref_logp=torch.tensor([[-1.0, -2.0], [-1.0, 0.0]]))
>>> advantage = {"name": "reinforce_plus_plus_baseline", "kl_coef": 0.5, "whiten": False}
>>> lossplug.estimate_advantages(batch, {"advantage": advantage, "gates": ["ppo_clip"], "reduction": "token"}).advantage
tensor([[ 0.5000,  0.3161],
        [-0.5000,  0.0000]])

``whiten`` (both; default ``true``, verl's): ``center`` subtracts the same token-weighted batch mean and does not
divide — OpenRLHF 0.11.2's ``--algo.advantage.no_std_norm`` for its ``reinforce`` (REINFORCE++) and
``reinforce_baseline`` estimators (``openrlhf/trainer/ppo_utils/experience_maker.py``,
``compute_advantages_and_returns``: ``A − Σ A·mask / Σ mask`` over every action token of the rollout batch, the mean
in float32 there, in the advantages' dtype here); ``false`` leaves ``G`` (or ``R_i − mean_g(R)``) as is. As
``gae``'s, the statistics are over the batch given (the trainers' seams hold the whole rollout batch; nothing is
all-reduced).

Paper: Hu, 2025, *REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models*,
arXiv:2501.03262.

Reference: verl 0.9.1 ``compute_reinforce_plus_plus_outcome_advantage`` and
``compute_reinforce_plus_plus_baseline_outcome_advantage`` (``verl/trainer/ppo/core_algos.py``); the KL option and
``variance: biased``: NeMo-RL (NVIDIA-NeMo/RL, commit 7ea279abfbeb698b092856d0dab61e7cf39bc909)
``nemo_rl/algorithms/advantage_estimator.py`` ``ReinforcePlusPlusAdvantageEstimator.compute_advantage``
(``minus_baseline``, ``use_kl_in_reward``; called from ``nemo_rl/algorithms/grpo.py`` with ``logprobs_policy =
prev_logprobs``, ``logprobs_reference = reference_policy_logprobs``) and ``nemo_rl/algorithms/utils.py``
``calculate_kl``.
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.ops import Groups

from ._verl_statistics import (
    at_least_float32,
    center_rows,
    constant_group,
    group_mean_or_zero,
    masked_center,
    masked_whiten,
    whiten_rows,
)
from .gae import Whiten, reverse_linear_scan
from .group_relative import sequence_scores

Tensor = torch.Tensor


def discounted_returns(batch: lossplug.PolicyBatch, gamma: float) -> Tensor:
    """``G_t = r_t + γ·G_{t+1}`` over each row's action tokens, ``[B, T]``, zero off them (no Python loop over t).

    The action tokens of all rows are packed into one vector (row-major) and the recurrence is solved by
    :func:`~lossplug.plugins.advantages.gae.reverse_linear_scan` with coefficient 0 after each row's last action.
    """
    mask = batch.action_mask
    reward = cast(Tensor, batch.reward)  # required
    dtype = torch.promote_types(reward.dtype, torch.float32)  # at least float32, as gae: bf16 sums drift
    lengths = mask.sum(-1)
    ends = torch.cumsum(lengths, 0) - 1  # packed index of each row's last action token
    nonempty = lengths > 0  # all rows under the contract; validate="off" may pass empty rows
    if not bool(nonempty.all()):
        ends = ends[nonempty]
    n = int(lengths.sum())
    if reward.ndim == 1:
        packed = torch.zeros(n, dtype=dtype, device=mask.device)
        packed[ends] = reward.to(dtype) if ends.shape[0] == reward.shape[0] else reward.to(dtype)[nonempty]
    else:
        packed = torch.masked_select(reward, mask).to(dtype)
    coef = torch.full((n,), gamma, dtype=dtype, device=mask.device)
    coef[ends] = 0
    returns = reverse_linear_scan(packed, coef)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_scatter_(mask, returns)


WHITEN_DESCRIPTION = (
    "true: whiten over all action tokens (verl); center: subtract their mean only (OpenRLHF's no_std_norm); "
    "false: neither"
)


class ReinforcePlusPlusParams(lossplug.Params):
    gamma: float = Field(1.0, ge=0, le=1, description="discount per action token (verl: algorithm.gamma, 1.0)")
    whiten: Whiten = Field(True, description=WHITEN_DESCRIPTION)


class ReinforcePlusPlusBaselineParams(lossplug.Params):
    whiten: Whiten = Field(True, description=WHITEN_DESCRIPTION)
    variance: Literal["unbiased", "biased"] = Field(
        "unbiased",
        description="whiten's variance: unbiased (verl's masked_whiten, ÷(N−1), +1e-8) or biased (NeMo-RL's "
        "Reinforce++: ÷N, clamped at 1e-8)",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="β of each token's own KL subtracted before whitening (NeMo-RL's use_kl_in_reward with "
        "reference_policy_kl_penalty); 0: none. > 0 requires old_logp and ref_logp",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="Schulman's estimator of the KL (reference_policy_kl_type)"
    )
    kl_input_clamp: float | None = Field(20.0, gt=0, description="clamp of ref_logp − old_logp (null: none)")
    kl_output_clamp: float | None = Field(10.0, gt=0, description="clamp of the estimate (null: none)")

    @model_validator(mode="after")
    def _variance_needs_whitening(self) -> ReinforcePlusPlusBaselineParams:
        if self.variance == "biased" and self.whiten is not True:
            raise ValueError(f"variance: biased is the variance of whiten: true; whiten is {self.whiten!r}")
        return self


def _baseline_requires(p: ReinforcePlusPlusBaselineParams) -> tuple[str, ...]:
    return ("reward", "group_id", "old_logp", "ref_logp") if p.kl_coef > 0 else ("reward", "group_id")


def reference_kl(batch: lossplug.PolicyBatch, p: ReinforcePlusPlusBaselineParams, dtype: torch.dtype) -> Tensor:
    """NeMo-RL's ``calculate_kl(old_logp, ref_logp)`` ``[B, T]`` on the action tokens, 0 elsewhere (detached)."""
    old, ref = cast(Tensor, batch.old_logp), cast(Tensor, batch.ref_logp)  # required when kl_coef > 0
    mask = batch.action_mask
    delta = torch.where(mask, ref.detach().to(dtype) - old.detach().to(dtype), 0)  # NaN off the actions never read
    if p.kl_input_clamp is not None:
        delta = delta.clamp(-p.kl_input_clamp, p.kl_input_clamp)
    if p.kl_estimator == "k1":
        estimate = -delta
    elif p.kl_estimator == "k2":
        estimate = delta.square() / 2
    else:
        estimate = torch.expm1(delta) - delta  # exp(δ) − 1 − δ
    if p.kl_output_clamp is not None:
        estimate = estimate.clamp(-p.kl_output_clamp, p.kl_output_clamp)
    return torch.where(mask, estimate, 0)


def biased_whiten(values: Tensor, mask: Tensor) -> Tensor:
    """NeMo-RL's Reinforce++ normalisation of ``values`` ``[B, T]`` over the action tokens: ÷N variance, clamped at
    1e-8 (no ε added); not zeroed off the mask."""
    count = mask.sum()
    mean = torch.where(mask, values, 0).sum() / count
    centered = values - mean
    var = torch.where(mask, centered * centered, 0).sum() / count
    return centered * var.clamp(min=1e-8).rsqrt()


@lossplug.advantage("reinforce_plus_plus", params=ReinforcePlusPlusParams, requires=("reward",))
def reinforce_plus_plus(batch: lossplug.PolicyBatch, p: ReinforcePlusPlusParams) -> lossplug.AdvantageResult:
    """REINFORCE++: A_t = whiten(G_t), G_t = r_t + γ·G_{t+1} over action tokens; returns G.

    Paper: Hu, 2025, *REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models*,
    arXiv:2501.03262.

    Reference: verl ``compute_reinforce_plus_plus_outcome_advantage``.
    """
    mask = batch.action_mask
    returns = discounted_returns(batch, p.gamma)
    if p.whiten == "center":
        advantage = torch.where(mask, masked_center(returns, mask), 0)
    else:
        advantage = torch.where(mask, masked_whiten(returns, mask), 0) if p.whiten else returns
    return lossplug.AdvantageResult(advantage=advantage, returns=returns)


@lossplug.advantage("reinforce_plus_plus_baseline", params=ReinforcePlusPlusBaselineParams, requires=_baseline_requires)
def reinforce_plus_plus_baseline(batch: lossplug.PolicyBatch, p: ReinforcePlusPlusBaselineParams) -> Tensor:
    """REINFORCE++-baseline: A_i = whiten(R_i − mean_group(R)) over action tokens; a group of one keeps R_i. With
    ``kl_coef`` β > 0 (NeMo-RL's ``use_kl_in_reward``): A_t = whiten(R_i − mean_group(R) − β·k_t), ``[B, T]``.

    Paper: Hu, 2025, *REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models*,
    arXiv:2501.03262.

    Reference: verl ``compute_reinforce_plus_plus_baseline_outcome_advantage``; NeMo-RL
    ``ReinforcePlusPlusAdvantageEstimator``.

    """
    score = at_least_float32(sequence_scores(batch))
    groups = Groups.from_ids(cast(Tensor, batch.group_id))  # required
    centered = score - group_mean_or_zero(groups, score)
    centered = torch.where(constant_group(groups, score), torch.zeros_like(centered), centered)
    mask = batch.action_mask
    if p.kl_coef > 0:
        old, ref = cast(Tensor, batch.old_logp), cast(Tensor, batch.ref_logp)  # required when kl_coef > 0
        dtype = torch.promote_types(torch.promote_types(centered.dtype, old.dtype), ref.dtype)
        kl = reference_kl(batch, p, dtype)
        tokens = torch.where(mask, centered.to(dtype).unsqueeze(-1) - p.kl_coef * kl, 0)
        if p.whiten == "center":
            tokens = masked_center(tokens, mask)
        elif p.whiten:
            tokens = biased_whiten(tokens, mask) if p.variance == "biased" else masked_whiten(tokens, mask)
        return torch.where(mask, tokens, 0)
    if p.whiten == "center":
        return center_rows(centered, mask)
    if p.variance == "biased":
        return biased_whiten(centered.unsqueeze(-1).expand(mask.shape), mask)[:, 0]
    return whiten_rows(centered, mask) if p.whiten else centered
