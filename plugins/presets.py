"""Named recipes, each with its source."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lossplug

if TYPE_CHECKING:
    from lossplug.hookspecs import RegisterPreset

PRESETS = {
    "grpo": (
        {
            "advantage": {"name": "grpo", "scale": "group", "std": "sample", "eps": 1e-4},
            "gates": [{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2}],
            "reduction": {"name": "response"},
        },
        "GRPO, DeepSeekMath (Shao et al., 2024, arXiv:2402.03300): group-normalised advantage, PPO clip, "
        "per-response token mean",
    ),
    "dr_grpo": (
        {
            "advantage": {"name": "grpo", "scale": "none"},
            "gates": [{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2}],
            "reduction": {"name": "fixed"},
        },
        "Dr. GRPO (Liu et al., 2025, arXiv:2503.20783): no std division, per-response sums over a fixed budget "
        "(budget from the recipe or the Normalizer, e.g. max_completion_length)",
    ),
    "dapo": (
        {
            "advantage": {"name": "grpo", "scale": "group", "std": "sample", "eps": 1e-6},
            "gates": [{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.28}],
            "reduction": {"name": "token"},
        },
        "DAPO (Yu et al., 2025, arXiv:2503.14476): clip-higher (0.2 / 0.28), global token mean; dynamic sampling "
        "is a data-side filter",
    ),
    "rloo": (
        {
            "advantage": {"name": "rloo"},
            "gates": [{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2}],
            "reduction": {"name": "response"},
        },
        "RLOO (Ahmadian et al., 2024, arXiv:2402.14740): leave-one-out baseline",
    ),
    "ppo": (
        {
            "advantage": {"name": "gae", "gamma": 1.0, "lam": 0.95, "whiten": True},
            "gates": [{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2}],
            "reduction": {"name": "token"},
        },
        "PPO for LLMs (Schulman et al., 2017, arXiv:1707.06347; RLHF as in Ouyang et al., 2022, arXiv:2203.02155 and "
        "TRL's original PPOTrainer, trl ≤ 0.11): GAE γ=1 λ=0.95 with whitened advantages, clip 0.2, token mean over "
        "the batch's action tokens (that trainer's masked_mean; verl's token-mean). The value loss belongs to the "
        "critic, outside the policy loss. For TRL's KL-shaped reward set advantage.kl_coef (TRL: 0.05; needs old_logp "
        "and ref_logp)",
    ),
    "vapo": (
        {
            "advantage": {"name": "length_adaptive_gae", "alpha": 0.05, "gamma": 1.0, "critic_lam": 1.0},
            "gates": [{"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.28}],
            "reduction": {"name": "token"},
        },
        "VAPO (Yue et al., 2025, arXiv:2504.05118): length-adaptive GAE (λ = 1 − 1/(0.05·l), l in action tokens; "
        "critic λ = 1), clip-higher (0.2 / 0.28), global token mean; value pretraining and the positive-sample NLL "
        "term are outside the policy loss",
    ),
    "gspo": (
        {
            "advantage": {"name": "grpo", "scale": "group", "std": "sample", "eps": 1e-6},
            "gates": [{"name": "gspo", "eps_low": 3e-4, "eps_high": 4e-4}],
            "reduction": {"name": "response"},
        },
        "GSPO (Zheng et al., 2025, arXiv:2507.18071): length-normalised sequence ratio exp(mean_t log r_t) clipped "
        "at sequence level with the paper's range 3e-4 / 4e-4, group-normalised advantage, per-response mean "
        "(verl: loss_mode=gspo, seq-mean-token-mean)",
    ),
    "sapo": (
        {
            "advantage": {"name": "grpo", "scale": "group", "std": "sample", "eps": 1e-6},
            "gates": [{"name": "sapo", "tau_pos": 1.0, "tau_neg": 1.05}],
            "reduction": {"name": "response"},
        },
        "SAPO (Gao et al., 2025, arXiv:2511.20347): smooth gate (4/τ)·σ(τ(r−1))·A with τ_pos = 1.0, τ_neg = 1.05 "
        "(the paper's, TRL's and verl's defaults), per-response mean (verl hard-wires seq-mean-token-mean for sapo)",
    ),
    "cispo": (
        {
            "advantage": {"name": "grpo", "scale": "group", "std": "sample", "eps": 1e-6},
            "gates": [{"name": "cispo", "eps_low": None, "eps_high": None, "ratio_max": 5.0}],
            "reduction": {"name": "token"},
        },
        "CISPO, MiniMax-M1 (MiniMax, 2025, arXiv:2506.13585): detached clipped IS weight times log-prob, no lower "
        "bound, upper cap ε_max = 5.0 (ScaleRL, Khatri et al., 2025, arXiv:2510.13786; TRL's recommended "
        "epsilon_high for cispo), global token mean. verl's cispo (two-sided 1 ± 0.2) is "
        "{name: cispo, eps_low: 0.2, eps_high: 0.2}",
    ),
}


@lossplug.hookimpl
def lossplug_register_presets(register: RegisterPreset) -> None:
    for name, (recipe, source) in PRESETS.items():
        register(name, recipe, source=source)
