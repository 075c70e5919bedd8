"""The metrics ``policy_loss`` reports: at ``basic`` the loss, the approximate KLs and the gates' declared metrics;
at ``full`` also the ratio distributions and the effective-sample fractions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ops import any_rows, masked_quantiles, quantiles_of, zero_off
from .plugin import GateInput, GateOutput, GatePlugin
from .stages import Stage, evaluate_declared

Tensor = torch.Tensor
QUANTILES = (0.0, 0.05, 0.5, 0.95, 1.0)
QUANTILE_NAMES = ("min", "p05", "p50", "p95", "max")


def ratio_metrics(prefix: str, log_ratio: Tensor, mask: Tensor, out: dict[str, Tensor]) -> None:
    if mask.device.type == "cpu":  # select the action tokens first: exp and quantiles on those only (no host sync)
        ratio = torch.masked_select(log_ratio, mask).clamp(-20, 20).exp()
        quantiles, mean = quantiles_of(ratio, QUANTILES), ratio.sum() / max(ratio.numel(), 1)
    else:
        ratio = log_ratio.clamp(-20, 20).exp()
        quantiles = masked_quantiles(ratio, mask, QUANTILES)
        mean = zero_off(ratio, mask).sum() / torch.count_nonzero(mask).clamp(min=1)
    for name, q in zip(QUANTILE_NAMES, quantiles):
        out[f"{prefix}/{name}"] = q
    out[f"{prefix}/mean"] = mean


@dataclass(frozen=True)
class GateReport:
    """A gate's declared metrics, evaluated at the call's level."""

    name: str
    metrics: dict[str, Tensor]
    active: Tensor | None


def gate_report(stage: Stage[GatePlugin], out: GateOutput, level: str, validate: str) -> GateReport:
    """Evaluate what ``out`` declares for ``level`` (``metrics``; at ``full`` also ``details`` and ``active``) under
    ``no_grad``; a failure blames the gate. Nothing is evaluated at ``off``."""
    if level == "off":
        return GateReport(stage.plugin.name, {}, None)
    declared = {**out.metrics, **out.details} if level == "full" else out.metrics
    with torch.no_grad():
        values = {
            key: evaluate_declared(stage, f"its metric {key!r}", value, validate) for key, value in declared.items()
        }
        active = (
            None
            if level != "full" or out.active is None
            else evaluate_declared(stage, "its active mask", out.active, validate)
        )
    return GateReport(stage.plugin.name, values, active)


def basic_metrics(inp: GateInput, reports: list[GateReport], loss: Tensor) -> dict[str, Tensor]:
    """The loss, ``update/approx_kl``, ``engine/approx_kl`` and every gate's declared metrics (at ``full`` also its
    ``details``).

    ``engine/approx_kl`` is the mismatch between the rollout engine and the trainer, present whenever the batch has
    behaviour log-probs: the mean over the actions of ``behavior_logp − old_logp``, the k1 estimate of
    KL(π_behaviour ‖ π_old) on tokens the engine sampled (verl's ``rollout_corr/kl``) — the engine-side twin of
    ``update/approx_kl``, the mean of ``old_logp − logp``.
    """
    m: dict[str, Tensor] = {"loss": loss.detach()}
    batch = inp.batch
    if batch.old_logp is not None:
        # mean over the actions of old_logp − logp; the log-ratio is zero off the actions: no mask pass
        m["update/approx_kl"] = -inp.update_log_ratio().detach().sum() / inp.action_tokens
        if batch.behavior_logp is not None:
            # engine_log_ratio() is old − behaviour, zero off the actions and shared with the correction gates
            m["engine/approx_kl"] = -inp.engine_log_ratio().detach().sum() / inp.action_tokens
    for report in reports:
        for key, value in report.metrics.items():
            m[f"{report.name}/{key}"] = value
    return m


def full_metrics(inp: GateInput, reports: list[GateReport], objective: Tensor, m: dict[str, Tensor]) -> None:
    """``metrics="full"``, added to the others: the ratio distributions and the effective-sample fractions from the
    gates' ``active`` masks."""
    mask = inp.mask
    n_tokens = torch.count_nonzero(mask).clamp(min=1)  # (a bool .sum() first copies the mask to int64)
    batch = inp.batch
    if batch.old_logp is not None:
        ratio_metrics("ratio/update", inp.update_log_ratio().detach(), mask, m)
        if batch.behavior_logp is not None:
            ratio_metrics("ratio/engine", inp.engine_log_ratio(), mask, m)
    token_active = mask
    seq_active = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
    for report in reports:
        active = report.active
        if active is None:
            continue
        if active.ndim == 2:
            m[f"{report.name}/active_token_frac"] = torch.count_nonzero(active & mask) / n_tokens
            token_active = token_active & active
        else:
            m[f"{report.name}/active_seq_frac"] = active.float().mean()
            seq_active = seq_active & active
    token_active = token_active & seq_active.unsqueeze(-1)
    m["effective/token_frac"] = torch.count_nonzero(token_active) / n_tokens
    m["effective/seq_frac"] = any_rows(token_active).float().mean()
    m["objective/mean"] = objective.sum() / n_tokens
