"""REINFORCE: the plain policy-gradient objective, no ratio and no gate.

Per action token::

    J = A · logp          ∂J/∂logp = A

It is on-policy by construction (``logp`` is assumed to come from the policy that sampled the tokens); for
off-policy data put detached corrections after it (``tis``, ``icepop``), which reproduces verl's
``compute_policy_loss_reinforce`` with ``rollout_is_weights``. The value of ``J`` is a surrogate whose gradient is
the policy gradient; it is not an estimate of the return.

Detach/gradient contract: the advantage is a constant (explicitly detached); gradient flows through ``logp`` only.
Needs no log-probs besides ``logp``; every action token is active.

Paper: Williams, 1992, *Simple Statistical Gradient-Following Algorithms for Connectionist Reinforcement
Learning*, Machine Learning 8, 229–256.

Reference: verl ``compute_policy_loss_reinforce``.
"""

from __future__ import annotations

import lossplug


@lossplug.gate("reinforce")
def reinforce(inp: lossplug.GateInput, p: lossplug.NoParams) -> lossplug.GateOutput:
    """REINFORCE: A·logp."""
    return lossplug.GateOutput(objective=inp.broadcast_advantage() * inp.logp, active=lambda: inp.mask)
