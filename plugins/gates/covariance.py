"""Clip-Cov and KL-Cov: PPO variants that act on the few tokens whose advantage and log-prob covary most.

Both compute, over the action tokens of the micro-batch, the centred product (a one-sample covariance)::

    c_t = (A_t − mean(A)) · (logp_t − mean(logp))         (means over the micro-batch's action tokens)

Tokens with a large ``c_t`` are the ones driving the policy's entropy down; the two gates restrain them.

* ``clip_cov`` — PPO's clipped surrogate ``min(r·A, clip(r, 1 − eps_low, 1 + eps_high)·A)``, with the gradient of a
  few tokens cut (objective ×0): among the action tokens PPO did not clip whose ``c_t`` lies strictly inside
  ``(lb, ub)``, ``k = max(⌊ratio · N⌋, 1)`` chosen **at random** (``N`` the micro-batch's action tokens), or all of
  them when fewer.
* ``kl_cov`` — the unclipped surrogate ``r·A`` with a KL penalty on the ``k = max(⌊ratio · N⌋, 1)`` tokens of largest
  ``c_t``: ``J_t = r_t·A_t − coef·|log r_t|`` there.

Both statistics and the selection are local to the micro-batch (as in verl): a different split of the step selects
different tokens. The ratio ``r = exp(logp − old_logp)`` has its log clamped to ``± log_ratio_clamp`` (verl clamps
nothing; the clamp binds only where verl's ratio is beyond e^±20).

Randomness (``clip_cov``): the selection is verl's exactly under the same torch RNG state — seed (or
``torch.set_rng_state``) before each call and both pick the same tokens. verl draws ``torch.randperm(n)`` on the
default CPU generator (``n`` the number of candidates) and keeps its first ``k``. On the CPU the gate does the same
(the generator then advances alike). On an accelerator, knowing ``n`` on the host would be a device→host
synchronisation, so the gate instead reads the next 32-bit words of that generator's MT19937 stream from
``torch.get_rng_state()`` and replays the first ``k`` steps of randperm's Fisher–Yates shuffle (``z = word mod
(n − i)``; swap ``i ↔ i + z``) as tensor operations on the device, with ``n`` and ``k`` kept as tensors — no host
sync, ``max(⌊ratio · B·T⌋, 1)`` small sequential steps. It then advances the generator by that many words, where
verl advances it by ``n − 1``: the selection is the same, the generator states after the call differ. (Exact for
``n < 2³²/20``, torch's small-``n`` randperm path; a test checks the replay against ``torch.randperm``.)

``kl_cov``'s top-k takes a fixed ``K = max(⌊ratio · B·T⌋, 1)`` from the shapes over all positions (non-actions at
−inf) and keeps the first ``k`` — verl's ``topk(k)`` of the action tokens, without its host sync. Its means are
sums over ``[B, T]`` where verl averages the gathered action tokens on the CPU (last-bit differences), and ties in
``c_t`` may be broken differently: either matters only at an exact or near tie (measure zero for real-valued inputs).

Detach/gradient contract: the selection and the statistics are constants of the update (computed under
``no_grad``); gradient flows through ``logp`` in ``r`` (and in ``|log r|``) only.

Paper: Cui et al., 2025, *The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models*
(Clip-Cov, KL-Cov), arXiv:2505.22617.

Reference: verl ``compute_policy_loss_clip_cov`` and ``compute_policy_loss_kl_cov`` (``loss_mode=clip_cov|kl_cov``;
``policy_loss.clip_cov_ratio/clip_cov_lb/clip_cov_ub``, ``policy_loss.kl_cov_ratio/ppo_kl_coef``).
"""

from __future__ import annotations

import random
import struct

import torch
from pydantic import Field, model_validator

import lossplug
from lossplug.contracts import LossplugError
from lossplug.ops import clamp_exact

Tensor = torch.Tensor

#: torch's serialised CPU generator state: seed (u64), left (i32), seeded (i32), next (u64), then the 624 MT19937
#: words, each stored as a u64 (the layout of ``THGeneratorState``, stable since torch 1.x)
_STATE_HEAD = "<QiiQ"
_MT_WORDS = 624


def next_cpu_words(count: int) -> list[int]:
    """The next ``count`` 32-bit outputs of torch's default CPU generator (what ``randperm`` draws one by one), read
    from its state without advancing it."""
    raw = bytes(torch.get_rng_state().tolist())  # uint8 state; not .numpy(): NumPy is no dependency
    head = struct.calcsize(_STATE_HEAD)
    if len(raw) < head + 8 * _MT_WORDS:
        raise LossplugError(
            f"clip_cov: torch's CPU generator state has {len(raw)} bytes, not the MT19937 layout this gate reads; "
            "the random selection cannot be replayed"
        )
    _, left, _, position = struct.unpack_from(_STATE_HEAD, raw, 0)
    words = struct.unpack_from(f"<{_MT_WORDS}Q", raw, head)
    # torch regenerates the block when ``--left`` reaches 0, i.e. when left == 1: Python's index 624 does the same
    index = _MT_WORDS if left == 1 else position
    mt = random.Random()
    mt.setstate((3, tuple(w & 0xFFFFFFFF for w in words) + (index,), None))
    return [mt.getrandbits(32) for _ in range(count)]


def _advance_cpu_generator(count: int) -> None:
    """Consume ``count`` 32-bit words of the default CPU generator (an int32 ``random_`` draws one word each)."""
    torch.empty(count, dtype=torch.int32).random_()


def shuffled_prefix(n: Tensor, k: Tensor, max_k: int, size: int, *, replay: bool | None = None) -> Tensor:
    """``torch.randperm(n)[:k]`` under the current CPU RNG state, as a ``[max_k]`` tensor on ``n``'s device whose
    entries past ``k`` are ``size`` (a sentinel); ``n`` and ``k`` are 0-d int64 tensors with ``k ≤ min(n, max_k)``,
    ``n ≤ size``.

    On the CPU (reading a tensor there costs no device synchronisation) it calls ``torch.randperm(n)`` itself, as
    verl does, and the generator advances by ``n − 1`` words. On an accelerator (``replay``, or forced with
    ``replay=True``) it replays the shuffle without reading ``n`` or ``k`` on the host and advances the generator by
    ``max_k`` words."""
    device = n.device
    if not (device.type != "cpu" if replay is None else replay):
        n_host, k_host = int(n), int(k)
        head = torch.randperm(n_host)[:k_host] if n_host > 0 else torch.zeros(0, dtype=torch.int64)
        return torch.cat([head, torch.full((max_k - k_host,), size, dtype=torch.int64)])
    draws = torch.tensor(next_cpu_words(max_k), dtype=torch.int64).to(device, non_blocking=True)
    _advance_cpu_generator(max_k)
    perm = torch.arange(size, device=device)
    steps = min(max_k, size)
    for i in range(steps):
        # Fisher–Yates step i of randperm: z = word_i mod (n − i), swap i ↔ i + z; a no-op from step k on
        span = (n - i).clamp(min=1)
        j = torch.where(k > i, draws[i] % span + i, i).reshape(1)
        at_i = perm[i].clone()
        perm[i] = perm.gather(0, j).squeeze(0)
        perm.index_put_((j,), at_i.reshape(1))
    prefix = perm[:steps]
    if steps < max_k:
        prefix = torch.cat([prefix, torch.full((max_k - steps,), size, dtype=prefix.dtype, device=device)])
    return torch.where(torch.arange(max_k, device=device) < k, prefix, size)


def _covariance(inp: lossplug.GateInput) -> tuple[Tensor, Tensor, Tensor]:
    """``(c, A, n)``: the centred product ``(A − mean A)·(logp − mean logp)`` ``[B, T]`` over the micro-batch's
    action tokens (detached), the advantage ``[B, T]`` and the action-token count (0-d)."""
    adv = inp.advantage
    logp = inp.logp.detach()
    count = inp.lengths.sum()
    denominator = count.clamp(min=1).to(adv.dtype)
    return (adv - adv.sum() / denominator) * (logp - logp.sum() / denominator), adv, count


def _budget(ratio: float, count: Tensor) -> Tensor:
    """``max(⌊ratio · count⌋, 1)`` as verl computes it in double precision, on the device."""
    return torch.floor(count.to(torch.float64) * ratio).to(torch.int64).clamp(min=1)


class ClipCovParams(lossplug.Params):
    eps_low: float = Field(0.2, gt=0, lt=1, description="lower PPO clip (verl: clip_ratio_low)")
    eps_high: float = Field(0.2, gt=0, description="upper PPO clip (verl: clip_ratio_high)")
    ratio: float = Field(
        2e-4, gt=0, le=1, description="fraction of the action tokens whose gradient is cut (verl: clip_cov_ratio)"
    )
    lb: float = Field(1.0, description="candidates have a covariance above this (verl: clip_cov_lb)")
    ub: float = Field(5.0, description="candidates have a covariance below this (verl: clip_cov_ub)")
    log_ratio_clamp: float = Field(20.0, gt=0, le=80, description="the log-ratio is clamped to ± this before exp")

    @model_validator(mode="after")
    def _ordered(self) -> ClipCovParams:
        if not self.lb < self.ub:
            raise ValueError(f"lb ({self.lb}) must be below ub ({self.ub})")
        return self


@lossplug.gate("clip_cov", params=ClipCovParams, requires=("old_logp",))
def clip_cov(inp: lossplug.GateInput, p: ClipCovParams) -> lossplug.GateOutput:
    """Clip-Cov: PPO clip, with the gradient cut on k random unclipped tokens whose covariance lies in (lb, ub)."""
    ratio = clamp_exact(inp.update_log_ratio(), -p.log_ratio_clamp, p.log_ratio_clamp).exp()
    adv = inp.broadcast_advantage()
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - p.eps_low, 1 + p.eps_high) * adv)
    mask = inp.mask
    with torch.no_grad():
        cov, full_adv, count = _covariance(inp)
        r = ratio.detach()
        clipped = (-full_adv * r.clamp(1 - p.eps_low, 1 + p.eps_high) > -full_adv * r) & mask
        candidate = ((cov < p.ub) & (cov > p.lb) & mask & ~clipped).reshape(-1)
        size = candidate.numel()
        n = torch.count_nonzero(candidate)
        k = torch.minimum(_budget(p.ratio, count), n)
        max_k = max(int(p.ratio * size), 1)
        chosen = shuffled_prefix(n, k, max_k, size)
        picked = torch.zeros(size + 1, dtype=torch.bool, device=candidate.device)
        picked[chosen] = True
        # candidate j (in row-major order, as torch.nonzero lists them) is cut if j is among the chosen ranks
        rank = (torch.cumsum(candidate, 0) - 1).clamp(min=0)
        cut = (candidate & picked[rank]).reshape(mask.shape)
    objective = torch.where(cut, 0, surrogate)
    return lossplug.GateOutput(
        objective=objective,
        metrics={
            "cov_cut_frac": lambda: inp.token_fraction(cut),  # verl's pg_clipfrac
            "clip_frac": lambda: inp.token_fraction(clipped),
        },
        active=lambda: ~cut,
    )


class KLCovParams(lossplug.Params):
    ratio: float = Field(
        2e-4, gt=0, le=1, description="fraction of the action tokens given the KL penalty (verl: kl_cov_ratio)"
    )
    coef: float = Field(0.1, ge=0, description="coefficient of the penalty coef·abs(log r) (verl: ppo_kl_coef, 0.1)")
    log_ratio_clamp: float = Field(20.0, gt=0, le=80, description="the log-ratio is clamped to ± this before exp")


@lossplug.gate("kl_cov", params=KLCovParams, requires=("old_logp",))
def kl_cov(inp: lossplug.GateInput, p: KLCovParams) -> lossplug.GateOutput:
    """KL-Cov: r·A, minus coef·|log r| on the k tokens of largest covariance."""
    log_ratio = inp.update_log_ratio()
    ratio = clamp_exact(log_ratio, -p.log_ratio_clamp, p.log_ratio_clamp).exp()
    surrogate = ratio * inp.broadcast_advantage()
    mask = inp.mask
    with torch.no_grad():
        cov, _, count = _covariance(inp)
        scores = torch.where(mask, cov, float("-inf")).reshape(-1)
        size = scores.numel()
        max_k = max(int(size * p.ratio), 1)
        k = torch.where(count > 0, _budget(p.ratio, count), 0)
        top = torch.topk(scores, max_k).indices
        penalised = torch.zeros(size, dtype=torch.bool, device=scores.device)
        penalised[top] = torch.arange(max_k, device=scores.device) < k
        penalised = penalised.reshape(mask.shape)
    objective = torch.where(penalised, surrogate - p.coef * log_ratio.abs(), surrogate)
    return lossplug.GateOutput(
        objective=objective,
        metrics={
            "kl_frac": lambda: inp.token_fraction(penalised),
            # verl's actor/ppo_kl for kl_cov: the mean |log r| over the action tokens (zero off them)
            "abs_kl": lambda: log_ratio.detach().abs().sum() / inp.action_tokens,
        },
        active=lambda: inp.mask,
    )
