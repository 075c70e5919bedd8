"""DRO: the policy gradient with a quadratic penalty on the update log-ratio.

Per action token, with ``log r = logp − old_logp``::

    J = A · logp − (beta / 2) · (log r)²            ∂J/∂logp = A − beta · log r

The penalty is a soft trust region around the old policy (``½(log r)²`` is the k2 estimator of KL(π_old ‖ π_θ)),
reduced like the objective — so unlike a ratio clip it acts on every action token, including those with ``A = 0``:
with a zero advantage the gradient is ``−beta·log r``, not 0 (by design).

verl has no default for ``beta`` (``policy_loss.dro_beta`` must be set; its documentation's example is 0.05, the
default here).

Detach/gradient contract: ``old_logp`` and the advantage are constants; gradient flows through ``logp`` only (in both
terms).

Paper: Richemond et al., 2024, *Offline Regularized Reinforcement Learning for Large Language Models Alignment*
(Direct Reward Optimisation), arXiv:2405.19107.

Reference: verl ``compute_policy_loss_dro`` (``loss_mode=dro``, ``policy_loss.dro_beta``).
"""

from __future__ import annotations

from pydantic import Field

import lossplug


class DROParams(lossplug.Params):
    beta: float = Field(
        0.05, gt=0, description="coefficient of the quadratic log-ratio penalty (verl: policy_loss.dro_beta)"
    )


@lossplug.gate("dro", params=DROParams, requires=("old_logp",))
def dro(inp: lossplug.GateInput, p: DROParams) -> lossplug.GateOutput:
    """DRO: A·logp − (beta/2)·(logp − old_logp)²."""
    log_ratio = inp.update_log_ratio()
    objective = inp.broadcast_advantage() * inp.logp - 0.5 * p.beta * log_ratio.square()
    return lossplug.GateOutput(objective=objective, active=lambda: inp.mask)
