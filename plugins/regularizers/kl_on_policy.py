"""KL to the reference with the score-function weight (NeMo-RL's ``reference_policy_kl_penalty``): the estimate's
value, and the gradient of its expectation under the *current* policy.

Per action token, with ``δ = ref_logp − logp`` (NeMo-RL's ``logr``) clamped to ``± input_clamp``::

    k1 = −δ        k2 = δ²/2        k3 = exp(δ) − 1 − δ
    w  = exp(logp − sg(logp))        (weight: self — value 1, gradient ∇logp)
    w  = exp(logp − behavior_logp)   (weight: behavior — NeMo-RL's use_on_policy_kl_approximation, not detached)
    term = clamp(w · k, ± output_clamp)

The tokens are samples of the policy, so ``∇ E_π[k] = E_π[∇k + k·∇log π]``: the weight adds the score-function
term ``k·∇logp`` that a plain estimate (``kl``) drops — with ``weight: self`` the value is the estimate's and the
gradient ``∇k + k·∇logp``; with ``weight: behavior`` the tokens are importance-weighted from the rollout policy.
Where the input clamp binds, the weight is detached too (the clamp then suppresses both gradients), and outside the
output clamp the term is constant — both as NeMo-RL. A weight that is not finite becomes 0 (NeMo-RL's
``nan_to_num``). ``coef`` defaults to NeMo-RL's 0.01; the term is reduced with the recipe's reduction (NeMo-RL:
``token_level_loss: true`` → ``token``, false → ``response``).

Paper: Schulman, 2020, *Approximating KL Divergence*, http://joschu.net/blog/kl-approx.html (k1, k2, k3).

Reference: NeMo-RL (NVIDIA-NeMo/RL, commit 7ea279ab), ``nemo_rl/algorithms/loss/loss_functions.py``
``ClippedPGLossFn.__call__`` (``kl_importance_weights = exp(curr − curr.detach())``, or ``exp(curr −
generation_logprobs)`` with ``use_on_policy_kl_approximation``) and ``nemo_rl/algorithms/utils.py`` ``calculate_kl``
(``reference_policy_kl_type``, ``kl_input_clamp_value`` 20, ``kl_output_clamp_value`` 10).
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from pydantic import Field

import lossplug

Tensor = torch.Tensor


class KLOnPolicyParams(lossplug.RegularizerParams):
    coef: float = Field(
        0.01, allow_inf_nan=False, description="the KL coefficient (NeMo-RL's reference_policy_kl_penalty, 0.01)"
    )
    estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Schulman's estimator (reference_policy_kl_type)")
    weight: Literal["self", "behavior"] = Field(
        "self",
        description="self: exp(logp − sg(logp)), the score-function weight; behavior: exp(logp − behavior_logp) "
        "(use_on_policy_kl_approximation)",
    )
    input_clamp: float | None = Field(20.0, gt=0, description="clamp of ref − logp (kl_input_clamp_value; null: none)")
    output_clamp: float | None = Field(10.0, gt=0, description="clamp of the weighted term (kl_output_clamp_value)")


def _requires(p: KLOnPolicyParams) -> tuple[str, ...]:
    return ("ref_logp", "behavior_logp") if p.weight == "behavior" else ("ref_logp",)


@lossplug.regularizer("kl_on_policy", params=KLOnPolicyParams, requires=_requires)
def kl_on_policy(inp: lossplug.GateInput, p: KLOnPolicyParams) -> lossplug.RegularizerOutput:
    """``β · reduce(clamp(w · k(ref − logp)))``, w = exp(logp − sg(logp)) (or − behavior_logp): the KL with its
    score-function gradient ``∇k + k·∇logp``."""
    logp, ref = inp.logp, cast(Tensor, inp.ref_logp)  # ref_logp: declared in requires=
    anchor = logp.detach() if p.weight == "self" else cast(Tensor, inp.behavior_logp)
    log_weight = logp - anchor
    # a weight that overflows becomes 0 (NeMo-RL's nan_to_num): decided on the value, then exp only where it is
    # finite, so the dropped branch carries no 0·inf = NaN into the gradient
    finite = torch.isfinite(log_weight.detach().exp())
    zero = torch.zeros_like(log_weight)
    weight = torch.where(finite, torch.exp(torch.where(finite, log_weight, zero)), zero)
    delta = ref - logp
    if p.input_clamp is not None:
        clamped = delta.clamp(-p.input_clamp, p.input_clamp)
        weight = torch.where(delta == clamped, weight, weight.detach())
        delta = clamped
    if p.estimator == "k1":
        estimate = -delta
    elif p.estimator == "k2":
        estimate = delta.square() / 2
    else:
        estimate = torch.exp(delta) - 1 - delta
    term = weight * estimate
    if p.output_clamp is not None:
        term = term.clamp(-p.output_clamp, p.output_clamp)
    return lossplug.RegularizerOutput(term=term, metrics={"token_mean": lambda: inp.masked_mean(term.detach())})
