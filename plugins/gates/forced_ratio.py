"""NeMo-RL's ``force_on_policy_ratio``: the update ratio forced to 1 in value, its gradient kept.

Per action token::

    r = exp(logp − sg(logp))      (= 1 exactly)
    J = r · A                     ∂J/∂logp = A

Truly on-policy training (one update per rollout: the policy that sampled the tokens is the policy being updated)
needs no old-policy forward pass: NeMo-RL then uses ``curr_logprobs.detach()`` as ``prev_logprobs``, so every ratio
is 1 and PPO's clip, with or without dual-clip (``ratio_clip_c``), never binds — its loss reduces to ``−A·r``. The
gradient is REINFORCE's (:mod:`reinforce <lossplug.plugins.gates.reinforce>`, ``J = A·logp``); the value differs:
``J = A`` (the mean advantage the trainer logs) instead of ``A·logp``. Needs no log-probs besides ``logp``.

Alias: NeMo-RL's ``ClippedPGLossFn`` with ``force_on_policy_ratio: true`` (and ``use_cispo: false``) is
``{name: force_on_policy}`` whatever ``ratio_clip_min``/``ratio_clip_max``/``ratio_clip_c`` say; its token-level
loss (``token_level_loss: true``) reduces with ``token``, its sequence-level one with ``response``. Its off-policy
correction then weighs the engine ratio ``exp(logp.detach() − generation_logprobs)``: give the batch
``old_logp = logp.detach()`` and add ``tis``/``icepop``/``seq_mask_tis`` after this gate.

Detach/gradient contract: ``sg(logp)`` and the advantage are constants; gradient flows through ``logp`` only, and
every action token keeps it.

Reference: NeMo-RL (NVIDIA-NeMo/RL, commit 7ea279ab), ``nemo_rl/algorithms/loss/loss_functions.py``,
``ClippedPGLossFn.__call__`` (``force_on_policy_ratio``: ``log_ratios = curr_logprobs − curr_logprobs.detach()``,
``ratios_clamped = ratios``) and ``ClippedPGLossConfig``.
"""

from __future__ import annotations

import lossplug


@lossplug.gate("force_on_policy")
def force_on_policy(inp: lossplug.GateInput, p: lossplug.NoParams) -> lossplug.GateOutput:
    """Forced on-policy ratio: exp(logp − sg(logp))·A, value A, gradient A."""
    logp = inp.logp
    ratio = (logp - logp.detach()).exp()
    return lossplug.GateOutput(objective=ratio * inp.broadcast_advantage(), active=lambda: inp.mask)
