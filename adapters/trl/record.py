"""The run record: which engine produced each kind of log-prob (:func:`trl_provenance`), and the recipe, provenance
and versions written next to a run (:func:`write_record`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lossplug.adapters.trl.state import adapter_state, grpo_config
from lossplug.contracts import LogProbSource, Provenance
from lossplug.versions import installed

if TYPE_CHECKING:
    from trl import GRPOTrainer

__all__ = ["trl_provenance", "versions", "write_record"]

#: TRL settings of the loss that a recipe always replaces (recorded, so that a reader of the run knows they did not
#: apply)
REPLACED_SETTINGS = (
    "loss_type",
    "epsilon",
    "epsilon_high",
    "delta",
    "importance_sampling_level",
    "scale_rewards",
    "multi_objective_aggregation",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "off_policy_mask_threshold",
    "top_entropy_quantile",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max",
)
#: TRL settings that still apply under a recipe
KEPT_SETTINGS = (
    "num_iterations",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "num_generations",
    "max_completion_length",
    "mask_truncated_completions",
    "temperature",
    "use_vllm",
)
#: TRL's KL and entropy settings: replaced when the recipe has the regularizer, kept otherwise (TRL's term applies)
KL_SETTINGS = ("beta", "use_bias_correction_kl")
ENTROPY_SETTINGS = (
    "entropy_coef",
    "use_adaptive_entropy",
    "entropy_coef_min",
    "entropy_coef_max",
    "entropy_coef_delta",
    "entropy_target",
)


def versions() -> dict[str, str]:
    """The versions of lossplug, Python and the libraries a run depends on (those installed): what
    ``lossplug --version`` prints (:func:`lossplug.versions.installed`)."""
    return installed()


def trl_provenance(trainer: GRPOTrainer) -> Provenance:
    """Which engine produced each kind of log-prob in this trainer, and under which convention.

    Training log-probs (current, old, reference) are TRL's: ``log_softmax(logits / temperature)`` of the sampled
    token, nothing else processed. Behaviour log-probs exist with vLLM (``processed_logprobs``: after temperature,
    top-p/top-k/min-p and repetition penalty — so ``processed`` is set when any of those is active) or a
    ``rollout_func`` (assumed to follow the training convention, as TRL assumes). Plain ``transformers`` generation
    samples with the training model itself: the behaviour policy *is* the old policy (same weights, same engine), and
    no separate behaviour log-probs exist — recorded as such, with the sampling settings.
    """
    args = grpo_config(trainer)
    temperature = float(getattr(trainer, "temperature", args.temperature))
    model: Any = trainer.model  # (TRL: Optional; a trainer always has one)
    try:
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    except StopIteration:  # pragma: no cover
        dtype = None
    tf = versions().get("transformers", "?")
    name = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    training: dict[str, Any] = dict(
        engine=f"transformers {tf} (TRL fused LM head)", temperature=temperature, dtype=dtype
    )
    current = LogProbSource(checkpoint=name, **training)
    old = LogProbSource(checkpoint=f"{name or 'policy'} before the update", **training)
    reference = None
    if trainer.beta != 0.0:
        ref = getattr(trainer, "ref_model", None)
        ref_name = getattr(getattr(ref, "config", None), "_name_or_path", None) if ref is not None else None
        reference = LogProbSource(checkpoint=ref_name or f"{name} (initial weights / adapters disabled)", **training)
    behavior = None
    if args.use_vllm:
        top_k = args.top_k if args.top_k and args.top_k > 0 else None
        processed = args.top_p < 1.0 or top_k is not None or (args.min_p or 0) > 0 or args.repetition_penalty != 1.0
        behavior = LogProbSource(
            checkpoint=f"{name or 'policy'} (synced to vLLM)",
            engine=f"vllm ({args.vllm_mode})",
            temperature=temperature,
            top_p=args.top_p,
            top_k=top_k,
            processed=processed,
        )
    elif getattr(trainer, "rollout_func", None) is not None:
        fn = trainer.rollout_func
        behavior = LogProbSource(
            engine=f"rollout_func {getattr(fn, '__qualname__', type(fn).__name__)}", temperature=temperature
        )
    else:
        top_k = args.top_k if getattr(args, "top_k", None) and args.top_k > 0 else None
        behavior = LogProbSource(
            checkpoint=f"{name or 'policy'} before the update (the old policy samples)",
            engine=f"transformers {tf} generate",
            temperature=temperature,
            top_p=getattr(args, "top_p", 1.0),
            top_k=top_k,
            processed=getattr(args, "top_p", 1.0) < 1.0 or top_k is not None,
        )
    return Provenance(behavior=behavior, old=old, current=current, reference=reference)


def write_record(trainer: GRPOTrainer, directory: str | Path | None = None) -> Path:
    """Write ``recipe.yaml``, ``provenance.json`` and ``versions.json`` into ``directory`` (default: the trainer's
    ``args.output_dir``). Returns the directory."""
    st = adapter_state(trainer)
    path = Path(directory if directory is not None else trainer.args.output_dir)  # type: ignore[arg-type]
    path.mkdir(parents=True, exist_ok=True)
    (path / "recipe.yaml").write_text(st.recipe.to_yaml())
    (path / "provenance.json").write_text(st.provenance.model_dump_json(indent=2) + "\n")
    args = trainer.args
    replaced, kept = list(REPLACED_SETTINGS), list(KEPT_SETTINGS)
    (replaced if st.recipe_kl else kept).extend(KL_SETTINGS)
    (replaced if st.recipe_entropy else kept).extend(ENTROPY_SETTINGS)
    record = {
        "versions": versions(),
        "adapter": {
            "module": __package__,
            "trainer": type(trainer).__name__,
            "trl_trainer": st.trl_class,
            "attached": st.attached,
            "population": st.population,
            "validate": st.validate,
            "metrics": st.metrics,
            "recipe_advantage": st.compiled.advantage is not None,
        },
        # TRL settings the recipe replaces (recorded so that a reader of the run knows they did not apply)
        "trl_settings_replaced": {k: getattr(args, k, None) for k in replaced},
        "trl_settings_kept": {k: getattr(args, k, None) for k in kept},
    }
    (path / "versions.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path
