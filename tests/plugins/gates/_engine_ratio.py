"""What the tests of the corrections on the engine ratio (π_old/π_behaviour: engine_divergence_mask,
outlier_sequence_mask) share: their fields and the weight a correction returns on them."""

from __future__ import annotations

import torch

import lossplug
from lossplug.testing.batches import policy_fields


def engine_fields(B: int, T: int, seed: int, scale: float = 0.8) -> dict:
    """Float64 policy fields with behaviour log-probs and a per-token advantage; every response has an action."""
    f = policy_fields(B, T, seed=seed, log_ratio_scale=scale, token_advantage=True)
    f["action_mask"][:, 0] = True
    return {k: f[k] for k in ("logp", "old_logp", "behavior_logp", "advantage", "action_mask")}


def correction_weight(gate: str, params: dict, f: dict) -> torch.Tensor:
    """The weight the registered gate ``gate`` returns on the fields ``f``, called directly on the pipeline's input."""
    inp = lossplug.GateInput.from_batch(lossplug.PolicyBatch(**f))
    plugin = lossplug.registry().plugins["gate"][gate]
    return plugin.fn(inp, plugin.params(**params)).weight
