"""zero_variance keeps what SkyRL 0.3.0's zero_variance_filter keeps (trainer.algorithm.zero_variance_filter, tol 0):
its function compiled alone from the published wheel, on scattered groups with singletons, equal and mixed rewards,
and responses already out of play (SkyRL's "live" trajectories)."""

from __future__ import annotations

import ast
from collections import defaultdict
from typing import Optional

import torch

import lossplug


def skyrl_zero_variance_filter(origins):
    source = (origins.package("skyrl") / "train" / "utils" / "trainer_utils.py").read_text()
    (node,) = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "zero_variance_filter"]
    namespace = {"defaultdict": defaultdict, "List": list, "Optional": Optional}  # (SkyRL's annotations)
    exec(compile(ast.Module([node], type_ignores=[]), "skyrl/train/utils/trainer_utils.py", "exec"), namespace)
    return namespace["zero_variance_filter"]


def test_the_kept_responses_are_skyrls(origins):
    keep_indices = skyrl_zero_variance_filter(origins)
    g = torch.Generator().manual_seed(4)
    B, T = 24, 6
    group_id = torch.randint(0, 8, (B,), generator=g)  # scattered groups, some of one response
    reward = torch.randint(0, 2, (B,), generator=g).double()
    reward[group_id == 3] = 1.0  # an all-equal group
    mask = torch.ones(B, T, dtype=torch.bool)
    batch = lossplug.PolicyBatch(
        logp=torch.full((B, T), -1.0, dtype=torch.float64), action_mask=mask, reward=reward, group_id=group_id
    )
    recipe = {"filters": ["zero_variance"], "advantage": "grpo", "gates": ["ppo_clip"], "reduction": "token"}
    kept = lossplug.estimate_advantages(batch, recipe).action_mask.any(-1)
    expected = keep_indices(reward.tolist(), [str(int(i)) for i in group_id], [[1] * T] * B, tol=0.0)
    assert kept.nonzero().squeeze(-1).tolist() == sorted(expected)
    assert not kept.all(), "nothing was dropped: the test would prove nothing"
