"""Built-in plugins' parameter sets that take code paths their defaults do not, for sweeps over every path.

The meta-device proof of no host synchronisation (``tests/core/test_no_host_sync.py``) and the GPU check
(``python -m bench --gpu``) run each of these beside every built-in's defaults: one list, so that a path a new
parameter opens is added once and swept by both.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GATE_CODE_PATHS", "REGULARIZER_CODE_PATHS"]

#: gates: rejection rules, batch normalisation, floors, geometric sequence ratios, a quantile below 1, the other
#: sampling log-probs, vLLM IS folded into vespo, dual clip and TRL's delta, TRL's unclamped cispo / sapo / tis,
#: gspo's delta
GATE_CODE_PATHS: tuple[dict[str, Any], ...] = (
    {"name": "ppo_clip", "dual_clip_c": 3.0},
    {"name": "ppo_clip", "delta": 1.1},
    {"name": "cispo", "eps_low": None, "eps_high": None, "ratio_max": 5.0, "log_ratio_clamp": None},
    {"name": "sapo", "log_ratio_clamp": None},
    {"name": "sapo_seq", "log_ratio_clamp": None},
    {"name": "gspo", "delta": 2.0},
    {"name": "tis", "floor": 0.5, "batch_normalize": True},
    {"name": "tis", "log_ratio_clamp": None},
    {"name": "tis_seq", "ratio": "geometric", "batch_normalize": True},
    {"name": "tis_seq", "log_ratio_clamp": None},
    {"name": "icepop", "batch_normalize": True},
    {"name": "icepop_seq", "ratio": "geometric", "batch_normalize": True},
    {"name": "bypass_is", "low": 0.5, "batch_normalize": True},
    {"name": "bypass_is_seq", "batch_normalize": True},
    {
        "name": "bypass_rs",
        "rules": [
            {"statistic": "token_k1", "upper": 2.0},
            {"statistic": "seq_sum_k2", "upper": 1.0},
            {"statistic": "seq_mean_k3", "upper": 0.5},
            {"statistic": "seq_max_k2", "upper": 0.5},
        ],
        "renormalize": True,
    },
    {"name": "rollout_rs", "options": "token_k1,seq_sum_k2,seq_mean_k3,seq_max_k2", "threshold": "0.5_2.0,1,0.5,0.5"},
    {"name": "top_entropy", "quantile": 0.2},
    {"name": "off_policy_mask", "sampling_logp": "old_logp"},
    {"name": "vespo", "engine_correction": "token_mask", "engine_ratio_min": 0.5},
    {"name": "vespo", "engine_correction": "token_truncate"},
    {"name": "tpo", "group_size": 4},  # the whole-group rule: a device-side assert off the CPU
)

#: regularizers (each after ppo_clip with the token reduction): estimators, ratio weights, the adaptive
#: controller, own reduction and population — every built-in regularizer appears at least once
REGULARIZER_CODE_PATHS: tuple[dict[str, Any], ...] = (
    *({"name": "kl", "estimator": e} for e in ("k1", "abs", "k2", "k3", "k3+")),
    {"name": "kl", "estimator": "k3", "clamp": False, "ratio_weight": "token"},
    {"name": "kl", "estimator": "low_var_kl", "ratio_weight": "sequence", "reduction": "response"},
    {"name": "entropy", "coef": 0.01},
    {"name": "entropy", "coef": 0.01, "adaptive": True, "reduction": "token", "population": "micro_batch"},
    *({"name": "kl_on_policy", "estimator": e} for e in ("k1", "k2", "k3")),
    {"name": "kl_on_policy", "weight": "behavior", "input_clamp": None, "output_clamp": None},
    {"name": "nll"},
    {"name": "nll", "responses": "positive_advantage", "denominator": "selected"},
    {"name": "nll", "responses": "all", "reduction": "token_sum"},
    {"name": "echo", "coef": 0.1},
    {"name": "distillation", "estimator": "abs", "mode": "supervised", "loss_max_clamp": None},
    {"name": "distillation", "estimator": "k1", "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio_c": None},
)
