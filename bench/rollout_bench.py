"""Item 6: what a recipe's shapers and filters (the rollout side) cost, against the loss step they feed.

The rollout stages run once per rollout batch, inside ``estimate_advantages``; the loss step runs over the same
batch (forward + backward, ``validate="full"``, basic metrics — what the adapters run). Timed interleaved on the
same tensors: the advantage stage with the rollout stages (``kl_in_reward`` with the adaptive controller,
``reward_clip``, ``zero_variance``) and without them (the same ``grpo`` alone), and the ppo_clip + token loss step.
The headline is the difference of the two advantage medians as a fraction of the loss step's median; the rollout
stages' own share is also reported against the advantage stage.
"""

from __future__ import annotations

import torch

import lossplug

from .common import interleaved

ROLLOUT = {
    "shapers": [
        {"name": "kl_in_reward", "coef": 0.01, "controller": "adaptive", "target_kl": 0.1, "horizon": 10000},
        {"name": "reward_clip", "low": -1.0, "high": 1.0},
    ],
    "filters": ["zero_variance"],
}
PLAIN = {"advantage": "grpo", "gates": ["ppo_clip"], "reduction": "token"}


def rollout_batch(t: dict, group_size: int = 4) -> lossplug.PolicyBatch:
    """The loss benchmarks' tensors as a rollout batch: prompt groups of ``group_size``, a quarter of them with equal
    rewards (the filter drops them), reference log-probs near the old ones."""
    B = t["mask"].shape[0]
    g = torch.Generator().manual_seed(5)
    reward = torch.randint(0, 2, (B,), generator=g).to(t["logp"].dtype)
    groups = torch.arange(B) // group_size
    equal = groups % 4 == 0
    reward[equal] = 1.0
    ref = t["old_logp"] + 0.05 * torch.randn(t["old_logp"].shape, generator=g, dtype=t["old_logp"].dtype)
    return lossplug.PolicyBatch(
        logp=t["logp"].detach(),
        action_mask=t["mask"],
        old_logp=t["old_logp"],
        ref_logp=ref.clamp(max=0.0),
        reward=reward,
        group_id=groups,
    )


def bench_rollout_stages(t: dict, repeats: int) -> dict:
    batch = rollout_batch(t)
    with_stages = lossplug.Recipe.model_validate({**PLAIN, **ROLLOUT})
    plain = lossplug.Recipe.model_validate(PLAIN)
    normalizer = lossplug.Normalizer(action_tokens=int(t["mask"].sum()), sequences=t["mask"].shape[0])
    leaf = {}

    def fresh():
        leaf["logp"] = t["logp"].clone().requires_grad_(True)

    def loss_step():
        b = lossplug.PolicyBatch.unchecked(
            logp=leaf["logp"], action_mask=t["mask"], old_logp=t["old_logp"], advantage=t["advantage"]
        )
        lossplug.policy_loss(b, plain, normalizer, metrics="basic").loss.backward()

    times = interleaved(
        {
            "advantage_with_rollout_stages": lambda: lossplug.estimate_advantages(batch, with_stages),
            "advantage_alone": lambda: lossplug.estimate_advantages(batch, plain),
            "loss_step": loss_step,
        },
        repeats,
        warmup=2,
        setup=fresh,
    )
    result = lossplug.estimate_advantages(batch, with_stages)
    added = times["advantage_with_rollout_stages"]["median_s"] - times["advantage_alone"]["median_s"]
    fraction = added / times["loss_step"]["median_s"]
    return {
        "item": "rollout_stages",
        "B": batch.batch_size,
        "T": t["mask"].shape[1],
        "recipe": {**PLAIN, **ROLLOUT},
        **times,
        "kept_responses": float(result.metric_tensors["rollout/kept_responses"]),
        "added_s": added,
        "fraction_of_loss_step": fraction,
        "fraction_of_advantage_stage": added / times["advantage_with_rollout_stages"]["median_s"],
        "goal": "<= 5% of the loss step",
        "met": fraction <= 0.05,
        "note": "added_s: the rollout stages' time, the difference of the advantage stage's medians with and without "
        "them (once per rollout batch); the loss step: ppo_clip + token, fwd+bwd, validate='full', basic metrics, "
        "over the same batch",
    }
