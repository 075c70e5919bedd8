"""Run any lossplug recipe inside TRL's ``GRPOTrainer`` — no fork of TRL.

Two ways in::

    from lossplug.adapters.trl import LossplugGRPOTrainer, attach, trl_equivalent

    trainer = LossplugGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                                  processing_class=tok, recipe="dapo")            # a GRPOTrainer subclass
    trainer = attach(GRPOTrainer(...), "dapo")                                    # a trainer you already built
    recipe, population = trl_equivalent(args)                                     # TRL's own loss, as a recipe
    trainer = attach(GRPOTrainer(..., args=args), recipe, population=population)

Both give the same object: a ``GRPOTrainer`` (subclass) whose

* **advantage** comes from the recipe's advantage plugin, computed in ``_generate_and_score_completions`` on the
  rewards TRL gathered over all processes — where every prompt group is still complete — and then sliced to this
  process's rows, exactly where TRL computes its own (a recipe without an advantage stage keeps TRL's);
* **loss** (``_compute_loss``) is the recipe's gates, reduction and regularisers (KL, entropy). Where the recipe has
  no KL regulariser TRL's ``beta`` term is added by the adapter (reduced with :func:`lossplug.reduce`, the policy
  term's denominators); where it has no entropy regulariser TRL's static ``entropy_coef`` bonus is. TRL's own
  weights on the policy term (vLLM importance sampling, off-policy mask, entropy mask) are never applied by the
  adapter: the recipe carries them as gates.

``import lossplug`` never imports TRL, and neither does ``import lossplug.adapters.trl``: TRL is imported the first
time ``LossplugGRPOTrainer`` is looked up or ``attach`` is called.

What travels with the rows
--------------------------
``_generate_and_score_completions`` adds three per-row tensors to TRL's batch dict — ``lossplug_group_id`` (the
prompt group, unique over the run), ``lossplug_reward`` (the weighted raw reward TRL summed, NaN where every reward
function returned ``None``) and ``lossplug_reward_components`` (``[N, K]``: TRL's ``rewards_per_func``, one column
per reward function, unweighted, NaN where a function returned ``None``) — so that they survive TRL's shuffle and
split into micro-batches. The advantage stage sees all three on the gathered batch (``reward_components`` when its
plugin reads them: TRL's ``normalize_then_sum`` weights each function's normalised reward, so the weights are the
plugin's parameter, not folded into the components).

The micro-batch TRL hands to ``_compute_loss`` becomes a :class:`lossplug.PolicyBatch`:

=====================  ================================================================================
``logp``               ``_get_per_token_logps_and_entropies`` of the model (carries the gradient)
``action_mask``        ``completion_mask`` × ``tool_mask`` (tool / environment tokens are not actions); rows
                       with no action at all (e.g. ``mask_truncated_completions``) are left out of the batch
                       but still counted in the population, exactly as TRL's denominators count them
``old_logp``           ``old_per_token_logps`` (``num_iterations > 1``, misaligned accumulation, vLLM IS), else
                       ``logp.detach()`` — TRL's own rule
``behavior_logp``      ``sampling_per_token_logps`` (vLLM, ``rollout_func``); tokens the engine could not
                       score (NaN) get ``old_logp`` — engine ratio exactly 1, TRL's convention
``ref_logp``           ``ref_per_token_logps`` (``beta != 0``)
``entropy``            the entropies ``_get_per_token_logps_and_entropies`` computes (always, as TRL does), when a
                       recipe stage reads them (``top_entropy``, ``entropy``); they carry the gradient (an
                       entropy bonus differentiates them)
``advantage``          ``advantages`` (the recipe's, see above)
``group_id``           ``lossplug_group_id``;   ``reward``: ``lossplug_reward`` when every row has one
``reward_components``  ``lossplug_reward_components`` when a stage reads them and every value is finite
=====================  ================================================================================

Reduction and TRL's gradient-accumulation convention
----------------------------------------------------
TRL expects ``_compute_loss`` to return a loss already scaled for gradient accumulation, and DDP averages gradients
over processes. The adapter hands :func:`lossplug.policy_loss` a :class:`~lossplug.Normalizer` for a population and
multiplies its micro-batch share by ``num_processes × steps_per_generation / gradient_accumulation_steps`` (1 and 1
in eval). Two populations (``population=``):

* ``"generation"`` (default) — the whole generation batch on all processes: ``num_items_in_batch`` action tokens,
  ``per_device_batch × steps_per_generation × num_processes`` responses — every row, as TRL counts them: a row
  emptied by ``mask_truncated_completions`` stays in TRL's mean, where lossplug's default population (no
  ``Normalizer``) would leave it out — ``max_completion_length`` as the ``fixed`` budget. When
  ``steps_per_generation == gradient_accumulation_steps`` (TRL's default) that *is* the optimizer step, and summing
  the losses of all micro-batches and processes gives exactly the full-step reduction. Otherwise each accumulation
  window gets its share of the generation batch's reduction — TRL's own convention for ``dapo``.
* ``"micro_batch"`` — every micro-batch is its own population, extrapolated to the step: what TRL's ``bnpo`` does
  (a mean of per-micro-batch token means). Only the ``token`` reduction differs between the two (every micro-batch
  has the same number of rows, so response-based reductions agree).

The ``Normalizer`` also counts the micro-batches: ``steps_per_generation × num_processes`` (``num_processes`` in
eval). A regulariser with ``population: micro_batch`` (TRL's entropy bonus, a token mean over each micro-batch, divided
by the accumulation steps) weighs ``1 / micro_batches`` of its micro-batch's own mean — exactly TRL's, even when
``mask_truncated_completions`` left rows out of the batch.

TRL's ``GRPOConfig`` → lossplug
-------------------------------
:func:`trl_equivalent` builds the recipe (and population) that reproduces TRL's native loss; every row below is
proven end to end — the parameters after two optimizer steps of a real ``GRPOTrainer`` (gradient accumulation 2,
``num_iterations`` 2, ``beta`` > 0, float32) equal TRL's native run to float32 rounding — in
``tests/adapters/test_trl_parity_e2e.py`` and ``tests/adapters/test_trl_equivalence.py``:

===========================================  ========================================================================
TRL setting                                  recipe
===========================================  ========================================================================
``loss_type`` grpo / sapo                    reduction ``response``
``loss_type`` bnpo                           reduction ``token``, population **micro_batch**
``loss_type`` dr_grpo                        reduction ``fixed(budget=max_completion_length)``
``loss_type`` dapo / cispo / vespo           reduction ``token``
``loss_type`` luspo                          reduction ``sequence_sum``
grpo/bnpo/dr_grpo/dapo/luspo                 gate ``ppo_clip(eps_low=epsilon, eps_high=epsilon_high)``; ``delta`` →
                                             ``dual_clip_c`` (``min(clamp(r, max=δ)·A, clip(r)·A)`` is the dual clip)
… ``importance_sampling_level=sequence``     gate ``gspo`` (same clip range, ``delta`` → ``gspo.delta``)
``loss_type`` cispo (token / sequence)       gate ``cispo`` / ``cispo_seq(eps_low=None, ratio_max=epsilon_high,
                                             log_ratio_clamp=None)``
``loss_type`` sapo (token / sequence)        gate ``sapo`` / ``sapo_seq(tau_pos=sapo_temperature_pos,
                                             tau_neg=sapo_temperature_neg)``
``loss_type`` vespo                          gate ``vespo(k_pos, lambda_pos, k_neg, lambda_neg)`` (``vespo_*``)
``off_policy_mask_threshold``                correction ``off_policy_mask(threshold, sampling_logp=behavior_logp``
                                             with vLLM / a ``rollout_func``, else ``old_logp``)
``top_entropy_quantile < 1``                 correction ``top_entropy(quantile)``
``use_vllm`` +                               ``token_truncate`` → ``tis(cap=clip_max, floor=clip_min)``;
``vllm_importance_sampling_correction``      ``sequence_truncate`` → ``tis_seq(…)``; ``token_mask`` →
(``_mode``, ``_clip_min``, ``_clip_max``)    ``icepop(low=clip_min, high=clip_max)``; ``sequence_mask`` →
                                             ``icepop_seq(…)`` (the product of
                                             the token ratios, as TRL); a missing bound: none; with vespo the
                                             token modes are vespo's ``engine_correction`` instead
``sum_then_normalize`` + ``scale_rewards``   advantage ``grpo(scale=scale_rewards, std=sample, eps=1e-4)``
``normalize_then_sum`` + ``reward_weights``  advantage ``normalize_then_sum(weights=reward_weights)``
``beta`` + ``use_bias_correction_kl``        regulariser ``kl(coef=beta, estimator=k3, clamp=False,
                                             ratio_weight=token | sequence | none)``
``entropy_coef``, ``use_adaptive_entropy``,  regulariser ``entropy(coef, reduction=token, population=micro_batch
``entropy_coef_min/max/delta``,              [, adaptive, coef_min, coef_max, coef_delta, target])``; with
``entropy_target``                           ``top_entropy_quantile < 1`` the static bonus stays the adapter's
===========================================  ========================================================================

The engine-ratio gates clamp the log-ratio at ±80 and TRL does not clamp: a difference only where TRL's ratio is
already ``exp(80)``; a missing IcePop bound is 1e-38 / 1e38 — outside every clamped ratio. The update gates clamp the
update log-ratio at ±20 where TRL does not clamp at all. lossplug's advantage is exactly 0 for a group of identical
rewards, where TRL's is ``(r − mean)/(0 + 1e-4)``: rounding noise of the mean, amplified 10⁴ times.

TRL's options that weight the policy term are the recipe's, never the adapter's: when TRL's option is set the
recipe must carry the same gate with the same settings (``trl_equivalent`` puts it there), else the trainer is
refused — the adapter never multiplies TRL's ``importance_sampling_ratio``, so it cannot be applied twice, and a
recipe without it cannot drop it silently. KL and entropy are counted once: a KL regulariser replaces TRL's
``beta`` term (``beta`` must then equal the recipe's KL coefficient — it only switches TRL's reference log-probs on,
which TRL computes only when ``beta != 0``); an entropy regulariser replaces TRL's bonus and must then have TRL's
settings (or TRL's ``entropy_coef=0``, ``use_adaptive_entropy=False``). Neither is ever multiplied by a correction
(TRL adds its KL after the vLLM correction multiplied the policy term). An adaptive coefficient steps at every
optimizer step on the window's entropies over all processes (TRL's rule, TRL's order: the bonus of a window uses the
coefficient from the end of the previous one), and is written into every checkpoint folder
(:data:`CONTROLLER_STATE_FILE`) and restored on resume, as TRL does with ``entropy_ctrl_state.json``.

Differences that remain, documented: with ``off_policy_mask_threshold`` and behaviour log-probs, a token the engine
could not score (NaN) counts ``old − logp`` towards the response's KL where TRL counts 0 (the batch has one behaviour
log-prob per token, and the engine ratio's convention, ``behavior = old``, wins; equal whenever ``old = logp``);
``top_entropy`` takes the quantile over one process's micro-batch where TRL gathers all processes' (equal on one
process; a warning otherwise); ``normalize_then_sum`` needs every reward function to score every row (TRL's NaN-aware means are not
reproduced: a ``None`` from one function is a validation error).

Refused (with a message, at construction / ``attach``), never silently changed
------------------------------------------------------------------------------
Only what is genuinely outside the loss, or a recipe that would change TRL's meaning:

* TRL versions other than those tested (:data:`TESTED_TRL`; ``LOSSPLUG_TRL_ALLOW_UNTESTED=1`` turns the refusal into
  a warning), and ``use_liger_kernel`` on TRL < 1.14 (Liger's loss bypasses ``_compute_loss``: no seam);
* ``RLOOTrainer`` (its batches carry per-sequence summed old log-probs and a KL folded into the reward — token-level
  gates cannot run on them; use ``LossplugGRPOTrainer`` with recipe ``rloo``) and anything not a ``GRPOTrainer``;
* a trainer class that overrides ``_compute_loss`` itself (lossplug would replace it);
* a TRL option that weights the loss (vLLM importance sampling, ``off_policy_mask_threshold``,
  ``top_entropy_quantile``, ``use_adaptive_entropy``) without the recipe stage that is it, or with other settings;
  a KL regulariser with ``beta = 0`` (no reference log-probs) or another ``beta``; an entropy regulariser beside
  TRL's bonus of other settings;
* a recipe whose plugins read fields TRL does not provide (``value``, ``trajectory_id``, ``terminated``…, ``ref_logp``
  without ``beta``, ``behavior_logp`` without vLLM or a ``rollout_func``);
* behaviour log-probs of a different convention than the training log-probs (``Provenance.check``) when the
  recipe reads them;
* in :func:`trl_equivalent`: ``use_adaptive_entropy`` with ``top_entropy_quantile < 1`` (TRL's
  controller observes the high-entropy tokens only, which the entropy regulariser cannot select).

Kept from TRL unchanged: the MoE auxiliary loss, eval mode, the ``kl`` metric (from the recipe's KL when it has one),
the ``entropy`` metric, ``entropy_coef``. lossplug's own metrics are logged as
``lossplug/<name>`` in ``self._metrics[mode]`` (averaged over processes), so they appear in TRL's logs;
``metrics="basic"`` (the default) keeps them to what costs about as much as TRL's own clip-ratio metrics,
``metrics="full"`` adds ratio quantiles and effective-sample fractions. With behaviour log-probs (vLLM)
``lossplug/engine/approx_kl`` is the mean over the actions of ``sampling_per_token_logps − old_per_token_logps``
(unscored tokens count 0), the signed k1 KL between the engine and the trainer; TRL's
``sampling/sampling_logp_difference/mean`` is the mean of its absolute value. At ``train()`` the recipe, the
provenance and the versions are written to ``args.output_dir`` (``recipe.yaml``, ``provenance.json``,
``versions.json``).
"""

from __future__ import annotations

import importlib.metadata as _md
import json
import os
import platform
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import torch

import lossplug
from lossplug.contracts import LogProbSource, LossplugError, Normalizer, PolicyBatch, Provenance, Recipe
from lossplug.needs import required_fields

if TYPE_CHECKING:
    from types import ModuleType

    from trl import GRPOConfig, GRPOTrainer

    from lossplug.control import StepController
    from lossplug.pipeline import CompiledRecipe, MetricLevel, Validate

    _TrainerBase = GRPOTrainer  # what the mixin is combined with, for type checkers
else:
    _TrainerBase = object


def _config(trainer: GRPOTrainer) -> GRPOConfig:
    """``trainer.args``: TRL types it as transformers' ``TrainingArguments``; a GRPOTrainer's is a ``GRPOConfig``."""
    return trainer.args  # type: ignore[return-value]


#: what names a recipe: a :class:`lossplug.Recipe`, a preset name, a mapping or a YAML/JSON path
RecipeLike = Recipe | Mapping[str, Any] | str | Path
_T = TypeVar("_T", bound="GRPOTrainer")

__all__ = [
    "LossplugGRPOTrainer",
    "TESTED_TRL",
    "attach",
    "check_trl_version",
    "group_advantages",
    "trl_equivalent",
    "trl_provenance",
    "write_record",
]

#: TRL minor versions this adapter is tested against
TESTED_TRL: tuple[str, ...] = ("1.16",)
ALLOW_UNTESTED_ENV = "LOSSPLUG_TRL_ALLOW_UNTESTED"
Population = Literal["generation", "micro_batch"]
POPULATIONS = ("generation", "micro_batch")
VALIDATE = ("full", "off")

#: fields of PolicyBatch the adapter can fill from TRL's batch (ref_logp / behavior_logp conditionally)
_PROVIDED = {"logp", "action_mask", "old_logp", "advantage", "group_id", "reward", "entropy", "reward_components"}
#: fields the advantage stage sees (it runs on rewards gathered over processes, before any log-prob exists)
_ADVANTAGE_PROVIDED = {"reward", "group_id", "reward_components"}
#: multimodal / model keyword inputs TRL forwards to ``_get_per_token_logps_and_entropies``
_FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


# ---------------------------------------------------------------------------------------------------------------------
# TRL import and version gate


def _trl() -> ModuleType:
    try:
        import trl
    except ImportError as err:  # pragma: no cover - trl is installed wherever the adapter is tested
        raise LossplugError("lossplug.adapters.trl needs TRL: pip install 'lossplug[trl]'") from err
    check_trl_version(trl.__version__)
    return trl


def _version_tuple(version: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(version).release


def check_trl_version(version: str) -> None:
    """Refuse a TRL version the adapter was not tested against (``LOSSPLUG_TRL_ALLOW_UNTESTED=1``: warn instead)."""
    release = _version_tuple(version)
    if ".".join(map(str, release[:2])) in TESTED_TRL:
        return
    message = (
        f"lossplug.adapters.trl is tested with TRL {', '.join(TESTED_TRL)}.x, found TRL {version}: the private "
        f"seams it uses (_generate_and_score_completions, _calculate_rewards, _compute_loss) may differ"
    )
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        warnings.warn(message + f" ({ALLOW_UNTESTED_ENV}=1: continuing)", stacklevel=3)
        return
    raise LossplugError(message + f"; set {ALLOW_UNTESTED_ENV}=1 to try anyway")


def _versions() -> dict[str, str]:
    out = {"lossplug": lossplug.__version__, "python": platform.python_version()}
    for dist in ("trl", "transformers", "torch", "accelerate", "vllm", "peft"):
        try:
            out[dist] = _md.version(dist)
        except _md.PackageNotFoundError:
            pass
    return out


# ---------------------------------------------------------------------------------------------------------------------
# TRL settings → lossplug recipe


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
            gate["dual_clip_c"] = args.delta  # min(clamp(r, max=δ)·A, clip(r)·A) ≡ dual clip at δ
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


def _engine_correction(args: GRPOConfig) -> dict[str, Any] | None:
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
            "log_ratio_clamp": _NO_CLAMP,
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


def _off_policy_mask(args: GRPOConfig, sampling_logprobs: bool) -> dict[str, Any]:
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
    option of TRL 1.16 that touches the loss (the table in the module docstring and the README).

    ``sampling_logprobs``: whether the trainer has behaviour log-probs (``sampling_per_token_logps``: vLLM or a
    ``rollout_func``); default ``args.use_vllm``. Only the off-policy mask depends on it (TRL's rule: the sampling
    log-probs when there are any, else the old ones) — pass True for a trainer with a ``rollout_func``.

    Raises :class:`~lossplug.LossplugError` for a setting without an exact equivalent.
    """
    loss_type = args.loss_type
    gates = [_update_gate(args)]
    # TRL multiplies these into the per-token policy loss (never into the KL): a product, so their order is free
    if args.off_policy_mask_threshold is not None:
        gates.append(_off_policy_mask(args, args.use_vllm if sampling_logprobs is None else sampling_logprobs))
    if args.top_entropy_quantile < 1.0:
        gates.append({"name": "top_entropy", "quantile": args.top_entropy_quantile})
    engine = _engine_correction(args)
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
    regularisers = _regularisers(args)
    if regularisers:
        spec["regularisers"] = regularisers
    return Recipe.load(spec), population


def _regularisers(args: GRPOConfig) -> list[dict[str, Any]]:
    """TRL's KL (``beta``) and entropy bonus (``entropy_coef`` / ``use_adaptive_entropy``) as regulariser stages."""
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
                "controller act on the high-entropy tokens only, which lossplug's entropy regulariser cannot "
                "select; set top_entropy_quantile=1.0 or use a static entropy_coef"
            )
    elif args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        # TRL's bonus: a token mean over this micro-batch's (entropy-masked) action tokens, scaled only for gradient
        # accumulation, whatever the loss_type — the regulariser's own reduction and population
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


# ---------------------------------------------------------------------------------------------------------------------
# Provenance and run record


def trl_provenance(trainer: GRPOTrainer) -> Provenance:
    """Which engine produced each kind of log-prob in this trainer, and under which convention.

    Training log-probs (current, old, reference) are TRL's: ``log_softmax(logits / temperature)`` of the sampled
    token, nothing else processed. Behaviour log-probs exist with vLLM (``processed_logprobs``: after temperature,
    top-p/top-k/min-p and repetition penalty — so ``processed`` is set when any of those is active) or a
    ``rollout_func`` (assumed to follow the training convention, as TRL assumes). Plain ``transformers`` generation
    samples with the training model itself: the behaviour policy *is* the old policy (same weights, same engine), and
    no separate behaviour log-probs exist — recorded as such, with the sampling settings.
    """
    args = _config(trainer)
    temperature = float(getattr(trainer, "temperature", args.temperature))
    model: Any = trainer.model  # (TRL: Optional; a trainer always has one)
    try:
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    except StopIteration:  # pragma: no cover
        dtype = None
    tf = _versions().get("transformers", "?")
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
    st = _state(trainer)
    path = Path(directory if directory is not None else trainer.args.output_dir)  # type: ignore[arg-type]
    path.mkdir(parents=True, exist_ok=True)
    (path / "recipe.yaml").write_text(st.recipe.to_yaml())
    (path / "provenance.json").write_text(st.provenance.model_dump_json(indent=2) + "\n")
    args = trainer.args
    replaced = [
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
    ]
    kept = [
        "num_iterations",
        "gradient_accumulation_steps",
        "steps_per_generation",
        "num_generations",
        "max_completion_length",
        "mask_truncated_completions",
        "temperature",
        "use_vllm",
    ]
    kl = ["beta", "use_bias_correction_kl"]
    entropy = ["entropy_coef", "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max"]
    entropy += ["entropy_coef_delta", "entropy_target"]
    (replaced if st.recipe_kl else kept).extend(kl)
    (replaced if st.recipe_entropy else kept).extend(entropy)
    record = {
        "versions": _versions(),
        "adapter": {
            "module": __name__,
            "trainer": type(trainer).__name__,
            "trl_trainer": next(c for c in type(trainer).__mro__ if not issubclass(c, _Mixin)).__name__,
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


# ---------------------------------------------------------------------------------------------------------------------
# State and checks


@dataclass
class _State:
    recipe: Recipe
    compiled: CompiledRecipe
    validate: Validate
    population: Population
    provenance: Provenance
    kl_sequence_level: bool
    #: the batch fields the recipe's gates and regularisers read (entropies are computed only when one does)
    needs: frozenset[str] = frozenset()
    #: the recipe has a KL regulariser: it replaces TRL's beta term (else the adapter adds TRL's own)
    recipe_kl: bool = False
    #: the recipe has an entropy regulariser: it replaces TRL's bonus (else the adapter adds TRL's static one)
    recipe_entropy: bool = False
    #: the recipe's top_entropy quantile: TRL's static bonus then acts on the high-entropy tokens only
    top_entropy_quantile: float | None = None
    metrics: MetricLevel = "basic"
    rewards_per_func: torch.Tensor | None = None
    rounds: int = 0
    record_written: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _state(trainer: object) -> _State:
    st: _State | None = getattr(trainer, "_lossplug", None)
    if st is None:
        raise LossplugError("this trainer has no lossplug recipe: build a LossplugGRPOTrainer or call attach()")
    return st


def _check_options(validate: str, population: str, metrics: bool | str = "basic") -> MetricLevel:
    """Checks the adapter's options; returns the metric level."""
    if validate not in VALIDATE:
        raise LossplugError(f"validate must be one of {VALIDATE}, got {validate!r}")
    if population not in POPULATIONS:
        raise LossplugError(f"population must be one of {POPULATIONS}, got {population!r}")
    from lossplug.pipeline import metric_level

    return metric_level(metrics)


def _regulariser_stages(compiled: CompiledRecipe) -> tuple[Any, ...]:
    """The compiled recipe's regulariser stages (none before the regulariser kind existed)."""
    return tuple(getattr(compiled, "regularisers", ()))


def _named(stages: tuple[Any, ...], name: str) -> list[Any]:
    return [s for s in stages if s.plugin.name == name]


def _spec(stage: Mapping[str, Any]) -> str:
    """A stage as a recipe line: ``{name: tis, cap: 3.0}``."""
    params = ", ".join(f"{k}: {v}" for k, v in stage.items() if k != "name")
    return "{name: " + str(stage["name"]) + (", " + params if params else "") + "}"


def _same_params(stage: Any, wanted: dict[str, Any]) -> bool:
    """Whether a compiled stage has the parameters of the ``wanted`` spec (the ones it names)."""
    named = {k: v for k, v in wanted.items() if k != "name"}
    try:  # through the plugin's own model, so that equal settings written differently compare equal
        want = type(stage.params).model_validate({**stage.params.model_dump(), **named}).model_dump()
    except ValueError:
        return False
    got = stage.params.model_dump()

    def norm(key: str, value: Any) -> Any:  # a regulariser's reduction, as compiled: a mapping
        return {"name": value} if key == "reduction" and isinstance(value, str) else value

    return all(norm(k, got.get(k)) == norm(k, want.get(k)) for k in named)


def _refusals(trainer: GRPOTrainer, compiled: CompiledRecipe, provenance: Provenance) -> list[str]:
    trl = _trl()
    args = _config(trainer)
    out: list[str] = []
    if args.use_liger_kernel and _version_tuple(trl.__version__) < (1, 14):
        out.append(
            "use_liger_kernel=True: on TRL < 1.14 Liger's GRPO loss bypasses _compute_loss, so the recipe "
            "would never run"
        )
    gates = compiled.gates
    regularisers = _regulariser_stages(compiled)
    reads = {f for stage in (*gates, *regularisers) for f in required_fields(stage.plugin, stage.params)}

    # TRL options that weight the policy term: the recipe must carry exactly the same weight as a gate (it replaces
    # TRL's, which the adapter never applies) — never silently dropped or changed
    has_behavior = args.use_vllm or getattr(trainer, "rollout_func", None) is not None
    wanted: list[tuple[str, dict[str, Any], str]] = []  # (TRL's setting, the gate it is, how to unset it)
    if args.use_vllm and args.vllm_importance_sampling_correction:
        what = f"use_vllm with vllm_importance_sampling_correction=True (mode {args.vllm_importance_sampling_mode!r})"
        if compiled.update.plugin.name == "vespo":
            vespo = {
                "name": "vespo",
                "engine_correction": args.vllm_importance_sampling_mode,
                "engine_ratio_min": args.vllm_importance_sampling_clip_min,
                "engine_ratio_max": args.vllm_importance_sampling_clip_max,
            }
            if not _same_params(compiled.update, vespo):
                out.append(
                    f"{what}: with a vespo update gate TRL folds its IS ratio into the gamma weight; set the gate's "
                    f"engine_correction: {vespo['engine_correction']}, engine_ratio_min: {vespo['engine_ratio_min']}, "
                    f"engine_ratio_max: {vespo['engine_ratio_max']} (or vllm_importance_sampling_correction=False)"
                )
        else:
            engine = _engine_correction(args)
            assert engine is not None
            wanted.append(
                (f"{what}: TRL's importance-sampling correction", engine, "vllm_importance_sampling_correction=False")
            )
    if args.off_policy_mask_threshold is not None:
        wanted.append(
            (
                f"off_policy_mask_threshold={args.off_policy_mask_threshold}: TRL's off-policy sequence mask",
                _off_policy_mask(args, has_behavior),
                "off_policy_mask_threshold=None",
            )
        )
    if args.top_entropy_quantile < 1.0:
        wanted.append(
            (
                f"top_entropy_quantile={args.top_entropy_quantile}: TRL's high-entropy token mask",
                {"name": "top_entropy", "quantile": args.top_entropy_quantile},
                "top_entropy_quantile=1.0",
            )
        )
    for what, gate, unset in wanted:
        if not any(_same_params(s, gate) for s in _named(gates[1:], gate["name"])):
            out.append(
                f"{what} is a recipe gate in lossplug (which never applies TRL's own): add gates: [..., "
                f"{_spec(gate)}] (what trl_equivalent maps it to; a gate of other settings would silently change "
                f"TRL's) or set {unset}"
            )

    # KL and entropy: one term each, never counted twice
    trl_terms = {r["name"]: r for r in _regularisers(args)}
    kl_stages = _named(regularisers, "kl")
    if kl_stages:
        coef = sum(float(s.params.coef) for s in kl_stages)
        if trainer.beta == 0.0:
            out.append(
                f"the recipe has a KL regulariser, but beta=0: TRL computes reference log-probs only when beta != 0. "
                f"Set beta={coef} (the recipe's KL coefficient): the recipe's KL then replaces TRL's"
            )
        elif abs(coef - trainer.beta) > 1e-12 * max(abs(coef), abs(trainer.beta)):
            out.append(
                f"the recipe has a KL regulariser (coef {coef}) and TRL's beta={trainer.beta} is another: the KL would "
                f"be set twice. Set beta={coef} (it then only switches TRL's reference log-probs on; the recipe's KL "
                "replaces TRL's) or drop the recipe's KL stage"
            )
    entropy_stages = _named(regularisers, "entropy")
    trl_entropy = trl_terms.get("entropy")
    if entropy_stages and (args.entropy_coef != 0.0 or args.use_adaptive_entropy):
        if trl_entropy is None or len(entropy_stages) > 1 or not _same_params(entropy_stages[0], trl_entropy):
            same = f" or make the stage {_spec(trl_entropy)}" if trl_entropy is not None else ""
            out.append(
                f"the recipe has an entropy regulariser and TRL's entropy bonus is on as well (entropy_coef="
                f"{args.entropy_coef}, use_adaptive_entropy={args.use_adaptive_entropy}, top_entropy_quantile="
                f"{args.top_entropy_quantile}) with other settings: it would be counted twice. Set entropy_coef=0 "
                f"and use_adaptive_entropy=False (the recipe's replaces TRL's){same}"
            )
    elif args.use_adaptive_entropy:
        out.append(
            f"use_adaptive_entropy=True: the adaptive coefficient is a recipe regulariser in lossplug; add "
            f"regularisers: [..., {_spec(cast(dict[str, Any], trl_entropy))}] (what trl_equivalent maps it to)"
        )

    provided = set(_PROVIDED)
    if trainer.beta != 0.0:
        provided.add("ref_logp")
    if has_behavior:
        provided.add("behavior_logp")
    for stage in (*gates, *regularisers):
        for name in required_fields(stage.plugin, stage.params):
            if name in provided:
                continue
            why = {
                "ref_logp": "TRL computes reference log-probs only when beta != 0",
                "behavior_logp": "TRL has rollout log-probs only with use_vllm=True or a rollout_func",
            }.get(name, "GRPOTrainer has no such field")
            out.append(f"{stage.where} ({stage.plugin.name}) reads {name}: {why}")
    adv_stage = compiled.advantage
    if adv_stage is not None:
        missing = [f for f in required_fields(adv_stage.plugin, adv_stage.params) if f not in _ADVANTAGE_PROVIDED]
        if missing:
            out.append(
                f"recipe.advantage ({adv_stage.plugin.name}) reads {', '.join(missing)}: in TRL the advantage "
                "stage sees only the rewards, the per-function rewards and the prompt groups (no critic, no token "
                "rewards)"
            )
        if "padded" not in adv_stage.plugin.layouts:
            out.append(f"recipe.advantage ({adv_stage.plugin.name}) works on the packed layout only")
    if "behavior_logp" in reads and not any("behavior_logp" in m for m in out) and has_behavior:
        try:
            provenance.check()
        except LossplugError as err:
            out.append(f"the recipe reads behavior_logp, but {err}")
    return out


def _setup(
    trainer: Any,
    recipe: RecipeLike,
    validate: Validate,
    population: Population,
    provenance: Provenance | None,
    metrics: bool | MetricLevel = "basic",
) -> None:
    trl = _trl()
    level = _check_options(validate, population, metrics)
    if isinstance(trainer, trl.RLOOTrainer):
        raise LossplugError(
            "RLOOTrainer is not supported: its batches carry per-sequence summed old log-probs (old_logps [B]) and a "
            "KL folded into the reward, so lossplug's token-level gates cannot run on them without forking it. Use "
            "LossplugGRPOTrainer (or attach to a GRPOTrainer) with recipe 'rloo' for a leave-one-out baseline."
        )
    if not isinstance(trainer, trl.GRPOTrainer):
        raise LossplugError(
            f"lossplug.adapters.trl supports GRPOTrainer (and its subclasses), got {type(trainer).__name__}"
        )
    owner = next(c for c in type(trainer).__mro__ if "_compute_loss" in c.__dict__ and c is not _Mixin)
    if owner is not trl.GRPOTrainer and not issubclass(owner, _Mixin):  # a user class between us and GRPOTrainer
        raise LossplugError(
            f"{owner.__name__} overrides _compute_loss: lossplug replaces _compute_loss and would "
            "silently discard that code; attach to a class that does not override it"
        )
    recipe_obj = Recipe.load(recipe)
    compiled = lossplug.compile_recipe(recipe_obj)
    provenance = provenance if provenance is not None else trl_provenance(trainer)
    problems = _refusals(trainer, compiled, provenance)
    if problems:
        raise LossplugError(
            "lossplug cannot run this recipe in this TRL trainer without changing its meaning:\n  - "
            + "\n  - ".join(problems)
        )
    regularisers = _regulariser_stages(compiled)
    top_entropy = _named(compiled.gates, "top_entropy")
    if top_entropy and trainer.accelerator.num_processes > 1:
        warnings.warn(
            "lossplug: the top_entropy gate takes the entropy quantile over each process's micro-batch; TRL's "
            "top_entropy_quantile gathers the action entropies of all processes first — the thresholds differ "
            f"across the {trainer.accelerator.num_processes} processes (equal on one process)",
            stacklevel=3,
        )
    trainer._lossplug = _State(
        recipe=recipe_obj,
        compiled=compiled,
        validate=validate,
        population=population,
        provenance=provenance,
        metrics=level,
        kl_sequence_level=compiled.update.plugin.level == "sequence",
        needs=frozenset(
            f for stage in (*compiled.gates, *regularisers) for f in required_fields(stage.plugin, stage.params)
        ),
        recipe_kl=bool(_named(regularisers, "kl")),
        recipe_entropy=bool(_named(regularisers, "entropy")),
        top_entropy_quantile=top_entropy[0].params.quantile if top_entropy else None,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Advantages from the gathered rewards


def group_advantages(
    trainer: GRPOTrainer, rewards_per_func: torch.Tensor, num_generations: int
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(advantages, rewards, group_ids, metrics)`` for the rows TRL gathered over all processes.

    ``rewards``: TRL's weighted sum of the reward functions (NaN where every function returned ``None``); groups are
    consecutive runs of ``num_generations`` rows (TRL's sampler). Unscorable rows are left out of the advantage
    batch (TRL's nan-mean/nan-std ignore them) and get advantage 0. Without a recipe advantage stage ``advantages``
    is ``None``.
    """
    st = _state(trainer)
    device = rewards_per_func.device
    weights = trainer.reward_weights.to(device).unsqueeze(0)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights).nansum(dim=1)
    rewards = torch.where(unscorable, torch.full_like(rewards, float("nan")), rewards)
    n = rewards.shape[0]
    groups_per_round = (n + num_generations - 1) // num_generations
    group_ids = st.rounds * groups_per_round + torch.arange(n, device=device) // num_generations
    st.rounds += 1
    metrics: dict[str, torch.Tensor] = {}
    if st.compiled.advantage is None:
        return None, rewards, group_ids, metrics
    valid = ~unscorable
    min_size = st.compiled.advantage.plugin.min_group_size
    too_small = torch.zeros_like(valid)
    some_unscorable = bool(unscorable.any())
    if min_size > 1 and some_unscorable:
        # Leaving unscorable rows out can shrink a group below what the estimator needs (RLOO: 2). Those rows get
        # advantage 0 like the unscorable ones — with a metric and a warning, never silently and never a crash
        # in the middle of a run.
        _, inverse, counts = torch.unique(group_ids[valid], return_inverse=True, return_counts=True)
        small = torch.zeros_like(valid)
        small[valid] = counts[inverse] < min_size
        too_small = small
        valid = valid & ~small
        if bool(small.any()):
            warnings.warn(
                f"lossplug: {int(small.sum())} completions are in groups with fewer than {min_size} "
                f"scorable completions, which recipe.advantage ({st.compiled.advantage.plugin.name}) "
                "needs; they get advantage 0 (metric lossplug/reward/too_small_group_frac)",
                stacklevel=2,
            )
    everything = not some_unscorable and not bool(too_small.any())  # the usual case: no row left out
    advantages = torch.zeros_like(rewards)
    if everything or bool(valid.any()):
        r, ids = (rewards, group_ids) if everything else (rewards[valid], group_ids[valid])
        components = None
        if "reward_components" in required_fields(st.compiled.advantage.plugin, st.compiled.advantage.params):
            components = rewards_per_func if everything else rewards_per_func[valid]
            unscored = torch.isnan(components)
            if bool(unscored.any()):
                rows = unscored.any(-1).nonzero().squeeze(-1).tolist()[:8]
                funcs = sorted({trainer.reward_func_names[k] for k in unscored.nonzero()[:, 1].tolist()})
                raise LossplugError(
                    f"recipe.advantage ({st.compiled.advantage.plugin.name}) reads reward_components, but reward "
                    f"function(s) {funcs} returned None for some completions (rows {rows} of the scorable ones): "
                    "lossplug's per-function rewards must all be scored (TRL's NaN-aware per-function means are not "
                    "reproduced); return a number from every reward function or use sum_then_normalize"
                )
        batch = PolicyBatch.unchecked(
            logp=torch.zeros(r.shape[0], 1, dtype=r.dtype, device=device),
            action_mask=torch.ones(r.shape[0], 1, dtype=torch.bool, device=device),
            reward=r,
            group_id=ids,
            reward_components=components,
        )
        result = lossplug.estimate_advantages(batch, st.recipe, validate=st.validate)
        adv = result.advantage
        if adv.ndim == 2:  # a token-level estimator over the single placeholder position
            adv = adv[:, 0]
        if everything:
            advantages = adv.to(advantages.dtype)
        else:
            advantages[valid] = adv.to(advantages.dtype)
        metrics.update({f"advantage/{k}": v for k, v in result.metric_tensors.items()})
    with torch.no_grad():
        metrics["advantage/mean"] = advantages.mean()
        metrics["advantage/std"] = advantages.std() if n > 1 else torch.zeros((), device=device)
        metrics["advantage/zero_frac"] = (advantages == 0).float().mean()
        metrics["reward/unscorable_frac"] = unscorable.float().mean()
        if min_size > 1:
            metrics["reward/too_small_group_frac"] = too_small.float().mean()
    return advantages, rewards, group_ids, metrics


# ---------------------------------------------------------------------------------------------------------------------
# The trainer mixin


def _log_metrics(trainer: GRPOTrainer, mode: str, metrics: dict[str, torch.Tensor]) -> None:
    """Append ``lossplug/<name>`` to TRL's metric lists, averaged over processes.

    Processes may hold different metric names (a micro-batch whose rows were all masked out computes no policy
    metrics), so with several processes the names are agreed on first and a missing value is NaN (ignored by the
    nan-mean here and by TRL's ``log``).
    """
    accelerator = trainer.accelerator
    names = sorted(metrics)
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        names = sorted({n for names_r in gather_object([names]) for n in names_r})
    if not names:
        return
    device = accelerator.device
    wide = torch.float32 if torch.device(device).type == "mps" else torch.float64  # e^100 stays a number
    nan = torch.tensor(float("nan"), device=device, dtype=wide)
    values = torch.stack(
        [metrics[k].detach().reshape(()).to(device=device, dtype=wide) if k in metrics else nan for k in names]
    )
    if accelerator.num_processes > 1:
        values = accelerator.gather(values.unsqueeze(0)).nanmean(0)
    for name, value in zip(names, values.tolist()):
        trainer._metrics[mode][f"lossplug/{name}"].append(value)


#: the file, in each checkpoint folder, holding the recipe's controller state (adaptive coefficients)
CONTROLLER_STATE_FILE = "lossplug_controllers.json"


def _controllers(recipe: Recipe) -> dict[str, StepController]:
    """The recipe's step controllers (adaptive regulariser coefficients), by stage."""
    from lossplug.control import controllers

    return controllers(recipe)


def _step_controllers(trainer: GRPOTrainer, st: _State, mode: str) -> None:
    """At an optimizer-step boundary (the window's last micro-batch, after its loss used the coefficient in force —
    TRL's order), step the recipe's controllers on the window's observations summed over processes; evaluation never
    moves a coefficient (TRL: train mode only). Logs TRL's ``entropy_coef`` for the recipe's entropy stage as TRL
    does (every optimizer step: the adaptive coefficient just updated, or the static one)."""
    if mode != "train" or not trainer.accelerator.sync_gradients:
        return
    ctrls = _controllers(st.recipe)
    accelerator = trainer.accelerator
    all_reduce = (lambda t: accelerator.reduce(t, reduction="sum")) if accelerator.num_processes > 1 else None
    for stage in _regulariser_stages(lossplug.compile_recipe(st.recipe)):
        where = stage.where.removeprefix("recipe.")
        ctrl = ctrls.get(where)
        coefficient = float(ctrl.step(all_reduce)) if ctrl is not None else float(stage.params.coef)
        if stage.plugin.name == "entropy":
            trainer._metrics[mode]["entropy_coef"].append(coefficient)


class _Mixin(_TrainerBase):
    """The overrides; combined with ``GRPOTrainer`` (or a user's subclass of it) by :func:`attach`."""

    _lossplug: _State
    if TYPE_CHECKING:  # what TRL types more loosely (TrainingArguments, an optional model)
        args: GRPOConfig
        model: Any

    # -- records --------------------------------------------------------------------------------------------------
    def train(self, *args: Any, **kwargs: Any) -> Any:
        st = _state(self)
        if not st.record_written and self.accelerator.is_main_process:
            write_record(self)
            st.record_written = True
        return super().train(*args, **kwargs)

    # -- advantages -----------------------------------------------------------------------------------------------
    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> Any:
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        _state(self).rewards_per_func = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(
        self, inputs: list[dict[str, torch.Tensor | Any]]
    ) -> dict[str, torch.Tensor | Any]:
        st = _state(self)
        st.rewards_per_func = None
        output = super()._generate_and_score_completions(inputs)
        rewards_per_func, st.rewards_per_func = st.rewards_per_func, None
        if rewards_per_func is None:
            raise LossplugError(
                "TRL's _generate_and_score_completions did not call _calculate_rewards: this TRL "
                "version is not supported by lossplug.adapters.trl"
            )
        mode = "train" if self.model.training else "eval"
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        advantages, rewards, group_ids, metrics = group_advantages(self, rewards_per_func, num_generations)
        n_local = output["completion_ids"].shape[0]
        local = slice(self.accelerator.process_index * n_local, (self.accelerator.process_index + 1) * n_local)
        if advantages is not None:
            trl_adv = output["advantages"]
            output["advantages"] = advantages[local].to(device=trl_adv.device, dtype=trl_adv.dtype)
            logged = self._logs["advantages"]  # TRL's completions table: show the advantages actually used
            values = advantages.tolist()[-len(logged) :] if len(logged) else []
            for i, v in enumerate(values):
                logged[len(logged) - len(values) + i] = v
        output["lossplug_group_id"] = group_ids[local]
        output["lossplug_reward"] = rewards[local]
        # one column per reward function, unweighted (NaN where a function returned None): TRL's rewards_per_func
        output["lossplug_reward_components"] = rewards_per_func[local]
        _log_metrics(self, mode, metrics)
        return output

    # -- loss -----------------------------------------------------------------------------------------------------
    def _compute_loss(self, model: Any, inputs: Any) -> torch.Tensor:
        st = _state(self)
        mode = "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        # TRL's own terms, where the recipe has none of its own (read here: TRL's attributes are the truth)
        trl_kl = self.beta != 0.0 and not st.recipe_kl
        trl_entropy = bool(self._entropy_bonus_enabled) and not st.recipe_entropy
        # always, as TRL's own _compute_loss does: its ``entropy`` metric stays on every dashboard
        out = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{k: inputs.get(k) for k in _FORWARD_KEYS},
        )
        logps, entropies = out[0], out[1]
        aux_loss = out[2] if len(out) > 2 else None

        action = mask.bool()
        B = action.shape[0]
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        metrics: dict[str, torch.Tensor] = {}

        # population and TRL's scaling (see the module docstring)
        processes = self.accelerator.num_processes
        if mode == "train":
            # steps_per_generation: Optional in GRPOConfig's fields, always set by its __post_init__
            steps, accumulation = cast(int, self.args.steps_per_generation), self.current_gradient_accumulation_steps
        else:
            steps, accumulation = 1, 1
        scale = processes * steps / accumulation
        sequences = B * steps * processes
        if st.population == "generation":
            tokens = int(inputs["num_items_in_batch"])
        else:
            tokens = int(action.sum()) * steps * processes
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        normalizer = Normalizer(
            action_tokens=max(tokens, 1),
            sequences=sequences,
            groups=sequences // num_generations if sequences % num_generations == 0 else None,
            budget=float(self.max_completion_length),  # type: ignore[arg-type]
            # TRL's per-micro-batch means (its entropy bonus) each weigh 1 / accumulation, and DDP averages the
            # processes: with the adapter's scale, 1 / (steps × processes) of a micro-batch's own mean, whatever
            # rows the micro-batch lost to mask_truncated_completions
            micro_batches=steps * processes,
        )

        keep = action.any(-1)
        rows = keep.nonzero().squeeze(-1) if not bool(keep.all()) else None

        def take(t: Any) -> Any:
            return t if (t is None or rows is None) else t[rows]

        if rows is not None and rows.numel() == 0:  # nothing to learn from in this micro-batch
            loss = torch.where(action, logps, 0).sum() * 0.0
        else:
            behavior = inputs.get("sampling_per_token_logps")
            if behavior is not None:
                unscored = torch.isnan(behavior)
                metrics["behavior_logp/unscored_frac"] = (unscored & action).sum() / action.sum().clamp(min=1)
                behavior = torch.where(unscored, old, behavior)
            advantages = inputs["advantages"]
            reward = inputs.get("lossplug_reward")
            if reward is not None and not bool(torch.isfinite(take(reward)).all()):
                reward = None
            components = inputs.get("lossplug_reward_components") if "reward_components" in st.needs else None
            if components is not None and not bool(torch.isfinite(take(components)).all()):
                components = None  # (a function returned None for some row: the contract's rule names the field)
            batch = PolicyBatch.unchecked(
                logp=take(logps),
                action_mask=take(action),
                old_logp=take(old),
                behavior_logp=take(behavior),
                ref_logp=take(inputs.get("ref_per_token_logps")) if self.beta != 0.0 else None,
                advantage=take(advantages),
                group_id=take(inputs.get("lossplug_group_id")),
                reward=take(reward),
                entropy=take(entropies) if "entropy" in st.needs else None,
                reward_components=take(components),
            )
            result = lossplug.policy_loss(
                batch,
                st.recipe,
                normalizer,
                validate=st.validate,
                metrics=st.metrics,
                observe=mode == "train",  # evaluation never moves an adaptive coefficient (TRL: train mode only)
            )
            loss = result.loss * scale
            metrics.update(result.metric_tensors)
            # this micro-batch's share × the number of micro-batches: averaged over the micro-batches (and processes)
            # at log time, the recipe's loss over the whole population
            metrics["loss"] = result.loss.detach() * steps * processes
        _step_controllers(self, st, mode)

        per_token_kl = None
        if trl_kl:  # TRL's beta KL, the recipe having none of its own
            ref = inputs["ref_per_token_logps"]
            delta = torch.where(action, ref - logps, 0)
            per_token_kl = torch.exp(delta) - delta - 1
            if self.args.use_bias_correction_kl:
                log_ratio = torch.where(action, logps - old, 0)
                if st.kl_sequence_level:
                    log_ratio = (log_ratio.sum(-1) / action.sum(-1).clamp(min=1)).unsqueeze(-1)
                per_token_kl = per_token_kl * log_ratio.clamp(-20, 20).exp()
            if rows is None or rows.numel() > 0:
                kl_term = lossplug.reduce(take(per_token_kl), take(action), st.recipe, normalizer)
                loss = loss + self.beta * kl_term * scale
                metrics["kl"] = kl_term.detach() * steps * processes  # reduced like the loss (not × beta)

        if trl_entropy:  # TRL's static entropy bonus, the recipe having no entropy regulariser
            assert entropies is not None  # computed: compute_entropy=True
            effective = mask
            if st.top_entropy_quantile is not None:  # TRL: the bonus acts on the tokens the entropy mask keeps
                effective = mask * self.get_high_entropy_mask(entropies, mask, 1 - st.top_entropy_quantile)
            entropy_loss = (entropies * effective).sum() / effective.sum().clamp(min=1.0) / accumulation
            policy_loss = loss.detach()
            loss = loss - self.entropy_coef * entropy_loss
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        if self.aux_loss_enabled and aux_loss is not None:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        # TRL's metrics, same names and definitions
        def global_masked_mean(x: torch.Tensor) -> float:
            totals = self.accelerator.reduce(torch.stack([(x * mask).sum(), mask.sum().float()]), reduction="sum")
            mean: float = (totals[0] / totals[1].clamp(min=1.0)).item()
            return mean

        with torch.no_grad():
            if per_token_kl is not None:
                self._metrics[mode]["kl"].append(global_masked_mean(per_token_kl.detach()))
            if entropies is not None:
                self._metrics[mode]["entropy"].append(global_masked_mean(entropies.detach()))
        recipe_kl = self._metrics[mode]["lossplug/reg/kl/token_mean"] if st.recipe_kl else None
        logged = len(recipe_kl) if recipe_kl is not None else 0
        _log_metrics(self, mode, metrics)
        if recipe_kl is not None and len(recipe_kl) > logged:
            # TRL's "kl" metric (the token mean of the KL term), from the recipe's KL: averaged over the processes
            # like every lossplug metric (TRL reduces sums and counts instead)
            self._metrics[mode]["kl"].append(recipe_kl[-1])
        return loss

    # -- checkpoints: the recipe's controller state (adaptive coefficients) ----------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        from lossplug.control import controller_state

        state = controller_state(_state(self).recipe)
        if state and self.args.should_save:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            (folder / CONTROLLER_STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = Path(checkpoint) / CONTROLLER_STATE_FILE
        if path.is_file():
            from lossplug.control import load_controller_state

            load_controller_state(_state(self).recipe, json.loads(path.read_text()))


# ---------------------------------------------------------------------------------------------------------------------
# Public entry points

_CLASSES: dict[type, type] = {}
_GRPO_CLASS: type | None = None


def _class_for(base: type) -> type:
    """The lossplug subclass of ``base`` (cached): ``LossplugGRPOTrainer`` for ``GRPOTrainer`` itself."""
    if issubclass(base, _Mixin):
        return base
    cls = _CLASSES.get(base)
    if cls is None:
        trl = _trl()
        if base is trl.GRPOTrainer:
            cls = _grpo_class()
        else:
            namespace = {"__module__": __name__, "__doc__": f"{base.__name__} with a lossplug recipe"}
            cls = type(f"Lossplug{base.__name__}", (_Mixin, base), namespace)
        _CLASSES[base] = cls
    return cls


def _grpo_class() -> type:
    global _GRPO_CLASS
    if _GRPO_CLASS is not None:
        return _GRPO_CLASS
    trl = _trl()

    class LossplugGRPOTrainer(_Mixin, trl.GRPOTrainer):  # type: ignore[name-defined, misc]  # (trl: Any here)
        """TRL's ``GRPOTrainer`` whose advantage and loss come from a lossplug recipe.

        ``LossplugGRPOTrainer(model, reward_funcs, args, ..., recipe="dapo", validate="full",
        population="generation", metrics="basic", provenance=None)`` — every ``GRPOTrainer`` argument, plus:

        * ``recipe``: a :class:`lossplug.Recipe`, a preset name, a mapping or a YAML/JSON path;
        * ``validate``: ``"full"`` (every batch checked against the contracts) or ``"off"``;
        * ``population``: ``"generation"`` or ``"micro_batch"`` (see :mod:`lossplug.adapters.trl`);
        * ``metrics``: ``"basic"`` (every micro-batch: the loss, ``update/approx_kl`` and each gate's cut fractions,
          at about the cost of TRL's own clip-ratio metrics), ``"full"`` (also ratio quantiles and effective-sample
          fractions: a few ms per micro-batch at 64 × 4096 on a CPU) or ``"off"``; logged as ``lossplug/<name>``;
        * ``provenance``: a :class:`lossplug.Provenance` to record instead of the one derived from the config.
        """

        def __init__(
            self,
            *args: Any,
            recipe: RecipeLike,
            validate: Validate = "full",
            population: Population = "generation",
            metrics: bool | MetricLevel = "basic",
            provenance: Provenance | None = None,
            **kwargs: Any,
        ) -> None:
            _check_options(validate, population, metrics)
            recipe_obj = Recipe.load(recipe)  # a bad recipe fails before any model is loaded
            lossplug.compile_recipe(recipe_obj)
            super().__init__(*args, **kwargs)
            _setup(self, recipe_obj, validate, population, provenance, metrics)

    LossplugGRPOTrainer.__module__ = __name__
    LossplugGRPOTrainer.__qualname__ = "LossplugGRPOTrainer"
    _GRPO_CLASS = LossplugGRPOTrainer
    return LossplugGRPOTrainer


def attach(
    trainer: _T,
    recipe: RecipeLike,
    *,
    validate: Validate = "full",
    population: Population = "generation",
    metrics: bool | MetricLevel = "basic",
    provenance: Provenance | None = None,
) -> _T:
    """Make an already-built ``GRPOTrainer`` (or subclass) run ``recipe``; returns the same object.

    Its class is swapped for a lossplug subclass of its own class (``LossplugGRPOTrainer`` for a plain
    ``GRPOTrainer``); nothing else about it changes, except that completions TRL already buffered (attaching during
    training) are dropped so that every batch the recipe sees was scored by it. Attaching again replaces the
    recipe.
    """
    trl = _trl()
    if isinstance(trainer, trl.RLOOTrainer) or not isinstance(trainer, trl.GRPOTrainer):
        _setup(trainer, recipe, validate, population, provenance, metrics)  # raises the explanatory error
    cls = _class_for(type(trainer))
    previous = trainer.__class__
    trainer.__class__ = cls
    try:
        _setup(trainer, recipe, validate, population, provenance, metrics)
    except Exception:
        trainer.__class__ = previous
        raise
    # completions already buffered (attach during training) carry advantages the recipe did not compute and no
    # group ids: have TRL generate afresh at its next step
    if getattr(trainer, "_buffered_inputs", None) is not None:
        trainer._buffered_inputs = None
    return trainer


if TYPE_CHECKING:

    class LossplugGRPOTrainer(_Mixin, GRPOTrainer):
        """(For type checkers: the class is made on first access, once TRL is imported — see _grpo_class.)"""

        def __init__(
            self,
            *args: Any,
            recipe: RecipeLike,
            validate: Validate = "full",
            population: Population = "generation",
            metrics: bool | MetricLevel = "basic",
            provenance: Provenance | None = None,
            **kwargs: Any,
        ) -> None: ...


def __getattr__(name: str) -> type:
    if name == "LossplugGRPOTrainer":
        return _grpo_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
