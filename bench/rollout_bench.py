"""Item 6: what a recipe's shapers and filters (the rollout side) cost, against the loss step they feed.

The rollout stages run once per rollout batch, inside ``estimate_advantages``; the loss step runs over the same
batch (forward + backward, ``validate="full"``, basic metrics — what the adapters run). Timed interleaved on the
same tensors: the advantage stage with DAPO's rollout side (``overlong_penalty``, ``reward_clip``,
``zero_variance``, which drops a quarter of the groups), with KL in the reward (``kl_in_reward``, adaptive), and
alone (the same ``grpo``); the ppo_clip + token loss step; and verl's own ``apply_kl_penalty`` on the same tensors.
The headlines are each recipe's added time (the difference of the advantage medians) as a fraction of the loss
step's median, and the KL shaper's against verl's.
"""

from __future__ import annotations

import torch

import lossplug

from .common import interleaved

#: DAPO's rollout side: the soft overlong penalty, the score clipped, zero-variance groups dropped
DAPO = {
    "shapers": [
        {"name": "overlong_penalty", "max_response_length": 4096, "buffer": 512, "factor": 1.0},
        {"name": "reward_clip", "low": -1.0, "high": 1.0},
    ],
    "filters": ["zero_variance"],
}
#: the RLHF reward: KL in the reward with verl's adaptive controller
KL = {"shapers": [{"name": "kl_in_reward", "coef": 0.01, "controller": "adaptive", "target_kl": 0.1, "horizon": 10000}]}
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
    with_stages = lossplug.Recipe.model_validate({**PLAIN, **DAPO})
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

    kl_only = lossplug.Recipe.model_validate({**PLAIN, **KL})
    candidates = {
        "advantage_with_rollout_stages": lambda: lossplug.estimate_advantages(batch, with_stages),
        "advantage_with_kl_in_reward": lambda: lossplug.estimate_advantages(batch, kl_only),
        "advantage_alone": lambda: lossplug.estimate_advantages(batch, plain),
        "loss_step": loss_step,
    }
    verl_kl = _verl_apply_kl_penalty(batch)
    if verl_kl is not None:
        candidates["verl_apply_kl_penalty"] = verl_kl
    times = interleaved(candidates, repeats, warmup=2, setup=fresh)
    result = lossplug.estimate_advantages(batch, with_stages)
    added = times["advantage_with_rollout_stages"]["median_s"] - times["advantage_alone"]["median_s"]
    fraction = added / times["loss_step"]["median_s"]
    kl_added = times["advantage_with_kl_in_reward"]["median_s"] - times["advantage_alone"]["median_s"]
    kl_fraction = kl_added / times["loss_step"]["median_s"]
    versus_verl = kl_added / times["verl_apply_kl_penalty"]["median_s"] if verl_kl is not None else None
    return {
        "item": "rollout_stages",
        "B": batch.batch_size,
        "T": t["mask"].shape[1],
        "recipe": {**PLAIN, **DAPO},
        "kl_recipe": {**PLAIN, **KL},
        **times,
        "kept_responses": float(result.metric_tensors["rollout/kept_responses"]),
        "added_s": added,
        "fraction_of_loss_step": fraction,
        "fraction_of_advantage_stage": added / times["advantage_with_rollout_stages"]["median_s"],
        "kl_in_reward_added_s": kl_added,
        "kl_in_reward_fraction_of_loss_step": kl_fraction,
        "kl_in_reward_vs_verl": versus_verl,
        "goal": "<= 5% of the loss step",
        "met": fraction <= 0.05 and kl_fraction <= 0.05,
        "note": "added_s: the rollout stages' time, the difference of the advantage stage's medians with and without "
        "them (once per rollout batch); the loss step: ppo_clip + token, fwd+bwd, validate='full', basic metrics, "
        "over the same batch; kl_in_reward_vs_verl: the KL shaper alone (checks, metrics and controller included) "
        "against verl 0.9.1's apply_kl_penalty with its AdaptiveKLController on the same tensors",
    }


def _verl_apply_kl_penalty(batch: lossplug.PolicyBatch):
    """verl's own KL in the reward on the same tensors (``token_level_scores`` with the score on the last action
    token), or None without verl."""
    try:
        from verl import DataProto
        from verl.trainer.ppo.core_algos import AdaptiveKLController
        from verl.trainer.ppo.ray_trainer import apply_kl_penalty
    except ImportError:
        return None
    mask = batch.action_mask
    last = torch.where(mask, torch.arange(mask.shape[-1]), -1).amax(-1, keepdim=True)
    scores = torch.zeros(mask.shape, dtype=batch.logp.dtype).scatter(-1, last, batch.reward.unsqueeze(-1))
    data = DataProto.from_dict(
        tensors={
            "response_mask": mask.long(),
            "token_level_scores": scores,
            "old_log_probs": batch.old_logp,
            "ref_log_prob": batch.ref_logp,
        }
    )
    controller = AdaptiveKLController(init_kl_coef=0.01, target_kl=0.1, horizon=10000)
    return lambda: apply_kl_penalty(data, controller, kl_penalty="kl")
