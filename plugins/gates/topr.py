"""TOPR, Tapered Off-Policy REINFORCE: plain REINFORCE on the positive samples, a ratio truncated to [0, 1] on the
negative ones.

Objective per action token, with ``r = exp(logp − old_logp)`` and advantage ``A``::

    J = w₊ · A · logp                          on positive samples      ∂J/∂logp = w₊ · A
    J = w₋ · sg(clamp(r, 0, 1)) · A · logp     on negative samples      ∂J/∂logp = w₋ · min(r, 1) · A

A positive sample is pushed up as in supervised fine-tuning, whatever its ratio (no importance weight, so its
gradient never vanishes); a negative one is pushed down only as far as the current policy still gives it at most
the probability it had when sampled — the truncated weight tapers the push once ``π_θ < π_old`` and never amplifies
it. Which samples are positive is ``split_on``:

* ``advantage`` (default): the token's advantage, ``A > 0`` positive, ``A ≤ 0`` negative (for ``A = 0`` both forms
  are 0);
* ``reward``: the response's score ``> 0`` (a ``[B]`` reward, or the sum of a ``[B, T]`` reward over the response's
  action tokens), as ROLL splits on ``scores`` — the paper's ``T⁺``/``T⁻`` by the sign of ``R(τ)``.

The paper's ratio is the trajectory's ``π(τ)/μ(τ)``; ROLL truncates the per-token ratio, as here. ``exp`` needs no
clamp: ``clamp(inf, 0, 1) = 1`` and ``exp(−∞) = 0``.

Detach/gradient contract: the truncated ratio is explicitly ``.detach()``-ed (computed under ``no_grad``), the
advantage and ``old_logp`` are constants; gradient flows through the ``logp`` factor only. No token is cut:
every action token stays active.

Paper: Le Roux et al., 2025, *Tapered Off-Policy REINFORCE: Stable and efficient reinforcement learning for LLMs*,
arXiv:2503.14286 (equation 8).

Reference: ROLL (alibaba/ROLL, commit 8eb27cc) ``roll/pipeline/rlvr/actor_pg_worker.py``
``ActorPGWorker._compute_topr_loss`` (``pg_variant: topr``, ``topr_positive_weight``, ``topr_negative_weight``,
both 1.0 by default; positive where ``scores > 0``): ``{name: topr, split_on: reward}``.
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from pydantic import Field

import lossplug


class TOPRParams(lossplug.Params):
    positive_weight: float = Field(
        1.0, ge=0, allow_inf_nan=False, description="w₊, the weight of the positive samples' term (ROLL: 1.0)"
    )
    negative_weight: float = Field(
        1.0, ge=0, allow_inf_nan=False, description="w₋, the weight of the negative samples' term (ROLL: 1.0)"
    )
    split_on: Literal["advantage", "reward"] = Field(
        "advantage",
        description="what makes a sample positive: its advantage A > 0 (per token), or its response's reward "
        "> 0 (ROLL's scores; a [B, T] reward is summed over the response's action tokens)",
    )


def _requires(p: TOPRParams) -> tuple[str, ...]:
    return ("old_logp", "reward") if p.split_on == "reward" else ("old_logp",)


def _positive(inp: lossplug.GateInput, p: TOPRParams) -> torch.Tensor:
    """Where the positive form applies: ``[B, T]`` (the advantage's sign) or a ``[B, 1]`` column (the reward's)."""
    if p.split_on == "advantage":
        return inp.broadcast_advantage() > 0
    reward = cast(torch.Tensor, inp.batch.reward).detach()  # declared in requires=: never None here
    if reward.ndim == 2:
        reward = torch.where(inp.mask, reward, 0).sum(-1)
    return (reward > 0).unsqueeze(-1)


@lossplug.gate("topr", params=TOPRParams, requires=_requires)
def topr(inp: lossplug.GateInput, p: TOPRParams) -> lossplug.GateOutput:
    """TOPR: w₊·A·logp on positive samples, w₋·sg(clamp(r, 0, 1))·A·logp on negative ones."""
    positive = _positive(inp, p)
    with torch.no_grad():
        ratio = inp.update_log_ratio().detach().exp()  # 1 off the actions (both log-probs are cleaned to 0)
        negative_coefficient = p.negative_weight * ratio.clamp(0.0, 1.0)
        coefficient = torch.where(positive, p.positive_weight, negative_coefficient)
    objective = coefficient.detach() * inp.broadcast_advantage() * inp.logp

    def negative_fraction() -> torch.Tensor:
        return inp.token_fraction(~positive)  # counted on the action tokens only

    def tapered_fraction() -> torch.Tensor:
        # negative tokens whose ratio is cut to 1 (off the actions r = 1 exactly: never above it)
        return inp.token_fraction(ratio > 1, ~positive, false_off_actions=True)

    return lossplug.GateOutput(
        objective=objective,
        metrics={"negative_frac": negative_fraction, "clip_frac_high": tapered_fraction},
        active=lambda: inp.mask,
    )
