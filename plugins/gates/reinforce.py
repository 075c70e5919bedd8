"""REINFORCE: the plain policy-gradient objective, no ratio and no gate.

Per action token::

    J = A · logp          ∂J/∂logp = A

It is on-policy by construction (``logp`` is assumed to come from the policy that sampled the tokens); for
off-policy data put detached corrections after it (``tis``, ``icepop``), which reproduces verl's
``compute_policy_loss_reinforce`` with ``rollout_is_weights``. The value of ``J`` is a surrogate whose gradient is
the policy gradient; it is not an estimate of the return.

Detach/gradient contract: the advantage is a constant (explicitly detached); gradient flows through ``logp`` only.
Needs no log-probs besides ``logp``; every action token is active.

GPG's policy loss is this objective too: its other ingredient, the group-relative advantage rescaled for the groups
that carry no learning signal, is the ``gpg`` advantage plugin, not a gate.

Paper: Williams, 1992, *Simple Statistical Gradient-Following Algorithms for Connectionist Reinforcement
Learning*, Machine Learning 8, 229–256; Chu et al., 2025, *GPG: A Simple and Strong Reinforcement Learning Baseline
for Model Reasoning*, arXiv:2504.02546.

Reference: verl ``compute_policy_loss_reinforce``; verl ``compute_policy_loss_gpg`` (``loss_mode=gpg``, identical:
``−A·logp``, times ``rollout_is_weights`` when given, aggregated by ``loss_agg_mode``).
"""

from __future__ import annotations

import lossplug


@lossplug.gate("reinforce")
def reinforce(inp: lossplug.GateInput, p: lossplug.NoParams) -> lossplug.GateOutput:
    """REINFORCE: A·logp."""
    return lossplug.GateOutput(objective=inp.broadcast_advantage() * inp.logp, active=lambda: inp.mask)
