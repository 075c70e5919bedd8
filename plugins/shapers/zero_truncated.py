"""A truncated response earns no score: ``reward ← 0`` for every response that did not end on its own (cut at the
length limit, no EOS), so the policy is not taught by the score of an unfinished answer::

    reward_i ← 0   where not terminated_i

(a per-token reward: every token of the row). Put it before ``kl_in_reward`` to keep the KL penalty on truncated
responses, as AReaL does (its KL rewards are computed apart and only the score is masked).

Reference: AReaL ``PPOActor.compute_advantages`` (inclusionAI/AReaL 5ac9adf, ``areal/engine/ppo/actor.py``:
``mask_no_eos_with_zero`` — ``torch.where(seq_no_eos_mask, 0, reward_score)`` added at the last token).
"""

from __future__ import annotations

import torch

import lossplug

Tensor = torch.Tensor


@lossplug.shaper("zero_truncated", requires=("terminated",))
def zero_truncated(inp: lossplug.RolloutInput, p: lossplug.NoParams) -> lossplug.ShaperOutput:
    """reward ← 0 for responses that did not terminate (AReaL's mask_no_eos_with_zero)."""
    batch = inp.batch
    assert batch.reward is not None and batch.terminated is not None
    truncated = ~batch.terminated
    reward = batch.reward
    keep = truncated.unsqueeze(-1) if reward.ndim == 2 else truncated
    return lossplug.ShaperOutput(
        reward=torch.where(keep, torch.zeros((), dtype=reward.dtype), reward),
        metrics={"truncated_fraction": lambda: truncated.float().mean()},
    )
