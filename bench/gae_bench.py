"""Items 1 and 2: packed GAE against a sequential Python loop, padded GAE against verl's."""

from __future__ import annotations

import torch

import lossplug
from lossplug.plugins.advantages.gae import packed_gae
from lossplug.testing.reference import sequential_packed_gae

from .common import interleaved, ratio

# ---------------------------------------------------------------------------------------------------------------------
# Item 1: packed


def packed_inputs(tokens: int, trajectories: int, seed: int = 0) -> dict:
    """``trajectories`` fragments of mixed lengths (1 … ~2× the mean) summing to exactly ``tokens``; half end in a
    terminal state (next_value NaN there), half are time-limit truncations (bootstrap, boundary)."""
    g = torch.Generator().manual_seed(seed)
    mean = tokens / trajectories
    raw = torch.rand(trajectories, generator=g, dtype=torch.float64) * 2 * mean + 1
    lengths = (raw / raw.sum() * tokens).floor().long().clamp(min=1)
    lengths[-1] += tokens - int(lengths.sum())
    assert int(lengths.sum()) == tokens and int(lengths.min()) >= 1
    ends = torch.cumsum(lengths, 0) - 1
    boundary = torch.zeros(tokens, dtype=torch.bool)
    boundary[ends] = True
    terminated = torch.zeros(tokens, dtype=torch.bool)
    terminated[ends] = torch.rand(trajectories, generator=g) < 0.5
    value = torch.randn(tokens, generator=g)
    next_value = torch.cat((value[1:], torch.zeros(1))).masked_fill(terminated, float("nan"))
    next_value = torch.where(boundary & ~terminated, torch.randn(tokens, generator=g), next_value)
    return dict(
        reward=torch.randn(tokens, generator=g) * 0.1,
        value=value,
        next_value=next_value,
        terminated=terminated,
        boundary=boundary,
    ), lengths


def bench_packed(tokens: int, trajectories: int, repeats: int, baseline_tokens: int) -> dict:
    """lossplug's packed_gae (contract validation included) at full size; the sequential loop on the first
    trajectories holding ≈ ``baseline_tokens`` tokens, timed and extrapolated linearly in tokens (its cost is a constant per
    iteration: one Python step per token)."""
    kw, lengths = packed_inputs(tokens, trajectories)
    gamma, lam = 0.99, 0.95
    ends = torch.cumsum(lengths, 0)
    k = int((ends <= baseline_tokens).sum().clamp(min=1))
    n_base = int(ends[k - 1])
    prefix = {name: t[:n_base] for name, t in kw.items()}

    # correctness on the prefix (and the prefix result equals the full result there: fragments are independent)
    ours_full = packed_gae(**kw, gamma=gamma, lam=lam)
    ref = sequential_packed_gae(**prefix, gamma=gamma, lam=lam)
    max_abs = float((ours_full[:n_base] - ref).abs().max())

    times = interleaved({"lossplug": lambda: packed_gae(**kw, gamma=gamma, lam=lam)}, repeats)
    # the sequential loop: fewer repetitions (each is seconds); per-token cost from two prefix sizes checks linearity
    half = {name: t[: int(ends[max(k // 2, 1) - 1])] for name, t in kw.items()}
    base_reps = max(2, min(repeats, 3))
    base = interleaved(
        {
            "sequential_loop": lambda: sequential_packed_gae(**prefix, gamma=gamma, lam=lam),
            "sequential_loop_half": lambda: sequential_packed_gae(**half, gamma=gamma, lam=lam),
        },
        base_reps,
        warmup=0,
    )
    n_half = half["reward"].numel()
    per_token = base["sequential_loop"]["median_s"] / n_base
    per_token_half = base["sequential_loop_half"]["median_s"] / n_half
    extrapolated = {key: v * tokens / n_base if key.endswith("_s") else v for key, v in base["sequential_loop"].items()}
    r = ratio(extrapolated, times["lossplug"])  # baseline / ours: the speed-up
    return {
        "item": "packed_gae",
        "tokens": tokens,
        "trajectories": trajectories,
        "length_min": int(lengths.min()),
        "length_max": int(lengths.max()),
        "dtype": "float32",
        "lossplug": times["lossplug"],
        "sequential_loop_measured": {"tokens": n_base, "trajectories": k, **base["sequential_loop"]},
        "sequential_loop_per_token_us": per_token * 1e6,
        "sequential_loop_per_token_us_half_size": per_token_half * 1e6,
        "sequential_loop_extrapolated": extrapolated,
        "speedup": r["ratio"],
        "speedup_min": r["ratio_min"],
        "goal": ">= 100x faster",
        "met": r["ratio"] >= 100,
        "max_abs_diff_vs_sequential": max_abs,
        "note": f"sequential loop timed on the first {k} trajectories ({n_base} tokens), extrapolated linearly to "
        f"{tokens} tokens; lossplug timed at full size including PackedTransitions validation",
    }


# ---------------------------------------------------------------------------------------------------------------------
# Item 2: padded


def padded_inputs(B: int, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(T // 4, 1), T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    values = torch.randn(B, T, generator=g)
    scores = torch.randn(B, generator=g)
    token_rewards = torch.zeros(B, T)
    token_rewards[torch.arange(B), lengths - 1] = scores  # verl: the score on the last valid token
    return mask, values, scores, token_rewards


def bench_padded(B: int, T: int, repeats: int) -> dict:
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    mask, values, scores, token_rewards = padded_inputs(B, T)
    response_mask = mask.long()  # verl's response_mask: a slice of the int64 attention mask
    gamma, lam = 1.0, 1.0  # verl's defaults (algorithm.gamma / algorithm.lam)
    recipe = lossplug.Recipe.model_validate(
        {
            "advantage": {"name": "gae", "gamma": gamma, "lam": lam, "whiten": True},
            "gates": ["ppo_clip"],
            "reduction": "token",
        }
    )
    logp = torch.zeros(B, T)

    def ours_off():
        batch = lossplug.PolicyBatch.unchecked(logp=logp, action_mask=mask, value=values, reward=token_rewards)
        return lossplug.estimate_advantages(batch, recipe, validate="off")

    def ours_full():
        batch = lossplug.PolicyBatch(logp=logp, action_mask=mask, value=values, reward=token_rewards)
        return lossplug.estimate_advantages(batch, recipe, validate="full")

    def verl():
        return compute_gae_advantage_return(token_rewards, values, response_mask, gamma, lam)

    res, ref = ours_off(), verl()
    max_abs = max(float((res.advantage - ref[0])[mask].abs().max()), float((res.returns - ref[1])[mask].abs().max()))
    times = interleaved({"lossplug": ours_off, "lossplug_validated": ours_full, "verl": verl}, repeats)
    r = ratio(times["verl"], times["lossplug"])
    rv = ratio(times["verl"], times["lossplug_validated"])
    return {
        "item": "padded_gae",
        "B": B,
        "T": T,
        "action_tokens": int(mask.sum()),
        "dtype": "float32",
        "gamma": gamma,
        "lam": lam,
        "whiten": True,
        **times,
        "speedup": r["ratio"],
        "speedup_min": r["ratio_min"],
        "speedup_validated": rv["ratio"],
        "goal": ">= 2x faster",
        "met": r["ratio"] >= 2,
        "max_abs_diff_vs_verl_on_actions": max_abs,
        "note": "verl.trainer.ppo.core_algos.compute_gae_advantage_return (Python loop over T) vs "
        "lossplug.estimate_advantages(gae) with validate='off' (lossplug_validated: the PolicyBatch contract "
        "and the recipe's checks included); advantages and returns, whitened",
    }
