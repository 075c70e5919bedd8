"""Entropy-based advantage shaping, ``A ← A + min(α·H_t, |A|/κ)`` (``H_t`` detached), as the detached factor
``w_t = (A_t + ψ_t) / A_t`` on the update gate's objective (Cheng et al., arXiv:2506.14758).

With ``H_t`` the current policy's entropy at action token ``t`` (``PolicyBatch.entropy``, read without gradient) and
``A_t`` the token's advantage, the paper adds a clipped, gradient-detached bonus to the advantage::

    ψ_t = min(α · H_t, |A_t| / κ)          α > 0, κ > 1
    A_t^shaped = A_t + ψ_t

and trains on ``A^shaped`` wherever the policy-gradient objective reads ``A`` (PPO's clipped surrogate, or GRPO's).
The clip ``|A_t|/κ`` with ``κ > 1`` keeps the bonus from reversing the sign of a negative advantage:
``A < 0 ⇒ A + ψ ≤ A·(1 − 1/κ) < 0``, ``A > 0 ⇒ A + ψ > 0``, ``A = 0 ⇒ ψ = 0``.

Where it sits in the pipeline. lossplug's stages compose an update gate (the objective) with detached corrections
that multiply it. Because the shaped advantage keeps the advantage's sign, it is the advantage times a detached
positive factor::

    w_t = A_t^shaped / A_t = 1 + sign(A_t) · min(α·H_t / |A_t|, 1/κ)   ∈ [1 − 1/κ, 1 + 1/κ]    (w_t = 1 where A_t = 0)

and every update gate whose objective is positively homogeneous in each token's advantage for a given sign —
``f(r, c·A) = c·f(r, A)`` for ``c > 0`` — gives exactly ``f(r, A^shaped) = w · f(r, A)``, value and gradient: the
clipping decisions depend on the ratio and the sign of ``A`` only, and the sign does not change. So this is a
correction gate (``role="correction"``, token level) placed after such an update gate, like the paper's one-line
change before the loss: nothing else in the recipe changes, and ``w`` is detached, so the gradient flows only
through the update gate's ratio (``logp``), as the paper's ``H^detach``. Checked built-ins
(``tests/plugins/gates/test_entropy_advantage.py``): exact behind ``ppo_clip`` (the paper's PPO and GRPO),
``reinforce``, ``gspo``, ``gspo_token``, ``sapo``, ``sapo_seq``, ``cispo``, ``cispo_seq``, ``dis``, ``dppo_tv``,
``dppo_kl``, ``decoupled_ppo``, ``topr``, ``vespo``; not behind a gate with a term that does not scale with ``A``
(``dro``, ``kimi15``, ``ipo``, ``dppo_binary_tv``: a ``(log r)²`` penalty; ``kl_cov``: a selection by covariance
with ``A``) or one that pools a response's token advantages into one number (``gmpo``).

``κ`` must be > 1, as the paper states (a ``κ ≤ 1`` bonus can zero or flip a negative advantage, which no factor on the
objective reproduces). The defaults ``α = 0.4``, ``κ = 2`` are those of a public verl reimplementation (MEDS,
arXiv:2604.11297, ``verl/workers/actor/dp_actor.py``:
``advantages += torch.min(0.4 * entropy.detach(), advantages.abs() / 2)``); the paper's stated constraints are
``α > 0``, ``κ > 1``. Entropy is read at loss time, per micro-batch, from the current policy's forward pass (TRL:
``_get_per_token_logps_and_entropies``); verl's policy-loss seam receives no entropies, so its adapter refuses the
gate.

Paper: Cheng et al., 2025, *Reasoning with Exploration: An Entropy Perspective*, arXiv:2506.14758.

Reference: the paper's ``ψ(H_t) = min(α·H_t^detach, |A_t|/κ)``, ``A_t^shaped = A_t + ψ(H_t)``, as verl
reimplementations apply it: ``torch.min(alpha * entropy.detach(), advantages.abs() / kappa)`` added to the advantages
in the actor's update, before verl's ``compute_policy_loss`` (tested against verl 0.9.1's
``compute_policy_loss_vanilla`` on the shaped advantage).

A token with ``A = 1`` and ``H = 0.5`` nats gets ``ψ = min(0.2, 0.5) = 0.2`` (factor 1.2); one with ``A = −1`` and
``H = 3`` the cap ``ψ = min(1.2, 0.5) = 0.5`` (factor 0.5). With ``ppo_clip`` before it, the loss is PPO's on the
shaped advantages ``1.2`` and ``−0.5``:

>>> import torch, lossplug
>>> f64 = dict(dtype=torch.float64)
>>> batch = lossplug.PolicyBatch(
...     logp=torch.tensor([[-1.0], [-1.0]], **f64), old_logp=torch.tensor([[-1.0], [-1.0]], **f64),
...     action_mask=torch.tensor([[True], [True]]), advantage=torch.tensor([1.0, -1.0], **f64),
...     entropy=torch.tensor([[0.5], [3.0]], **f64))
>>> plugin = lossplug.registry().plugins["gate"]["entropy_advantage"]
>>> plugin(lossplug.GateInput.from_batch(batch), plugin.params()).weight.flatten().tolist()
[1.2, 0.5]
>>> recipe = {"gates": ["ppo_clip", "entropy_advantage"], "reduction": "token"}
>>> round(lossplug.policy_loss(batch, recipe).loss.item(), 12)      # −(1.2 − 0.5) / 2 tokens
-0.35
"""

from __future__ import annotations

from typing import cast

import torch
from pydantic import Field

import lossplug

Tensor = torch.Tensor


class EntropyAdvantageParams(lossplug.Params):
    alpha: float = Field(
        0.4, gt=0, allow_inf_nan=False, description="α: the bonus per nat of entropy, α·H_t (paper: α > 0)"
    )
    kappa: float = Field(
        2.0,
        gt=1,
        allow_inf_nan=False,
        description="κ: the bonus is at most abs(A_t)/κ (paper: κ > 1, so it never reverses a negative advantage)",
    )


@lossplug.gate(
    "entropy_advantage", params=EntropyAdvantageParams, requires=("entropy",), role="correction", level="token"
)
def entropy_advantage(inp: lossplug.GateInput, p: EntropyAdvantageParams) -> lossplug.GateOutput:
    """Detached factor ``(A + min(α·H, |A|/κ)) / A`` (1 where ``A = 0``): the update gate's objective as if it had
    read the entropy-shaped advantage.

    Paper: Cheng et al., 2025, *Reasoning with Exploration: An Entropy Perspective*, arXiv:2506.14758.

    """
    with torch.no_grad():
        entropy = cast(Tensor, inp.entropy).detach()  # required; zero off the actions
        adv = inp.advantage  # detached, zero off the actions
        bonus = torch.minimum(p.alpha * entropy, adv.abs() / p.kappa)
        nonzero = adv != 0
        # (A + ψ)/A as 1 + ψ/A: where A = 0 the bonus is 0 and the factor 1 (the objective is 0 there anyway)
        weight = torch.where(nonzero, 1 + bonus / torch.where(nonzero, adv, 1), 1.0)
        capped = (p.alpha * entropy > adv.abs() / p.kappa) & nonzero
    return lossplug.GateOutput(
        weight=weight,
        metrics={"capped_frac": lambda: inp.token_fraction(capped, false_off_actions=True)},
        details={"bonus_mean": lambda: inp.masked_mean(bonus)},
        # it never cuts: w ∈ [1 − 1/κ, 1 + 1/κ] with κ > 1, so every action token still carries gradient
        active=lambda: inp.mask,
    )
