"""TRL's own dashboard under lossplug: the keys TRL's ``GRPOTrainer._compute_loss`` logs, with TRL's definitions,
wherever the recipe's stage is the one the key describes (:func:`trl_dashboard`); lossplug's own metrics stay beside
them under ``lossplug/`` (:mod:`lossplug.adapters.trl.metrics`).

=========================  ======================================  ===============================================
TRL key                    logged when                             TRL's definition (per micro-batch)
=========================  ======================================  ===============================================
``entropy``                always                                  token mean of the entropies
``kl``                     ``beta != 0``: TRL's own term, or the   token mean of the per-token KL term (× the
                           recipe's ``kl`` to ``ref_logp``          update ratio with ``use_bias_correction_kl``)
``clip_ratio/low_mean``    update gate ``ppo_clip`` (token level)  mean of ``r < 1 − eps_low`` and ``A < 0``
``clip_ratio/high_mean``   or ``gspo`` (sequence level: ``r`` is   mean of ``r > 1 + eps_high`` and ``A > 0``
``clip_ratio/region_mean`` the response's ratio, each response     mean of either
``clip_ratio/low_min``     counts once); ``r`` capped at the       least per-response low mean (over processes)
``clip_ratio/high_max``    gate's ``delta`` first (ppo_clip's      greatest per-response high mean
                           ``dual_clip_c`` when ``≥ 1 + eps_high``)
``cispo_clip_ratio``       update gate ``cispo`` / ``cispo_seq``   mean of ``r > ratio cap`` and ``A > 0``
``vespo/phi_seq_mean``     update gate ``vespo``                   mean of the responses' weights φ
``policy_loss``            TRL's entropy bonus is on (the          the loss before the entropy bonus (with the KL
                           adapter's, or the recipe's ``entropy``)  term), per micro-batch (see below); mean over
                                                                   the processes
=========================  ======================================  ===============================================

``policy_loss`` is the micro-batch's own value where TRL's loss type divides it by the gradient-accumulation steps
(grpo, sapo, bnpo, dr_grpo, luspo: every reduction but the token mean over the generation batch) and its share of the
window where TRL's does not (dapo, cispo, vespo: the ``token`` reduction over the ``generation`` population).

With ``metrics="off"`` (no lossplug metrics) only ``entropy``, the ``kl`` of TRL's own term and the ``policy_loss``
of the adapter's own entropy bonus are logged: the gate keys are not computed, and the recipe's KL, its entropy
term and vespo's φ are read from the stages' metrics (``token_mean``, ``value``, ``phi_mean``).

``eps_low``, ``eps_high``, the cap and the ratio cap are the recipe gate's own parameters, so a recipe that is
TRL's loss shows TRL's numbers and a recipe that changed a bound shows its own. Every other update gate (sapo has no
key in TRL either, a third-party gate has no TRL definition) adds none of the gate keys. ``A`` is the advantage of
the micro-batch, ``r = exp(logp − old_logp)`` (sequence level: ``exp`` of the response's mean log-ratio).

A mean is TRL's ``global_masked_mean``: the sum and the count over the micro-batch's action tokens (one per response
for sequence-level values, every row counted — a row without action tokens too, as TRL counts it), summed over the
processes, then divided; ``low_min`` / ``high_max`` are the least / greatest per-response mean over the processes'
responses, NaN-ignoring (TRL's ``nanmin`` / ``nanmax`` of the gathered means). One value per micro-batch, averaged
by TRL's ``log`` — TRL's own bookkeeping. Everything is read in one gather and one device→host transfer per
micro-batch (TRL makes one ``.item()`` per key).

Reference: TRL 1.16 ``trl/trainer/grpo_trainer.py`` ``GRPOTrainer._compute_loss`` (its metric block:
``masked_seq_mean``, ``global_masked_mean``, ``nanmin`` / ``nanmax`` of ``accelerator.gather``) and
``get_gamma_weights`` (VESPO's φ, 1 for a response without action tokens).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator

    from lossplug.adapters.common import ActionRows
    from lossplug.pipeline import CompiledRecipe

__all__ = ["ClipRule", "DashboardPlan", "clip_rule", "dashboard_plan", "trl_dashboard", "trl_policy_loss"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class ClipRule:
    """TRL's clip-ratio keys for the update gate: ``ppo`` (``clip_ratio/*``) or ``cispo`` (``cispo_clip_ratio``)."""

    family: Literal["ppo", "cispo"]
    #: the ratio is one per response (TRL's ``importance_sampling_level="sequence"``)
    sequence: bool
    #: a ratio below ``low`` (A < 0) is low-clipped; ``None``: no low side (cispo)
    low: float | None
    #: a ratio above ``high`` (A > 0) is high-clipped (cispo: the weight's cap)
    high: float
    #: TRL's ``delta``: the ratio is capped here before it is compared (``coef_1 = clamp(coef_1, max=delta)``)
    cap: float | None = None


def clip_rule(compiled: CompiledRecipe) -> ClipRule | None:
    """The clip keys TRL would log for the recipe's update gate, with the gate's own bounds; ``None`` for a gate TRL
    has no clip key for. Built-ins are recognised by their parameter models, not only their names (a plugin that
    took a built-in's name is not the built-in)."""
    from lossplug.plugins.gates.cispo import CISPOParams
    from lossplug.plugins.gates.gspo import GSPOParams
    from lossplug.plugins.gates.ppo_clip import PPOClipParams

    name, p = compiled.update.plugin.name, compiled.update.params
    if name == "ppo_clip" and isinstance(p, PPOClipParams):
        # TRL caps the ratio at delta before counting; a dual clip is TRL's delta only at c ≥ 1 + eps_high (it leaves
        # the ratio of A > 0 tokens alone): TRL's cap there, the gate's own cut below
        c = p.dual_clip_c
        cap = p.delta if p.delta is not None else (c if c is not None and c >= 1 + p.eps_high else None)
        return ClipRule("ppo", False, 1 - p.eps_low, 1 + p.eps_high, cap)
    if name == "gspo" and isinstance(p, GSPOParams):
        return ClipRule("ppo", True, 1 - p.eps_low, 1 + p.eps_high, p.delta)
    if name in ("cispo", "cispo_seq") and isinstance(p, CISPOParams):
        return ClipRule("cispo", name == "cispo_seq", None, p.upper)
    return None


@dataclass(frozen=True)
class DashboardPlan:
    """Which of TRL's keys a recipe gets (see the table in :mod:`lossplug.adapters.trl.dashboard`)."""

    clip: ClipRule | None
    #: the update gate is vespo: TRL's ``vespo/phi_seq_mean`` from the gate's ``phi_mean``
    vespo: bool
    #: the lossplug metric holding the token mean of the recipe's KL to the reference (``reg/<name>/token_mean``)
    recipe_kl_metric: str | None
    #: the metric names (``reg/<name>``) of the recipe's entropy regularizers: TRL's policy_loss is before them
    recipe_entropy_metrics: tuple[str, ...] = ()
    #: TRL's policy_loss is the micro-batch's own value (× the accumulation steps of the returned loss), not its share
    #: of the window (TRL's dapo, cispo, vespo: the token mean over the generation batch)
    policy_loss_per_micro_batch: bool = True


def dashboard_plan(compiled: CompiledRecipe, population: str = "generation") -> DashboardPlan:
    """The keys of TRL's dashboard that ``compiled`` gets, run with the adapter's ``population``."""
    from lossplug.plugins.gates.vespo import VESPOParams
    from lossplug.plugins.regularizers.kl import KLParams

    update = compiled.update
    kl_metric = next(
        (
            f"reg/{stage.metric_name}/token_mean"
            for stage in compiled.regularizers
            if stage.plugin.name == "kl" and isinstance(stage.params, KLParams) and stage.params.anchor == "ref_logp"
        ),
        None,
    )
    reduction = compiled.reduction
    window_share = (
        reduction.plugin.name == "token"
        and population == "generation"
        and getattr(reduction.params, "population", "step") != "micro_batch"
    )
    return DashboardPlan(
        clip=clip_rule(compiled),
        vespo=update.plugin.name == "vespo" and isinstance(update.params, VESPOParams),
        recipe_kl_metric=kl_metric,
        recipe_entropy_metrics=tuple(
            f"reg/{stage.metric_name}" for stage in compiled.regularizers if stage.plugin.name == "entropy"
        ),
        policy_loss_per_micro_batch=not window_share,
    )


class _Reductions:
    """Local statistics read as TRL reduces them: sums and counts added over the processes, extremes taken over
    them — all in one gather and one device→host transfer."""

    def __init__(self) -> None:
        self.values: list[Tensor] = []
        self.keys: list[tuple[str, str, int]] = []

    def mean(self, key: str, total: Tensor, count: Tensor) -> None:
        self.keys.append((key, "mean", len(self.values)))
        self.values += [total, count]

    def masked_mean(self, key: str, x: Tensor, mask: Tensor) -> None:
        """TRL's ``global_masked_mean``: over the action tokens, or over every row for a ``[B, 1]`` value."""
        if x.shape[1] == 1:
            self.mean(key, x.sum(), x.new_full((), float(x.shape[0])))  # (a fill: no host→device copy)
        else:
            self.mean(key, (x * mask).sum(), mask.sum().float())

    def process_mean(self, key: str, value: Tensor) -> None:
        """TRL's ``gather(value).nanmean()``: the mean over the processes of one value each."""
        self.keys.append((key, "process_mean", len(self.values)))
        self.values.append(value)

    def extreme(self, key: str, how: Literal["min", "max"], per_response: Tensor) -> None:
        """TRL's ``nanmin`` / ``nanmax`` of the gathered per-response values: the local extreme, NaN-ignoring (±inf
        when every value is NaN: none counts)."""
        fill = math.inf if how == "min" else -math.inf
        ignored = torch.where(torch.isnan(per_response), fill, per_response)
        self.keys.append((key, how, len(self.values)))
        self.values.append(ignored.amin() if how == "min" else ignored.amax())

    def read(self, accelerator: Accelerator) -> dict[str, float]:
        if not self.values:
            return {}
        device = self.values[0].device
        wide = torch.float32 if device.type == "mps" else torch.float64
        local = torch.stack([v.detach().reshape(()).to(device=device, dtype=wide) for v in self.values])
        table = accelerator.gather(local.unsqueeze(0)) if accelerator.num_processes > 1 else local.unsqueeze(0)
        rows: list[list[float]] = table.tolist()
        out: dict[str, float] = {}
        for key, how, i in self.keys:
            if how == "mean":
                out[key] = sum(r[i] for r in rows) / max(sum(r[i + 1] for r in rows), 1.0)
            elif how == "process_mean":
                found = [r[i] for r in rows if not math.isnan(r[i])]
                out[key] = sum(found) / len(found) if found else math.nan
            else:
                found = [r[i] for r in rows if math.isfinite(r[i])]
                out[key] = (min(found) if how == "min" else max(found)) if found else math.nan
        return out


def _clip_keys(out: _Reductions, rule: ClipRule, mask: Tensor, logps: Tensor, old: Tensor, adv: Tensor) -> None:
    """TRL's clip keys: its ``coef_1`` from the micro-batch's log-probs, compared with the gate's bounds."""
    log_ratio = logps.detach() - old
    if rule.sequence:  # TRL: the response's mean log-ratio, [B, 1]
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    advantage = adv.detach() if adv.dim() == 2 else adv.detach().unsqueeze(1)
    if rule.family == "cispo":
        out.masked_mean("cispo_clip_ratio", ((ratio > rule.high) & (advantage > 0)).float(), mask)
        return
    if rule.cap is not None:
        ratio = ratio.clamp(max=rule.cap)
    low_bound = -math.inf if rule.low is None else rule.low  # (no low side: nothing is low-clipped)
    low = ((ratio < low_bound) & (advantage < 0)).float()
    high = ((ratio > rule.high) & (advantage > 0)).float()
    out.masked_mean("clip_ratio/low_mean", low, mask)
    out.masked_mean("clip_ratio/high_mean", high, mask)
    out.masked_mean("clip_ratio/region_mean", torch.maximum(low, high), mask)

    def per_response(x: Tensor) -> Tensor:  # TRL's masked_seq_mean (NaN for a row without action tokens)
        return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

    out.extreme("clip_ratio/low_min", "min", per_response(low))
    out.extreme("clip_ratio/high_max", "max", per_response(high))


def trl_policy_loss(
    plan: DashboardPlan, loss_before_bonus: Tensor, metrics: Mapping[str, Tensor], scale: float, accumulation: int
) -> Tensor:
    """TRL's ``policy_loss``: the micro-batch's loss as returned to TRL before TRL's entropy bonus (the KL term
    included, the aux loss not), less the recipe's own entropy terms (``coef · value`` of each, scaled like the
    loss; none when no row had an action token), as TRL's loss type reports it: × the accumulation steps where TRL
    divides its loss by them."""
    value = loss_before_bonus.detach()
    for name in plan.recipe_entropy_metrics:
        term, coef = metrics.get(f"{name}/value"), metrics.get(f"{name}/coef")
        if term is not None and coef is not None:
            value = value - coef * term * scale
    return value * accumulation if plan.policy_loss_per_micro_batch else value


def trl_dashboard(
    accelerator: Accelerator,
    plan: DashboardPlan,
    *,
    mask: Tensor,
    logps: Tensor,
    old: Tensor,
    advantages: Tensor,
    entropies: Tensor | None,
    per_token_kl: Tensor | None,
    metrics: Mapping[str, Tensor],
    rows: ActionRows,
    loss_before_bonus: Tensor | None = None,
    scale: float = 1.0,
    accumulation: int = 1,
    recipe_keys: bool = True,
) -> dict[str, float]:
    """TRL's dashboard keys for one micro-batch (the table in :mod:`lossplug.adapters.trl.dashboard`), reduced over
    the processes as TRL reduces them. Every process must call it for the same micro-batch (it gathers).

    ``mask``: the micro-batch's action mask (``completion_mask × tool_mask``, every row); ``per_token_kl``: TRL's own
    KL term when the adapter adds it (else the recipe's KL is read from ``metrics``, lossplug's metric tensors of
    the micro-batch — empty when no row had an action token); ``rows``: the rows that entered the lossplug batch;
    ``loss_before_bonus``: the loss returned to TRL before its entropy bonus, when TRL's bonus is on (``None``: no
    ``policy_loss``), with the adapter's ``scale`` and TRL's ``accumulation`` steps (:func:`trl_policy_loss`).
    ``recipe_keys=False`` (``metrics="off"``) leaves out the clip keys and what is read from the recipe's stages'
    metrics: vespo's φ, the recipe's KL, a ``policy_loss`` with the recipe's entropy term (TRL's own KL term, the
    entropies and the adapter's own bonus stay).
    """
    out = _Reductions()
    with torch.no_grad():
        if per_token_kl is not None:
            out.masked_mean("kl", per_token_kl.detach(), mask)
        elif plan.recipe_kl_metric is not None and recipe_keys:
            # the regularizer's token mean over this micro-batch's action tokens, back to a sum (no row: 0 of 0)
            tokens = mask.sum().float()
            token_mean = metrics.get(plan.recipe_kl_metric)
            out.mean("kl", token_mean * tokens if token_mean is not None else tokens * 0, tokens)
        if entropies is not None:
            out.masked_mean("entropy", entropies.detach(), mask)
        if recipe_keys and plan.clip is not None:
            _clip_keys(out, plan.clip, mask, logps, old, advantages)
        if recipe_keys and plan.vespo and advantages.dim() == 1:
            # TRL's φ is one per response ([B] advantages) and 1 for a response without action tokens (its
            # log-weight is 0); the gate's phi_mean is over the responses with one
            responses = mask.new_full((), float(rows.count), dtype=torch.float32)
            phi_mean = metrics.get("vespo/phi_mean")
            phi_sum = phi_mean * rows.kept if phi_mean is not None else responses * 0
            out.mean("vespo/phi_seq_mean", phi_sum + (rows.count - rows.kept), responses)
        if loss_before_bonus is not None and (recipe_keys or not plan.recipe_entropy_metrics):
            out.process_mean("policy_loss", trl_policy_loss(plan, loss_before_bonus, metrics, scale, accumulation))
    return out.read(accelerator)
