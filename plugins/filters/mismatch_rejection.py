"""Tokens or responses whose train/inference mismatch is too large leave the batch — verl's rollout rejection
sampling where verl applies it, to the batch's response mask, so that they leave every denominator::

    log ρ_t = clamp(old_logp_t − behavior_logp_t, ±20)          ρ = π_old / π_behaviour (the engine ratio)
    k1_t = −log ρ_t      k2_t = ½ (log ρ_t)²      k3_t = ρ_t − 1 − log ρ_t

and each criterion of ``options`` (``token_k1|k2|k3``; ``seq_sum_k*``, ``seq_mean_k*``, ``seq_max_k2|k3`` over the
response's action tokens) keeps a ``k1`` statistic inside ``[log lower, log upper]`` and a ``k2``/``k3`` statistic
below its upper bound; a token stays when every criterion keeps it (and its response). ``threshold``: verl's
``rollout_rs_threshold`` syntax (one per option or one for all; ``"lower_upper"`` for ``k1``).

The same criteria as the ``rollout_rs`` correction gate (one implementation,
``lossplug.plugins.gates.rollout_rejection.survivors``); the gate weighs a rejected token 0 but keeps it in the
denominators, this filter removes it from them, as verl's driver does — exact under every reduction.

Reference: verl 0.9.1 ``verl.trainer.ppo.rollout_corr_helper.compute_rollout_rejection_mask``
(``algorithm.rollout_correction.rollout_rs``, ``rollout_rs_threshold``), applied to ``response_mask``.
"""

from __future__ import annotations

import torch

import lossplug
from lossplug.plugins.gates.rollout_rejection import RolloutRSParams, survivors

Tensor = torch.Tensor


@lossplug.filter("mismatch_rejection", params=RolloutRSParams, requires=("old_logp", "behavior_logp"))
def mismatch_rejection(inp: lossplug.RolloutInput, p: RolloutRSParams) -> lossplug.FilterOutput:
    """Remove tokens or responses whose engine mismatch π_old/π_behaviour fails verl's rollout_rs criteria."""
    gate_input = lossplug.GateInput.from_batch(inp.batch)
    keep, metrics, _ = survivors(gate_input, p)
    return lossplug.FilterOutput(keep=keep, metrics=metrics)
