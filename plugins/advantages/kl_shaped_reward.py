"""KL-shaped token rewards (RLHF-PPO, seed 2's ``compute_rewards``).

With ``kl_t = logp_t − ref_logp_t`` (the k1 estimate of KL[π‖π_ref] on the sampled token) and β the KL coefficient::

    non_score_t = −β · kl_t                   on every action token
    reward_t    = non_score_t                 for t ≠ T
    reward_T    = non_score_T + score         T = the LAST ACTION token of the response

Every output is exactly zero off the action positions (prompt, observation/tool and padding tokens), whatever the
log-probs hold there (NaN/inf included: they are never read). "Last action token" is found from ``action_mask``,
not from the padding: it works with left or right padding and with interior non-action tokens (multi-turn).

``logp`` should be the log-probs of the policy that *sampled* the response (``old_logp`` at advantage time), as in
TRL's PPOTrainer and verl's ``apply_kl_penalty`` (``old_log_probs − ref_log_prob``). The function itself is plain
differentiable tensor code; call it under ``torch.no_grad()`` when it feeds an advantage estimator.
"""

from __future__ import annotations

import torch

from lossplug.contracts import LossplugError
from lossplug.contracts.errors import describe_positions

Tensor = torch.Tensor


def last_action_index(action_mask: Tensor) -> Tensor:
    """Position of the last action token of every row, ``[B]`` (``-1`` for a row without any action)."""
    mask = action_mask if action_mask.dtype == torch.bool else action_mask != 0
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, -1).amax(-1)


def kl_shaped_rewards(score: Tensor, logp: Tensor, ref_logp: Tensor, action_mask: Tensor,
                      beta: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token rewards ``-β·(logp − ref_logp)`` with ``score`` added at the last action token.

    Args:
        score: ``[B]`` sequence score (reward model / verifier).
        logp, ref_logp: ``[B, T]`` log-probs of the sampled tokens under the sampling policy and the reference.
        action_mask: ``[B, T]`` True (or non-zero) on action tokens; every row needs at least one.
        beta: the KL coefficient (``kl_ctl.value`` in TRL, ``kl_coef`` in verl).

    Returns:
        ``(rewards, non_score_rewards, kl)``, each ``[B, T]`` and zero off action tokens.
    """
    if logp.ndim != 2 or logp.shape != ref_logp.shape or logp.shape != action_mask.shape:
        raise LossplugError(f"kl_shaped_rewards: logp, ref_logp and action_mask must be aligned [B, T] tensors, got "
                            f"{list(logp.shape)}, {list(ref_logp.shape)}, {list(action_mask.shape)}")
    if score.shape != logp.shape[:1]:
        raise LossplugError(f"kl_shaped_rewards: score must be [B={logp.shape[0]}] (one score per response), got "
                            f"{list(score.shape)}")
    mask = action_mask if action_mask.dtype == torch.bool else action_mask != 0
    last = last_action_index(mask)
    empty = last < 0
    if bool(empty.any()):
        raise LossplugError(f"kl_shaped_rewards: action_mask: every response needs at least one action token to "
                            f"carry its score — {describe_positions(empty)}")
    dtype = torch.promote_types(logp.dtype, ref_logp.dtype)
    kl = torch.where(mask, logp.to(dtype) - ref_logp.to(dtype), 0)
    non_score = torch.where(mask, -beta * kl, 0)
    rewards = non_score.scatter_add(1, last.unsqueeze(-1), score.to(dtype).unsqueeze(-1))
    return rewards, non_score, kl
