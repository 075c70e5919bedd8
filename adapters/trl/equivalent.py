"""TRL's ``GRPOConfig`` → the lossplug recipe and population that reproduce TRL's native loss (:func:`trl_equivalent`).

TRL-free: the mapping reads a ``GRPOConfig`` (or any object with its attributes) and never imports TRL, so it runs
wherever lossplug does. The table of what maps to what is in :mod:`lossplug.adapters.trl`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from lossplug.contracts import LossplugError, Recipe

if TYPE_CHECKING:
    from trl import GRPOConfig

__all__ = [
    "POPULATIONS",
    "Population",
    "engine_correction_gate",
    "off_policy_mask_gate",
    "trl_equivalent",
    "trl_regularizers",
]

#: the adapter's populations (see :mod:`lossplug.adapters.trl`): the whole generation batch, or each micro-batch
Population = Literal["generation", "micro_batch"]
POPULATIONS = ("generation", "micro_batch")

#: lower / upper IcePop bound standing in for TRL's "no bound" (``vllm_importance_sampling_clip_min/max=None``): the
#: gates clamp the engine log-ratio at ±80, so every ratio lies in [exp(−80), exp(80)] ⊂ (1e-38, 1e38) — never rejected
_NO_LOW, _NO_HIGH = 1e-38, 1e38
#: the gates' log-ratio clamp where TRL has none (the gates' maximum): differs only where TRL's ratio is exp(80)
_NO_CLAMP = 80.0


def _update_gate(args: GRPOConfig) -> dict[str, Any]:
    """TRL's ``loss_type`` × ``importance_sampling_level`` → the recipe's update gate."""
    loss_type = args.loss_type
    eps_low = args.epsilon
    eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    sequence = args.importance_sampling_level == "sequence"
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        if sequence:
            gate = {"name": "gspo", "eps_low": eps_low, "eps_high": eps_high, "log_ratio_clamp": _NO_CLAMP}
            if args.delta is not None:
                gate["delta"] = args.delta  # TRL: coef_1 = clamp(coef_1, max=delta) after coef_2 is taken
            return gate
        gate = {"name": "ppo_clip", "eps_low": eps_low, "eps_high": eps_high}
        if args.delta is not None:
            gate["delta"] = args.delta  # min(clamp(r, max=δ)·A, clip(r)·A): the dual clip only when δ ≥ 1 + ε_high
        return gate
    if loss_type == "cispo":
        return {
            "name": "cispo_seq" if sequence else "cispo",
            "eps_low": None,
            "eps_high": None,
            "ratio_max": eps_high,
            "log_ratio_clamp": None,
        }
    if loss_type == "sapo":
        return {
            "name": "sapo_seq" if sequence else "sapo",
            "tau_pos": args.sapo_temperature_pos,
            "tau_neg": args.sapo_temperature_neg,
            "log_ratio_clamp": None,  # TRL clamps nothing (the sigmoid saturates long before exp overflows)
        }
    if loss_type == "vespo":
        gate = {
            "name": "vespo",
            "k_pos": args.vespo_k_pos,
            "lambda_pos": args.vespo_lambda_pos,
            "k_neg": args.vespo_k_neg,
            "lambda_neg": args.vespo_lambda_neg,
        }
        if args.use_vllm and args.vllm_importance_sampling_correction:
            # TRL folds its truncated / masked token IS ratios into the gamma weight's sequence ratio (and refuses
            # the sequence modes with vespo) instead of multiplying the loss by them
            gate.update(
                engine_correction=args.vllm_importance_sampling_mode,
                engine_ratio_min=args.vllm_importance_sampling_clip_min,
                engine_ratio_max=args.vllm_importance_sampling_clip_max,
            )
        return gate
    raise LossplugError(
        f"trl_equivalent: loss_type={loss_type!r} has no lossplug equivalent (supported: grpo, bnpo, dr_grpo, "
        "dapo, cispo, sapo, luspo, vespo)"
    )


def engine_correction_gate(args: GRPOConfig) -> dict[str, Any] | None:
    """``use_vllm`` + ``vllm_importance_sampling_correction`` → the engine-ratio correction gate TRL's
    ``vllm_importance_sampling_mode`` is (None when TRL applies none).

    TRL (``_generate_and_score_completions``): ``ρ = exp((old − sampling)·mask)`` per token (NaN → ratio 1), for
    ``sequence_*`` modes ``exp(Σ_t …)``, the product of the token ratios; ``*_truncate``: ``clamp(ρ, clip_min,
    clip_max)``; ``*_mask``: ``ρ`` where ``clip_min ≤ ρ ≤ clip_max``, else 0 (a missing bound: none).
    """
    if not (args.use_vllm and args.vllm_importance_sampling_correction):
        return None
    mode = args.vllm_importance_sampling_mode
    low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if mode not in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        raise LossplugError(f"trl_equivalent: unknown vllm_importance_sampling_mode={mode!r}")
    sequence = mode.startswith("sequence_")
    if mode.endswith("_truncate"):
        gate: dict[str, Any] = {
            "name": "tis_seq" if sequence else "tis",
            "cap": _NO_HIGH if high is None else high,
            "log_ratio_clamp": None,  # TRL clamps nothing; the weight is detached, an overflow saturates at the cap
        }
        if low is not None:
            gate["floor"] = low  # TRL raises ratios below clip_min to clip_min
        return gate
    return {
        "name": "icepop_seq" if sequence else "icepop",
        "low": _NO_LOW if low is None else low,
        "high": _NO_HIGH if high is None else high,
        "log_ratio_clamp": _NO_CLAMP,
    }


def off_policy_mask_gate(args: GRPOConfig, sampling_logprobs: bool) -> dict[str, Any]:
    return {
        "name": "off_policy_mask",
        "threshold": args.off_policy_mask_threshold,
        "sampling_logp": "behavior_logp" if sampling_logprobs else "old_logp",
    }


def _advantage(args: GRPOConfig) -> dict[str, Any]:
    """TRL's ``multi_objective_aggregation`` × ``scale_rewards`` → the recipe's advantage."""
    if args.multi_objective_aggregation == "sum_then_normalize":
        return {"name": "grpo", "scale": args.scale_rewards, "std": "sample", "eps": 1e-4, "eps_mode": "add"}
    if args.multi_objective_aggregation == "normalize_then_sum":
        # TRL weights each function's group-normalised reward with reward_weights, then normalises the sum over the
        # batch (scale_rewards plays no part)
        weights = args.reward_weights
        return {"name": "normalize_then_sum", **({"weights": list(weights)} if weights is not None else {})}
    raise LossplugError(
        f"trl_equivalent: multi_objective_aggregation={args.multi_objective_aggregation!r} is not a TRL 1.16 setting"
    )


def trl_equivalent(args: GRPOConfig, *, sampling_logprobs: bool | None = None) -> tuple[Recipe, Population]:
    """The lossplug recipe and population that reproduce TRL's native loss for ``args`` (a ``GRPOConfig``): every
    option of TRL 1.16 that touches the loss (the table in :mod:`lossplug.adapters.trl` and docs/trl.md).

    ``sampling_logprobs``: whether the trainer has behaviour log-probs (``sampling_per_token_logps``: vLLM or a
    ``rollout_func``); default ``args.use_vllm``. Only the off-policy mask depends on it (TRL's rule: the sampling
    log-probs when there are any, else the old ones) — pass True for a trainer with a ``rollout_func``.

    Raises :class:`~lossplug.LossplugError` for a setting without an exact equivalent.
    """
    loss_type = args.loss_type
    gates = [_update_gate(args)]
    # TRL multiplies these into the per-token policy loss (never into the KL): a product, so their order is free
    if args.off_policy_mask_threshold is not None:
        gates.append(off_policy_mask_gate(args, args.use_vllm if sampling_logprobs is None else sampling_logprobs))
    if args.top_entropy_quantile < 1.0:
        gates.append({"name": "top_entropy", "quantile": args.top_entropy_quantile})
    engine = engine_correction_gate(args)
    if engine is not None and loss_type != "vespo":  # (vespo folds it into its own weight, see _update_gate)
        gates.append(engine)
    reduction = {
        "grpo": {"name": "response"},
        "sapo": {"name": "response"},
        "bnpo": {"name": "token"},
        "dr_grpo": {"name": "fixed", "budget": float(args.max_completion_length)},  # type: ignore[arg-type]
        "dapo": {"name": "token"},
        "cispo": {"name": "token"},
        "vespo": {"name": "token"},
        "luspo": {"name": "sequence_sum"},
    }[loss_type]
    population: Population = "micro_batch" if loss_type == "bnpo" else "generation"
    spec: dict[str, Any] = {
        "name": f"trl-{loss_type}",
        "advantage": _advantage(args),
        "gates": gates,
        "reduction": reduction,
    }
    regularizers = trl_regularizers(args)
    if regularizers:
        spec["regularizers"] = regularizers
    return Recipe.load(spec), population


def trl_regularizers(args: GRPOConfig) -> list[dict[str, Any]]:
    """TRL's KL (``beta``) and entropy bonus (``entropy_coef`` / ``use_adaptive_entropy``) as regularizer stages."""
    out: list[dict[str, Any]] = []
    if args.beta != 0.0:
        # TRL's k3, times the update ratio coef_1 (with its gradient) when use_bias_correction_kl: the sequence
        # ratio when importance_sampling_level="sequence" (coef_1 is then one per response)
        weight = "none"
        if args.use_bias_correction_kl:
            weight = "sequence" if args.importance_sampling_level == "sequence" else "token"
        out.append({"name": "kl", "coef": args.beta, "estimator": "k3", "ratio_weight": weight, "clamp": False})
    if (args.entropy_coef != 0.0 or args.use_adaptive_entropy) and args.top_entropy_quantile < 1.0:
        # TRL's bonus then acts on the high-entropy tokens only (mask × entropy_mask): the static bonus is kept by
        # the adapter itself, exactly; the adaptive controller observes those tokens too, which no stage can
        if args.use_adaptive_entropy:
            raise LossplugError(
                "trl_equivalent: use_adaptive_entropy with top_entropy_quantile < 1: TRL's adaptive bonus and its "
                "controller act on the high-entropy tokens only, which lossplug's entropy regularizer cannot "
                "select; set top_entropy_quantile=1.0 or use a static entropy_coef"
            )
    elif args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        # TRL's bonus: a token mean over this micro-batch's (entropy-masked) action tokens, scaled only for gradient
        # accumulation, whatever the loss_type — the regularizer's own reduction and population
        entropy: dict[str, Any] = {
            "name": "entropy",
            "coef": args.entropy_coef,
            "reduction": "token",
            "population": "micro_batch",
        }
        if args.use_adaptive_entropy:
            entropy.update(
                adaptive=True,
                coef_min=args.entropy_coef_min,
                coef_max=args.entropy_coef_max,
                coef_delta=args.entropy_coef_delta,
                target=args.entropy_target,
            )
        out.append(entropy)
    return out
