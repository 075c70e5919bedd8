"""Generalised advantage estimation (GAE) on the packed and the padded layout.

Per transition ``t`` of a trajectory fragment::

    δ_t = r_t + γ · V_next(t) − V(s_t)
    A_t = δ_t + γλ · A_{t+1}          (A_{t+1} = 0 after the fragment's last transition)
    R_t = A_t + V_old(s_t)            the critic target ("returns", as in TRL ≤ 0.11's PPO); never whitened

**Packed** (:class:`~lossplug.PackedTransitions`; Gymnasium's terminated/truncated split): ``terminated`` decides the
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
(``V(s_T) = 0``, as in TRL ≤ 0.11's PPO). Advantages and returns are ``[B, T]``, zero off action positions; NaN/inf
at non-action positions of any input never reach them.

``whiten`` (default on, like TRL's PPO and verl's GAE) standardises the advantages over all action tokens of the
batch (transitions, for packed) with the unbiased variance: ``(A − mean) / sqrt(var + 1e-8)``, exactly verl's and
TRL's ``masked_whiten`` (its Bessel factor ``n / (n − 1)`` in float32, as theirs on an integer mask).
``whiten: center`` subtracts the same mean and does not divide: OpenRLHF 0.11.2's ``--algo.advantage.no_std_norm``
(``openrlhf/trainer/ppo_utils/experience_maker.py``, ``compute_advantages_and_returns``: ``A − Σ A·mask / Σ mask``
over every action token of the rollout batch; OpenRLHF takes that mean in float32, here in the advantages' dtype).
Both statistics are over the batch given, never all-reduced: the trainers' advantage seams hold the whole rollout
batch (verl's driver; TRL's rewards gathered over all processes, there one position per completion), as OpenRLHF's
driver does; a caller that splits a batch over ranks before ``estimate_advantages`` gets per-rank statistics. ``critic_lam``
(default: ``lam``) is the λ of the returns: VAPO-style decoupled λ, the advantages still use ``lam``.
``kl_coef`` (padded only) adds the KL-shaped reward ``−kl_coef·(old_logp − ref_logp)`` of Ziegler et al. (2019,
arXiv:1909.08593) on every action token (see :func:`lossplug.tools.kl.kl_shaped_rewards`), reading ``old_logp`` (the
sampling policy) and ``ref_logp``.

Differences to verl 0.9.1's ``compute_gae_advantage_return`` (same recursion on action tokens — it also carries the
value and the trace across ``response_mask == 0`` positions): verl never bootstraps at the end of a response (no
``terminated`` / ``final_value``), leaves carried, non-zero advantages and returns on non-action positions, and
lets a NaN value at any masked position poison the whole row (it multiplies by the mask instead of selecting).
TRL ≤ 0.11's ``PPOTrainer.compute_advantages`` (``values * mask``) treats every position as a step: it equals ours
only when each row's actions are contiguous and followed by padding only.

Implementation: both layouts are reduced to one packed transition vector (padded: ``masked_select`` of the action
positions, no Python loop over rows) and the linear recurrence ``A_t = δ_t + c_t · A_{t+1}`` (``c_t = 0`` at
boundaries) is solved by a blocked parallel scan (:func:`reverse_linear_scan`): Kogge–Stone inside blocks of 64
transitions, the same scan recursively on the block carries, one fused multiply-add to finish — ``O(N log 64)``
work, no Python loop over time. Coefficients are exactly 0 across a boundary, so nothing ever leaks from one
fragment into another; no division and no whole-fragment cumulative product is ever formed, so long fragments
neither underflow nor lose precision. Measured precision against the sequential loops
(``tests/plugins/advantages/test_gae_precision.py``): float64 within ``1e-10`` relative (in practice ~1e-14);
float32 within ``1e-4 · Σ_k (γλ)^k |δ_{t+k}|`` of the float64 recursion on the same inputs (≤ 3e-5 at 1M
transitions with γλ = 0.9999; the float32 sequential loop errs by the same order of magnitude).

Paper: Schulman et al., 2015, *High-Dimensional Continuous Control Using Generalized Advantage Estimation*,
arXiv:1506.02438.

Reference: verl ``compute_gae_advantage_return``; TRL's original ``PPOTrainer`` (trl ≤ 0.11,
``trl/trainer/ppo_trainer.py``: ``compute_advantages``, whitened GAE; ``compute_rewards``, the KL-shaped reward);
Gymnasium's ``step()`` API (``terminated`` vs ``truncated``, since gym 0.26) for the bootstrap rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, cast

import torch
from pydantic import Field

import lossplug
from lossplug.contracts import LossplugError
from lossplug.contracts.errors import describe_positions
from lossplug.tools.kl import kl_shaped_rewards

Tensor = torch.Tensor
Lam = float | Tensor
#: ``True``: centre and divide by the std (verl's ``masked_whiten``); ``"center"``: centre only (OpenRLHF's
#: ``no_std_norm``); ``False``: neither
Whiten = bool | Literal["center"]


# ---------------------------------------------------------------------------------------------------------------------
# Kernels


#: block length of :func:`reverse_linear_scan` (measured fastest among 8–128 on CPU at 1M transitions)
SCAN_BLOCK = 64


def _block_scan(a: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """Kogge–Stone along the last dimension of ``[M, K]`` blocks, each solved as if ``a`` were 0 past its end.

    Returns the local solutions and the suffix products ``Π_{u ≥ t} c_u`` within each block (``⌈log2 K⌉`` steps,
    two ping-pong buffers: no allocation per step).
    """
    K = a.shape[-1]
    if K == 1:
        return a.clone(), c.clone()
    out_a, out_c = torch.empty_like(a), torch.empty_like(c)
    span = 1
    while span < K:
        torch.addcmul(a[:, :-span], c[:, :-span], a[:, span:], out=out_a[:, :-span])
        out_a[:, -span:] = a[:, -span:]
        torch.mul(c[:, :-span], c[:, span:], out=out_c[:, :-span])
        out_c[:, -span:] = c[:, -span:]
        first = span == 1
        a, c, out_a, out_c = out_a, out_c, a, c
        if first and 2 * span < K:  # the inputs are read, never written: a second buffer for the ping-pong
            out_a, out_c = torch.empty_like(a), torch.empty_like(c)
        span *= 2
    return a, c


def reverse_linear_scan(delta: Tensor, coef: Tensor, block: int = SCAN_BLOCK) -> Tensor:
    """Solve ``a_t = delta_t + coef_t · a_{t+1}`` backwards (``a_N = 0``) for 1-D tensors — no Python loop over t.

    A blocked (two-level, recursive) parallel scan: the vector is cut into blocks of ``block`` transitions; each
    block is solved locally by a Kogge–Stone scan (``⌈log2 block⌉`` vectorised steps, which also give the suffix
    products ``P_t = Π_{u ≥ t in the block} coef_u``); the carries into the blocks solve the same recurrence on the
    block starts (``N / block`` values, recursively); one fused multiply-add ``a_t += P_t · carry`` finishes. Work is
    ``O(N log block)`` instead of Kogge–Stone's ``O(N log N)``.

    Exactness: only products of coefficients and sums of terms are formed — never a division or a cumulative
    product over a whole fragment — so nothing over- or underflows that the sequential loop would not; a zero
    coefficient (a boundary) stops every contribution from beyond it exactly. The result equals the sequential
    recursion up to floating-point summation order (float64: ≲ 1e-14 relative to the terms' magnitude).
    """
    n = delta.numel()
    if n <= block:
        return _block_scan(delta.reshape(1, n), coef.reshape(1, n))[0].reshape(n)
    m = -(-n // block)
    pad = m * block - n
    if pad:  # zero deltas past the end: the padded tail solves to exactly 0, i.e. a_N = 0
        delta = torch.cat((delta, delta.new_zeros(pad)))
        coef = torch.cat((coef, coef.new_zeros(pad)))
    a, prod = _block_scan(delta.reshape(m, block), coef.reshape(m, block))
    start = reverse_linear_scan(a[:, 0].contiguous(), prod[:, 0].contiguous(), block)  # full solution at block starts
    carry = torch.cat((start[1:], start.new_zeros(1)))  # what flows into block j from block j + 1
    return a.addcmul_(prod, carry.unsqueeze(-1)).reshape(-1)[:n]


def _compute_dtype(*ts: Tensor | None) -> torch.dtype:
    dtype = torch.float32
    for t in ts:
        if t is not None and t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _gae(
    reward: Tensor, value: Tensor, bootstrap: Tensor, boundary: Tensor, gamma: float, lam: Lam, critic_lam: Lam | None
) -> tuple[Tensor, Tensor]:
    """Advantages (λ = ``lam``) and returns (λ = ``critic_lam``, default ``lam``) of packed 1-D transitions.

    ``bootstrap`` is V_next already zeroed where terminated; ``lam``/``critic_lam`` are floats or per-transition
    tensors.
    """
    delta = reward + gamma * bootstrap - value
    zero = torch.zeros((), dtype=delta.dtype, device=delta.device)
    advantage = reverse_linear_scan(
        delta, torch.where(boundary, zero, gamma * torch.as_tensor(lam, dtype=delta.dtype, device=delta.device))
    )
    if critic_lam is None or critic_lam is lam:
        target = advantage
    else:
        coef = torch.where(boundary, zero, gamma * torch.as_tensor(critic_lam, dtype=delta.dtype, device=delta.device))
        target = reverse_linear_scan(delta, coef)
    return advantage, target + value


def _whiten(x: Tensor) -> Tensor:
    """verl's (and TRL's) ``masked_whiten`` over every element of a packed vector (unbiased variance), bit for bit.

    Their mask is an integer (verl's ``response_mask``) or bool tensor (TRL's ``~padding_mask``), so its count is an
    integer and ``n + 1e-8`` and the Bessel factor ``n / (n − 1)`` come out in torch's default float dtype
    (float32) — reproduced here by the same promotions on an integer count; a float64 Bessel factor would differ
    from both by up to ~3e-8 relative. The count is filled on the device (``torch.full``, no host copy, no sync).
    One difference: they raise on a single element (``n − 1 = 0``); here the Bessel factor is then 1."""
    count = torch.full((), x.numel(), dtype=torch.int64, device=x.device)
    mean = x.sum() / (count + 1e-8)
    centered = x - mean
    var = (centered * centered).sum() / (count + 1e-8) * (count / (count - 1).clamp(min=1))  # two-pass, as theirs
    return centered * torch.rsqrt(var + 1e-8)


def _center(x: Tensor) -> Tensor:
    """``x`` minus its mean over every element of a packed vector (``whiten: center``, OpenRLHF's ``no_std_norm``):
    the exact count, no ε (OpenRLHF's ``Σ A·mask / Σ mask``)."""
    return x - x.sum() / torch.full((), x.numel(), dtype=torch.int64, device=x.device)


def _normalised(x: Tensor, whiten: Whiten) -> Tensor:
    """``x`` whitened, centred or as is, as ``whiten`` says (:data:`Whiten`)."""
    if whiten == "center":
        return _center(x)
    return _whiten(x) if whiten else x


def _segments(boundary: Tensor) -> Tensor:
    """Fragment index of every packed transition (fragments end at boundaries)."""
    seg = torch.zeros_like(boundary, dtype=torch.long)
    seg[1:] = torch.cumsum(boundary[:-1].long(), 0)
    return seg


# ---------------------------------------------------------------------------------------------------------------------
# Layouts


def gae_packed(
    batch: lossplug.PackedTransitions,
    gamma: float,
    lam: Lam | None,
    critic_lam: Lam | None,
    whiten: Whiten,
    lam_of: Callable[[Tensor], Tensor] | None = None,
) -> lossplug.AdvantageResult:
    """``lam``: λ, or None with ``lam_of``, the λ of a fragment length; ``critic_lam`` None: ``lam``."""
    dtype = _compute_dtype(batch.reward, batch.value, batch.next_value)
    reward, value = batch.reward.to(dtype), batch.value.to(dtype)
    bootstrap = torch.where(
        batch.terminated, torch.zeros((), dtype=dtype, device=value.device), batch.next_value.to(dtype)
    )
    metrics = {}
    if lam_of is not None:  # per-fragment λ from the fragment length (length-adaptive GAE)
        seg = _segments(batch.boundary)
        lengths = torch.bincount(seg).to(dtype)
        lam = lam_of(lengths)[seg]
        metrics = _lambda_metrics(lam_of(lengths))
    advantage, returns = _gae(reward, value, bootstrap, batch.boundary, gamma, cast(Lam, lam), critic_lam)
    advantage = _normalised(advantage, whiten)
    return lossplug.AdvantageResult(advantage=advantage, returns=returns, metric_tensors=metrics)


def gae_padded(
    batch: lossplug.PolicyBatch,
    gamma: float,
    lam: Lam | None,
    critic_lam: Lam | None,
    whiten: Whiten,
    kl_coef: float | None = None,
    lam_of: Callable[[Tensor], Tensor] | None = None,
) -> lossplug.AdvantageResult:
    mask = batch.action_mask
    B, T = mask.shape
    dtype = _compute_dtype(batch.reward, batch.value)
    # The action tokens of all rows, row-major (each row's actions in order), as one packed vector: masked_select
    # reads action positions only, so whatever non-action positions hold never enters the computation.
    lengths = mask.sum(-1)
    ends = torch.cumsum(lengths, 0) - 1  # packed index of each row's last action token (closes its fragment)
    nonempty = lengths > 0  # always all rows under the contract; validate="off" may pass empty rows
    if not bool(nonempty.all()):
        ends = ends[nonempty]
    value = torch.masked_select(cast(Tensor, batch.value), mask).to(dtype)  # reward and value: required
    n = value.numel()
    last = torch.zeros(n, dtype=torch.bool, device=mask.device)
    last[ends] = True

    reward = cast(Tensor, batch.reward)
    if reward.ndim == 1:
        scores = reward.to(dtype)
        reward = torch.zeros(n, dtype=dtype, device=mask.device)
        reward[ends] = scores if scores.shape[0] == ends.shape[0] else scores[nonempty]
    else:
        reward = torch.masked_select(reward, mask).to(dtype)

    metrics: dict[str, Tensor] = {}
    if kl_coef:
        reward = reward + _kl_penalty(batch, kl_coef, dtype, metrics)
    end_value = _end_values(batch, dtype)
    bootstrap = torch.cat((value[1:], value.new_zeros(1)))  # the next action's value within a row ...
    bootstrap[ends] = end_value if end_value.shape[0] == ends.shape[0] else end_value[nonempty]  # ... or the end's

    if lam_of is not None:  # per-row λ from the number of action tokens (length-adaptive GAE)
        lam_rows = lam_of(lengths.to(dtype))
        lam = torch.repeat_interleave(lam_rows, lengths, output_size=n)
        metrics.update(_lambda_metrics(lam_rows))
    advantage, returns = _gae(reward, value, bootstrap, last, gamma, cast(Lam, lam), critic_lam)  # (as in gae_packed)
    advantage = _normalised(advantage, whiten)

    def scatter(x: Tensor) -> Tensor:  # back to [B, T], zero off action positions
        return torch.zeros(B, T, dtype=dtype, device=mask.device).masked_scatter_(mask, x)

    return lossplug.AdvantageResult(advantage=scatter(advantage), returns=scatter(returns), metric_tensors=metrics)


def _kl_penalty(batch: lossplug.PolicyBatch, kl_coef: float, dtype: torch.dtype, metrics: dict[str, Tensor]) -> Tensor:
    """The packed KL-shaped reward −kl_coef·(old_logp − ref_logp) on the action tokens; its metrics into
    ``metrics``."""
    mask = batch.action_mask
    B = mask.shape[0]
    missing = [n for n in ("old_logp", "ref_logp") if getattr(batch, n) is None]
    if missing:
        raise LossplugError(
            f"gae with kl_coef={kl_coef} needs {' and '.join(missing)}: the KL-shaped reward is "
            f"−kl_coef·(old_logp − ref_logp) (for a single on-policy step pass "
            f"old_logp=logp.detach())"
        )
    shaped = kl_shaped_rewards(
        torch.zeros(B, dtype=dtype, device=mask.device),
        cast(Tensor, batch.old_logp),
        cast(Tensor, batch.ref_logp),
        mask,
        kl_coef=kl_coef,
    )  # (checked just above)
    kl_flat = torch.masked_select(shaped.kl, mask)
    metrics["kl/mean"] = kl_flat.mean()
    metrics["reward/non_score_sum_mean"] = -kl_coef * kl_flat.sum() / B
    return torch.masked_select(shaped.non_score_rewards, mask).to(dtype)


def _end_values(batch: lossplug.PolicyBatch, dtype: torch.dtype) -> Tensor:
    """``[B]`` bootstrap of each row's end: final_value where the response was truncated (terminated given and
    False), else 0."""
    mask = batch.action_mask
    end_value = torch.zeros(mask.shape[0], dtype=dtype, device=mask.device)
    if batch.terminated is not None:
        truncated = ~batch.terminated
        if batch.final_value is None:
            if bool(truncated.any()):
                raise LossplugError(
                    f"gae: final_value is required where terminated is False (time-limit truncation "
                    f"bootstraps from the real final observation's value) — "
                    f"{describe_positions(truncated)}"
                )
        else:
            end_value = torch.where(truncated, batch.final_value.to(dtype), end_value)
    elif batch.final_value is not None:
        raise LossplugError(
            "gae: final_value given without terminated: set terminated ([B] bool) to say which "
            "responses were truncated (bootstrap from final_value) and which ended (no bootstrap)"
        )
    return end_value


def _lambda_metrics(lam: Tensor) -> dict[str, Tensor]:
    return {"lambda/mean": lam.mean(), "lambda/min": lam.min(), "lambda/max": lam.max()}


# ---------------------------------------------------------------------------------------------------------------------
# Public functions and the plugin


def packed_gae(
    reward: Tensor,
    value: Tensor,
    next_value: Tensor,
    terminated: Tensor,
    boundary: Tensor,
    gamma: float = 0.99,
    lam: float = 0.95,
) -> Tensor:
    """GAE over packed transitions (arXiv:1506.02438): validated through :class:`~lossplug.PackedTransitions`, no
    gradient, not whitened."""
    with torch.no_grad():
        batch = lossplug.PackedTransitions(
            reward=reward, value=value, next_value=next_value, terminated=terminated, boundary=boundary
        )
        return gae_packed(batch, gamma, lam, None, whiten=False).advantage


class GAEParams(lossplug.Params):
    gamma: float = Field(1.0, ge=0, le=1, description="discount (LLM RL: 1.0, as TRL PPO and verl)")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ of the advantages (TRL PPO: 0.95, verl: 1.0)")
    critic_lam: float | None = Field(None, ge=0, le=1, description="λ of the returns (critic targets); default: lam")
    whiten: Whiten = Field(
        True,
        description="true: standardise advantages over all action tokens; center: subtract their mean only "
        "(OpenRLHF's no_std_norm); false: neither (returns never are)",
    )
    kl_coef: float | None = Field(
        None, ge=0, description="padded only: add the KL-shaped reward −kl_coef·(old_logp − ref_logp) per action token"
    )


def _gae_requires(p: GAEParams) -> tuple[str, ...]:
    return ("reward", "value") + (("old_logp", "ref_logp") if p.kl_coef else ())


@lossplug.advantage("gae", params=GAEParams, requires=_gae_requires, layouts=("packed", "padded"))
def gae(batch: lossplug.PolicyBatch | lossplug.PackedTransitions, p: GAEParams) -> lossplug.AdvantageResult:
    """GAE(γ, λ) with terminated/boundary bookkeeping; returns A + V_old; observation tokens are skipped."""
    if isinstance(batch, lossplug.PackedTransitions):
        if p.kl_coef:
            raise LossplugError(
                "gae: kl_coef needs per-token log-probs, which packed transitions do not carry; "
                "shape the rewards before packing (lossplug.tools.kl.kl_shaped_rewards)"
            )
        return gae_packed(batch, p.gamma, p.lam, p.critic_lam, p.whiten)
    return gae_padded(batch, p.gamma, p.lam, p.critic_lam, p.whiten, p.kl_coef)
