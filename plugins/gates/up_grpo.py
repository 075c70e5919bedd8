"""UP-GRPO, J = A·logp where A > 0, max(min(r·A, clip(r, 1 − eps_low, 1 + eps_high)·A), c·A) where A ≤ 0: unbounded
positive updates (Pengfei Liu, 2026-02-26, *UP-GRPO: Unbounded Positive Group Relative Policy Optimization*, a
preprint blog post with no arXiv id, rocfly88.github.io/2026/02/26/UP-GRPO.html); re-derived from the post's own
``compute_policy_loss`` (its appendix; github.com/rocfly88/rocfly88.github.io, ``_posts/2026-02-26-UP-GRPO.md``,
commit 36e29421e637e4440f9f1e3b474cdb656add9acd).

Per action token, with ``r = exp(clamp(logp − old_logp, ±log_ratio_clamp))`` and advantage ``A``::

    A > 0:   J = A · logp                                             ∂J/∂logp = A
    A ≤ 0:   J = max(min(r·A, clip(r, 1 − eps_low, 1 + eps_high)·A), c·A)    (verl's dual-clip PPO)

A positive-advantage token drops the importance ratio and every clip — advantage-weighted SFT on the model's own
successful rollouts, a gradient ``A`` whatever ``π_θ/π_old`` has become — while a negative one keeps PPO's trust
region and the dual clip (``c = dual_clip_c``), which the post's code always applies (it asserts ``c > 1``, default
3.0). ``A = 0`` gives value and gradient 0. The value is a surrogate: on the positive path it is ``A·logp``, not a
ratio, so the loss is not PPO's even at ``r = 1`` (the gradient is: ``A`` for every token).

Choices the post leaves to code, made as its code makes them: the negative path is verl's
``compute_policy_loss_vanilla`` with ``cliprange_low``/``cliprange_high`` (both default to ``eps``: 0.2 here, as
verl's ``clip_ratio``) and ``clip_ratio_c``; the sign split is ``A > 0`` (a zero advantage takes the clipped path).
The post's code does not clamp the log-ratio; here it is clamped to ±20 before ``exp`` (verl's and ``ppo_clip``'s
safety clamp), which changes nothing on the negative path with the dual clip (past ``e^20`` the objective is the
constant ``c·A``, below ``e^−20`` the constant ``(1 − eps_low)·A``) and is never read on the positive one.

Metrics, fractions of all action tokens: ``positive_frac`` (the advantage-weighted SFT path, ``A > 0``),
``clip_frac_low`` (``A < 0`` and ``r < 1 − eps_low``: the lower clip cuts; the post's ``pg_clipfrac`` is this count
over the ``A ≤ 0`` tokens instead) and ``clip_frac_dual`` (``A < 0`` and the surrogate below ``c·A``).

>>> import torch, lossplug
>>> old = torch.log(torch.full((1, 3), 0.5))
>>> logp = (old + torch.log(torch.tensor([[5.0, 5.0, 0.5]]))).clamp(max=0).requires_grad_()   # ratios 2, 2, 0.5
>>> batch = lossplug.PolicyBatch(logp=logp, old_logp=old, advantage=torch.tensor([[2.0, -1.0, -1.0]]),
...                              action_mask=torch.ones(1, 3, dtype=torch.bool))
>>> result = lossplug.policy_loss(batch, {"gates": ["up_grpo"], "reduction": "sequence_sum"})
>>> result.loss.backward()
>>> [round(-g, 6) + 0.0 for g in logp.grad[0].tolist()]   # A unclipped at r = 2; r·A = −2; cut at r = 0.5
[2.0, -2.0, 0.0]

Paper: Liu, 2026, *UP-GRPO* (preprint blog post, no arXiv id), rocfly88.github.io/2026/02/26/UP-GRPO.html.

Reference: rocfly88/rocfly88.github.io (commit 36e29421e637e4440f9f1e3b474cdb656add9acd)
``_posts/2026-02-26-UP-GRPO.md``, its ``compute_policy_loss``.
"""

from __future__ import annotations

import functools

import torch
from pydantic import Field

import lossplug
from lossplug.ops import clamp_exact


class UPGRPOParams(lossplug.Params):
    eps_low: float = Field(
        0.2, gt=0, lt=1, description="lower clip of the negative path: ratios below 1 − eps_low are cut where A < 0"
    )
    eps_high: float = Field(
        0.2, gt=0, description="upper clip of the negative path (for A < 0 it never binds in the min, as in PPO)"
    )
    dual_clip_c: float = Field(
        3.0, gt=1, description="dual-clip bound c·A of the negative path (the post's clip_ratio_c, default 3.0)"
    )
    log_ratio_clamp: float = Field(20.0, gt=0, description="the log-ratio is clamped to ± this before exp")


@lossplug.gate("up_grpo", params=UPGRPOParams, requires=("old_logp",))
def up_grpo(inp: lossplug.GateInput, p: UPGRPOParams) -> lossplug.GateOutput:
    """UP-GRPO: A·logp where A > 0 (no ratio, no clip); dual-clip PPO where A ≤ 0."""
    adv = inp.broadcast_advantage()
    ratio = clamp_exact(inp.update_log_ratio(), -p.log_ratio_clamp, p.log_ratio_clamp).exp()
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - p.eps_low, 1 + p.eps_high) * adv)
    bound = p.dual_clip_c * adv
    negative_path = torch.maximum(surrogate, bound)  # for A ≤ 0; where A > 0 it is discarded below
    positive = adv > 0
    objective = torch.where(positive, adv * inp.logp, negative_path)

    # Off the actions the cleaned log-ratio is 0 (r = 1): never below 1 − eps_low nor past the dual bound
    # (min(A, A) = A > c·A for A < 0), so the cuts need no mask pass; ``positive`` does (a [B, 1] advantage is the
    # response's off the actions too).
    @functools.cache
    def cut() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        negative = adv < 0
        return {"low": (ratio < 1 - p.eps_low, negative), "dual": (surrogate < bound, negative)}

    def fraction(side: str) -> torch.Tensor:
        return inp.token_fraction(*cut()[side], false_off_actions=True)

    def active() -> torch.Tensor:
        (low, neg), (dual, _) = cut()["low"], cut()["dual"]
        return ~(neg & (low | dual))

    return lossplug.GateOutput(
        objective=objective,
        metrics={
            "positive_frac": lambda: inp.token_fraction(positive),
            "clip_frac_low": lambda: fraction("low"),
            "clip_frac_dual": lambda: fraction("dual"),
        },
        active=active,
    )
