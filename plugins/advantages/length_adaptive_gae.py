"""VAPO's length-adaptive GAE (Yue et al., 2025, arXiv:2504.05118).

The policy's λ depends on the length ``l`` of the trajectory::

    λ_policy(l) = clamp(1 − 1 / (α · l), 0, 1)          α = 0.05 by default

so that the sum of the GAE weights ``1 / (1 − λ) = α·l`` grows with the length: short responses keep a short,
low-variance horizon, long ones propagate the final reward further back. The critic's targets use their own λ
(``critic_lam``, default 1.0: unbiased Monte-Carlo returns, as in VAPO) — the two are independent components of
the recipe.

**Unit of l**: on the padded layout, ``l`` is the number of **action tokens** of the response (``action_mask`` sum;
prompt, observation/tool and padding tokens do not count), which is also the number of GAE steps of that row —
observation tokens are skipped by the recursion (see :mod:`.gae`). On the packed layout, ``l`` is the number of
transitions of the fragment (the run of transitions ending at a ``boundary``).

Everything else — bootstrap at truncation, skipped observation tokens, whitening, ``returns = A_critic + V_old`` —
is :mod:`.gae`'s.

Paper: Yue et al., 2025, *VAPO: Efficient and Reliable Reinforcement Learning for Advanced Reasoning Tasks*,
arXiv:2504.05118.
"""

from __future__ import annotations

import torch
from pydantic import Field

import lossplug
from lossplug.contracts import LossplugError

from .gae import gae_packed, gae_padded

Tensor = torch.Tensor


def length_adaptive_lambda(length: Tensor | int | float | list[float], alpha: float = 0.05) -> Tensor:
    """``clamp(1 − 1/(α·l), 0, 1)`` elementwise; ``l`` in action tokens (or transitions, packed).

    Integer lengths give a float32 tensor (a floating tensor keeps its dtype). Raises :class:`LossplugError` for a
    non-positive (or non-finite) length or alpha.
    """
    length = torch.as_tensor(length)
    if not length.is_floating_point():
        length = length.to(torch.float32)
    if not (isinstance(alpha, (int, float)) and alpha > 0 and alpha != float("inf")):
        raise LossplugError(f"length_adaptive_lambda: alpha must be positive and finite, got {alpha!r}")
    bad = ~(torch.isfinite(length) & (length > 0))
    if bool(bad.any()):
        raise LossplugError(
            f"length_adaptive_lambda: length must be positive and finite, got "
            f"{length[bad].reshape(-1)[:8].tolist()} (the length unit is action tokens)"
        )
    return (1 - 1 / (alpha * length)).clamp(0, 1)


class LengthAdaptiveGAEParams(lossplug.Params):
    alpha: float = Field(0.05, gt=0, description="λ_policy = 1 − 1/(alpha · l), l = action tokens of the response")
    gamma: float = Field(1.0, ge=0, le=1, description="discount (VAPO: 1.0)")
    critic_lam: float = Field(1.0, ge=0, le=1, description="λ of the returns (critic targets); VAPO: 1.0")
    whiten: bool = Field(True, description="standardise advantages over all action tokens (returns never are)")


@lossplug.advantage(
    "length_adaptive_gae", params=LengthAdaptiveGAEParams, requires=("reward", "value"), layouts=("packed", "padded")
)
def length_adaptive_gae(
    batch: lossplug.PolicyBatch | lossplug.PackedTransitions, p: LengthAdaptiveGAEParams
) -> lossplug.AdvantageResult:
    """VAPO: GAE with λ = 1 − 1/(α·l) per response (l in action tokens), critic λ separate (default 1)."""

    def lam_of(lengths: Tensor) -> Tensor:
        return length_adaptive_lambda(lengths, p.alpha)

    if isinstance(batch, lossplug.PackedTransitions):
        return gae_packed(batch, p.gamma, None, p.critic_lam, p.whiten, lam_of=lam_of)
    return gae_padded(batch, p.gamma, None, p.critic_lam, p.whiten, lam_of=lam_of)
