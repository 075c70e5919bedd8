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
}
