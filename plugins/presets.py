"""Named recipes, each with its source."""

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
        "TRL's PPOTrainer, seed 2): GAE γ=1 λ=0.95 with whitened advantages, clip 0.2, token mean over the batch's "
        "action tokens (seed 2's masked_mean; verl's token-mean). The value loss belongs to the critic, outside the "
        "policy loss. For TRL's KL-shaped reward set advantage.kl_coef (TRL: 0.05; needs old_logp and ref_logp)",
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
}
