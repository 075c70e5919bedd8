"""Kimi k1.5's policy loss: the policy gradient with a squared log-ratio penalty that keeps π_θ near π_old.

Objective per action token, with ``δ = logp − old_logp`` (log π_θ/π_old) and advantage ``A``::

    J = A · logp − τ/2 · δ²                 ∂J/∂logp = A − τ · δ

At ``π_θ = π_old`` the penalty and its gradient vanish, so the gradient is the plain policy gradient ``A``; as the
policy drifts from the one that sampled the data, the penalty pulls each token's log-prob back towards it. The
penalty does not depend on the advantage: a token with ``A = 0`` still gets the gradient ``−τ·δ`` (by design; the
conformance kit's zero-advantage invariant does not hold off ratio 1).

The paper's equation (3) squares the log-ratio of the whole response (``log π_θ(y|x) − log π_i(y|x)``, a sum over
its tokens) and uses the mean reward of the prompt's samples as the baseline of ``A`` (the ``grpo`` advantage with
``scale: none``); ROLL applies the penalty per token, as here.

Detach/gradient contract: ``old_logp`` and the advantage are constants; gradient flows through ``logp`` only — in
both terms. No token is cut: every action token is active.

Paper: Kimi Team, 2025, *Kimi k1.5: Scaling Reinforcement Learning with LLMs*, arXiv:2501.12599 (equation 3).

Reference: ROLL (alibaba/ROLL, commit 8eb27cc) ``roll/pipeline/rlvr/actor_pg_worker.py``
``ActorPGWorker._compute_kimi15_loss`` (``pg_variant: kimi15``, ``kimi15_tau``, default 0.1):
``−A·logp + τ·½·(logp − old_logp)²`` per token, aggregated by ``loss_agg_mode``.
"""

from __future__ import annotations

from pydantic import Field

import lossplug


class Kimi15Params(lossplug.Params):
    tau: float = Field(
        0.1,
        ge=0,
        allow_inf_nan=False,
        description="τ, the weight of the penalty τ/2·(logp − old_logp)² (ROLL's kimi15_tau, default 0.1)",
    )


@lossplug.gate("kimi15", params=Kimi15Params, requires=("old_logp",))
def kimi15(inp: lossplug.GateInput, p: Kimi15Params) -> lossplug.GateOutput:
    """Kimi k1.5: A·logp − τ/2·(logp − old_logp)², the penalty's gradient −τ·(logp − old_logp)."""
    log_ratio = inp.update_log_ratio()  # 0 off the actions: the penalty vanishes there
    penalty = 0.5 * p.tau * log_ratio.square()
    objective = inp.broadcast_advantage() * inp.logp - penalty
    return lossplug.GateOutput(
        objective=objective,
        metrics={"penalty_mean": lambda: inp.masked_mean(penalty.detach())},
        details={"log_ratio_abs_mean": lambda: inp.masked_mean(log_ratio.detach().abs())},
        active=lambda: inp.mask,
    )
