"""Generalised advantage estimation (GAE) on the packed and the padded layout.

Per transition ``t`` of a trajectory fragment::

    δ_t = r_t + γ · V_next(t) − V(s_t)
    A_t = δ_t + γλ · A_{t+1}          (A_{t+1} = 0 after the fragment's last transition)
    R_t = A_t + V_old(s_t)            the critic target ("returns", seed 2); never whitened

**Packed** (:class:`~lossplug.PackedTransitions`, seed 1's ``packed_gae`` exactly): ``terminated`` decides the
bootstrap — ``V_next = 0`` where terminated (``next_value`` is ignored there and may be NaN), ``next_value``
otherwise; ``boundary`` decides the trace — the recursion restarts after every boundary. A time-limit truncation is
``terminated=False, boundary=True``: it bootstraps from the real final observation's value and does not chain into
the physically next fragment.

**Padded** (:class:`~lossplug.PolicyBatch`): every row is one fragment whose transitions are its **action tokens**,
in order. Observation/tool tokens inside a multi-turn response (``action_mask`` False between actions), prompt and
padding are skipped, not treated as steps: the next value of an action is the value at the *next action position*,
and δ and the γλ decay advance once per action token, not per position. Rewards are read on action positions only:
a ``[B]`` sequence score is placed on the last action token, a ``[B, T]`` token reward is read where
``action_mask`` is True (whatever it holds elsewhere is ignored). The end of a row bootstraps from ``final_value``
where ``terminated`` is given and False (time-limit truncation, or a turn whose trajectory continues in another
row — that row's trace is not chained); where ``terminated`` is True or not given there is no bootstrap
(``V(s_T) = 0``, seed 2). Advantages and returns are ``[B, T]``, zero off action positions; NaN/inf at non-action
positions of any input never reach them.

``whiten`` (default on, like TRL's PPO and verl's GAE) standardises the advantages over all action tokens of the
batch (transitions, for packed) with the unbiased variance: ``(A − mean) / sqrt(var + 1e-8)``. ``critic_lam``
(default: ``lam``) is the λ of the returns: VAPO-style decoupled λ, the advantages still use ``lam``.
``kl_coef`` (padded only) adds seed 2's KL-shaped reward ``−kl_coef·(old_logp − ref_logp)`` on every action token
(see :mod:`.kl_shaped_reward`), reading ``old_logp`` (the sampling policy) and ``ref_logp``.

Differences to verl 0.9.1's ``compute_gae_advantage_return`` (same recursion on action tokens — it also carries the
value and the trace across ``response_mask == 0`` positions): verl never bootstraps at the end of a response (no
``terminated`` / ``final_value``), leaves carried, non-zero advantages and returns on non-action positions, and
lets a NaN value at any masked position poison the whole row (it multiplies by the mask instead of selecting).
Seed 2's reference loop (``values * mask``) treats every position as a step: it equals ours only when each row's
actions are contiguous and followed by padding only.

Implementation: both layouts are reduced to one packed transition vector and the linear recurrence
``A_t = δ_t + c_t · A_{t+1}`` (``c_t = 0`` at boundaries) is solved by a log-depth parallel scan (Kogge–Stone):
``⌈log2 N⌉`` vectorised steps, no Python loop over the batch or over time. Coefficients are exactly 0 across a
boundary, so nothing ever leaks from one fragment into another.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from pydantic import Field

import lossplug
from lossplug.contracts import LossplugError
from lossplug.contracts.errors import describe_positions
from lossplug.ops import masked_whiten

from .kl_shaped_reward import kl_shaped_rewards

Tensor = torch.Tensor
Lam = Union[float, Tensor]


# ---------------------------------------------------------------------------------------------------------------------
# Kernels


def reverse_linear_scan(delta: Tensor, coef: Tensor) -> Tensor:
    """Solve ``a_t = delta_t + coef_t · a_{t+1}`` backwards (``a_N = 0``) for 1-D tensors, in ⌈log2 N⌉ steps.

    After the step with span ``s``, ``a_t`` holds the recursion truncated to the window ``[t, t + 2s)`` and
    ``coef_t`` the product of the window's coefficients; doubling the span until it covers the whole vector gives the
    exact solution (up to floating-point summation order). A zero coefficient stops every contribution from beyond it.
    """
    a, c = delta, coef
    n = a.numel()
    span = 1
    while span < n:
        a = torch.cat((torch.addcmul(a[:-span], c[:-span], a[span:]), a[-span:]))
        if 2 * span < n:
            c = torch.cat((c[:-span] * c[span:], c[-span:]))
        span *= 2
    return a


def _compute_dtype(*ts: Optional[Tensor]) -> torch.dtype:
    dtype = torch.float32
    for t in ts:
        if t is not None and t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _gae(reward: Tensor, value: Tensor, bootstrap: Tensor, boundary: Tensor, gamma: float, lam: Lam,
         critic_lam: Optional[Lam]) -> tuple[Tensor, Tensor]:
    """Advantages (λ = ``lam``) and returns (λ = ``critic_lam``, default ``lam``) of packed 1-D transitions.

    ``bootstrap`` is V_next already zeroed where terminated; ``lam``/``critic_lam`` are floats or per-transition
    tensors.
    """
    delta = reward + gamma * bootstrap - value
    zero = torch.zeros((), dtype=delta.dtype, device=delta.device)
    advantage = reverse_linear_scan(delta, torch.where(boundary, zero, gamma * torch.as_tensor(lam, dtype=delta.dtype,
                                                                                                 device=delta.device)))
    if critic_lam is None or critic_lam is lam:
        target = advantage
    else:
        coef = torch.where(boundary, zero, gamma * torch.as_tensor(critic_lam, dtype=delta.dtype, device=delta.device))
        target = reverse_linear_scan(delta, coef)
    return advantage, target + value


def _whiten(x: Tensor) -> Tensor:
    return masked_whiten(x, torch.ones_like(x, dtype=torch.bool))


def _segments(boundary: Tensor) -> Tensor:
    """Fragment index of every packed transition (fragments end at boundaries)."""
    seg = torch.zeros_like(boundary, dtype=torch.long)
    seg[1:] = torch.cumsum(boundary[:-1].long(), 0)
    return seg


# ---------------------------------------------------------------------------------------------------------------------
# Layouts


def _packed(batch: lossplug.PackedTransitions, gamma: float, lam, critic_lam, whiten: bool,
            lam_of=None) -> lossplug.AdvantageResult:
    dtype = _compute_dtype(batch.reward, batch.value, batch.next_value)
    reward, value = batch.reward.to(dtype), batch.value.to(dtype)
    bootstrap = torch.where(batch.terminated, torch.zeros((), dtype=dtype, device=value.device),
                            batch.next_value.to(dtype))
    metrics = {}
    if lam_of is not None:  # per-fragment λ from the fragment length (length-adaptive GAE)
        seg = _segments(batch.boundary)
        lengths = torch.bincount(seg).to(dtype)
        lam = lam_of(lengths)[seg]
        metrics = _lambda_metrics(lam_of(lengths))
    advantage, returns = _gae(reward, value, bootstrap, batch.boundary, gamma, lam, critic_lam)
    if whiten:
        advantage = _whiten(advantage)
    return lossplug.AdvantageResult(advantage=advantage, returns=returns, metric_tensors=metrics)


def _padded(batch: lossplug.PolicyBatch, gamma: float, lam, critic_lam, whiten: bool, kl_coef: Optional[float] = None,
            lam_of=None) -> lossplug.AdvantageResult:
    mask = batch.action_mask
    B, T = mask.shape
    dtype = _compute_dtype(batch.reward, batch.value)
    flat = mask.reshape(-1).nonzero().squeeze(-1)  # action positions, row-major: each row's actions in order
    row = torch.div(flat, T, rounding_mode="floor")
    last = torch.ones_like(row, dtype=torch.bool)
    last[:-1] = row[1:] != row[:-1]  # the last action token of each row closes its fragment

    value = batch.value.reshape(-1)[flat].to(dtype)
    reward = batch.reward
    if reward.ndim == 1:
        reward = torch.where(last, reward.to(dtype)[row], 0)
    else:
        reward = reward.reshape(-1)[flat].to(dtype)

    metrics: dict[str, Tensor] = {}
    if kl_coef:
        missing = [n for n in ("old_logp", "ref_logp") if getattr(batch, n) is None]
        if missing:
            raise LossplugError(f"gae with kl_coef={kl_coef} needs {' and '.join(missing)}: the KL-shaped reward is "
                                f"−kl_coef·(old_logp − ref_logp) (for a single on-policy step pass "
                                f"old_logp=logp.detach())")
        _, non_score, kl = kl_shaped_rewards(torch.zeros(B, dtype=dtype, device=mask.device), batch.old_logp,
                                             batch.ref_logp, mask, kl_coef)
        reward = reward + non_score.reshape(-1)[flat].to(dtype)
        kl_flat = kl.reshape(-1)[flat]
        metrics["kl/mean"] = kl_flat.mean()
        metrics["reward/non_score_sum_mean"] = -kl_coef * kl_flat.sum() / B

    # bootstrap of each row's end: final_value where the response was truncated (terminated given and False)
    end_value = torch.zeros(B, dtype=dtype, device=mask.device)
    if batch.terminated is not None:
        truncated = ~batch.terminated
        if batch.final_value is None:
            if bool(truncated.any()):
                raise LossplugError(f"gae: final_value is required where terminated is False (time-limit truncation "
                                    f"bootstraps from the real final observation's value) — "
                                    f"{describe_positions(truncated)}")
        else:
            end_value = torch.where(truncated, batch.final_value.to(dtype), end_value)
    elif batch.final_value is not None:
        raise LossplugError("gae: final_value given without terminated: set terminated ([B] bool) to say which "
                            "responses were truncated (bootstrap from final_value) and which ended (no bootstrap)")
    next_value = torch.cat((value[1:], value.new_zeros(1)))
    bootstrap = torch.where(last, end_value[row], next_value)

    if lam_of is not None:  # per-row λ from the number of action tokens (length-adaptive GAE)
        lam_rows = lam_of(mask.sum(-1).to(dtype))
        lam = lam_rows[row]
        metrics.update(_lambda_metrics(lam_rows))
    advantage, returns = _gae(reward, value, bootstrap, last, gamma, lam, critic_lam)
    if whiten:
        advantage = _whiten(advantage)

    def scatter(x: Tensor) -> Tensor:
        return torch.zeros(B * T, dtype=dtype, device=mask.device).index_copy_(0, flat, x).view(B, T)

    return lossplug.AdvantageResult(advantage=scatter(advantage), returns=scatter(returns), metric_tensors=metrics)


def _lambda_metrics(lam: Tensor) -> dict[str, Tensor]:
    return {"lambda/mean": lam.mean(), "lambda/min": lam.min(), "lambda/max": lam.max()}


# ---------------------------------------------------------------------------------------------------------------------
# Public functions and the plugin


def packed_gae(reward: Tensor, value: Tensor, next_value: Tensor, terminated: Tensor, boundary: Tensor,
               gamma: float = 0.99, lam: float = 0.95) -> Tensor:
    """Seed 1's ``packed_gae``: validated through :class:`~lossplug.PackedTransitions`, no gradient, not whitened."""
    with torch.no_grad():
        batch = lossplug.PackedTransitions(reward=reward, value=value, next_value=next_value, terminated=terminated,
                                           boundary=boundary)
        return _packed(batch, gamma, lam, None, whiten=False).advantage


class GAEParams(lossplug.Params):
    gamma: float = Field(1.0, ge=0, le=1, description="discount (LLM RL: 1.0, as TRL PPO and verl)")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ of the advantages (TRL PPO: 0.95, verl: 1.0)")
    critic_lam: Optional[float] = Field(None, ge=0, le=1, description="λ of the returns (critic targets); "
                                                                       "default: lam")
    whiten: bool = Field(True, description="standardise advantages over all action tokens (returns never are)")
    kl_coef: Optional[float] = Field(None, ge=0, description="padded only: add the KL-shaped reward "
                                                             "−kl_coef·(old_logp − ref_logp) per action token")


def _gae_requires(p: "GAEParams") -> tuple[str, ...]:
    return ("reward", "value") + (("old_logp", "ref_logp") if p.kl_coef else ())


@lossplug.advantage("gae", params=GAEParams, requires=_gae_requires, layouts=("packed", "padded"))
def gae(batch, p: GAEParams) -> lossplug.AdvantageResult:
    """GAE(γ, λ) with terminated/boundary bookkeeping; returns A + V_old; observation tokens are skipped."""
    if isinstance(batch, lossplug.PackedTransitions):
        if p.kl_coef:
            raise LossplugError("gae: kl_coef needs per-token log-probs, which packed transitions do not carry; "
                                "shape the rewards before packing (lossplug.plugins.advantages.kl_shaped_reward)")
        return _packed(batch, p.gamma, p.lam, p.critic_lam, p.whiten)
    return _padded(batch, p.gamma, p.lam, p.critic_lam, p.whiten, p.kl_coef)
