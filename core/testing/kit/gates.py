"""The gates' own checks: what a gate returns, and the on-policy gradient (``ratio_one``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch

from lossplug.contracts import PolicyBatch
from lossplug.plugin import GateInput, GateOutput

from ._common import (
    CheckFailed,
    Subject,
    Tensor,
    check,
    check_fields,
    declared_metrics,
    first_diff,
    gate_input,
    metrics_with_gradient,
    normalizer_for,
    run_loss,
    warn,
    where_rows,
)


def gate_output_problems(s: Subject, out: object, shape: tuple[int, int]) -> list[str]:
    """What is wrong with a gate's raw output for a batch of ``shape`` [B, T]: its type, the field its role sets
    (an update gate's float objective [B, T]; a correction's weight, [B, T] at token level or [B] at sequence level,
    finite and ≥ 0) and the types of ``metrics`` / ``details``. The kit reads a gate's output only after this."""
    if not isinstance(out, GateOutput):
        return [f"a gate must return lossplug.GateOutput, got {type(out).__name__}"]
    B, T = shape
    problems = []
    if s.plugin.role == "update":
        if not isinstance(out.objective, Tensor) or tuple(out.objective.shape) != (B, T):
            problems.append(f"an update gate must set objective [B, T] = [{B}, {T}], got {_describe(out.objective)}")
        elif not out.objective.is_floating_point():
            problems.append(f"objective must be a float tensor, got {out.objective.dtype}")
        if out.weight is not None:
            problems.append("an update gate sets objective, not weight (weights are for role='correction')")
    else:
        want = (B, T) if s.plugin.level == "token" else (B,)
        if not isinstance(out.weight, Tensor) or tuple(out.weight.shape) != want:
            problems.append(
                f"a {s.plugin.level}-level correction must set weight {list(want)}, got {_describe(out.weight)}"
            )
        elif not out.weight.is_floating_point():
            problems.append(f"weight must be a float tensor, got {out.weight.dtype}")
        if out.objective is not None:
            problems.append("a correction sets weight, not objective (it multiplies the update gate's objective)")
    for part in ("metrics", "details"):
        if not isinstance(getattr(out, part), Mapping):
            problems.append(
                f"GateOutput.{part} must be a mapping of metric name → 0-d tensor or a function "
                f"returning one, got {type(getattr(out, part)).__name__}"
            )
    return problems


def _describe(value: object) -> str:
    return f"{value.dtype} {list(value.shape)}" if isinstance(value, Tensor) else repr(value)[:80]


def call_gate(s: Subject, inp: GateInput, on: str) -> GateOutput:
    """The gate's output on ``inp`` (described by ``on``, e.g. "on an ordinary batch"), checked by
    :func:`gate_output_problems` before anything reads it: a wrong output fails the calling check, naming the rule."""
    out = s.plugin(inp, s.param_model())
    problems = gate_output_problems(s, out, (inp.logp.shape[0], inp.logp.shape[1]))
    if problems:
        raise CheckFailed(f"{on}: " + "; ".join(problems))
    return cast(GateOutput, out)


def checked_weight(out: GateOutput) -> Tensor:
    """A correction's weight, from an output :func:`call_gate` returned (so it is a tensor of the right shape)."""
    return cast(Tensor, out.weight)


def gate_output_contract(s: Subject) -> None:
    unknown = set(s.requires) - set(PolicyBatch.FIELD_NAMES)
    if unknown:
        raise CheckFailed(
            f"requires names fields PolicyBatch does not have: {sorted(unknown)} "
            f"(fields are {', '.join(PolicyBatch.FIELD_NAMES)})"
        )
    if s.plugin.role not in ("update", "correction") or s.plugin.level not in ("token", "sequence"):
        raise CheckFailed(
            f"role must be update|correction and level token|sequence, got {s.plugin.role!r}, {s.plugin.level!r}"
        )
    f = check_fields()
    inp, _ = gate_input(f)
    out = call_gate(s, inp, "on an ordinary batch")
    B, T = f["logp"].shape
    problems = _broken_zero_off_promise(s, out, f)
    if s.role == "correction":
        weight = checked_weight(out).detach()
        bad = ~torch.isfinite(weight) | (weight < 0)
        if weight.ndim == 2:
            bad = bad & f["action_mask"]
        if bool(bad.any()):
            problems.append(f"the weight must be finite and ≥ 0 on action tokens; it is not at {where_rows(bad)}")
    values, active = declared_metrics(out)
    if active is None:
        warn(
            "the gate declares no `active`: the pipeline then counts every action token as still carrying "
            "gradient after it, so effective/token_frac and effective/seq_frac (the effective sample rate the demo "
            "plots) overstate what trains wherever the gate cuts. Declare GateOutput(active=...): a bool [B, T] "
            "(or [B] at sequence level), or a function returning one, True where a token still carries gradient "
            "after this gate — `lambda: inp.mask` if it never cuts"
        )
    elif not isinstance(active, Tensor) or active.dtype != torch.bool or tuple(active.shape) not in ((B, T), (B,)):
        what = f"{active.dtype} {list(active.shape)}" if isinstance(active, Tensor) else type(active).__name__
        problems.append(f"active must be a bool [B, T] or [B] tensor (or a function returning one), got {what}")
    for key, value in values.items():
        if not isinstance(key, str) or not isinstance(value, Tensor) or value.ndim != 0:
            problems.append(
                f"metric {key!r} must be a 0-d tensor, got "
                f"{type(value).__name__}{list(value.shape) if isinstance(value, Tensor) else ''}"
            )
    if problems:
        raise CheckFailed("; ".join(problems))


def _broken_zero_off_promise(s: Subject, out: GateOutput, fields: dict[str, Tensor]) -> list[str]:
    """What breaks an update gate's ``zero_off_actions=True``: an objective that is not exactly 0 off the actions, or
    gradient that reaches ``logp`` there, with sequence- then token-level advantages (a ``[B, 1]`` advantage column
    is not zero off the actions, the cleaned ``[B, T]`` advantage is). The pipeline trusts the promise and skips
    its own zero-off, so a false one lets the padding into the loss — a problem only this check can name."""
    if s.plugin.role != "update" or not out.zero_off_actions:
        return []
    for token_advantage in (False, True):
        f = check_fields(token_advantage=token_advantage) if token_advantage else fields
        inp, leaves = gate_input(f)
        objective = cast(Tensor, call_gate(s, inp, "on an ordinary batch").objective)
        off = ~f["action_mask"]
        (grad,) = torch.autograd.grad(objective.sum(), leaves["logp"], allow_unused=True)
        grad = torch.zeros_like(leaves["logp"]) if grad is None else grad
        value = objective.detach()
        where = off & ((value != 0) | (grad != 0))
        if bool(where.any()):
            first = tuple(where.nonzero()[0].tolist())
            layout = "token-level" if token_advantage else "sequence-level"
            return [
                f"GateOutput(zero_off_actions=True) promises an objective that is exactly +0 off the action positions, "
                f"without gradient there, but with {layout} advantages it is not at {where_rows(where)} (first at "
                f"{first}: objective {float(value[first]):.6g}, ∂/∂logp {float(grad[first]):.6g}); the pipeline "
                "trusts the promise and skips its own zero-off, "
                "so the padding enters the loss. Make every term a product with a factor that is +0 off the actions "
                "(inp.advantage, the cleaned [B, T] advantage, or inp.on_actions(x); inp.broadcast_advantage() is a "
                "[B, 1] column for a [B] advantage, not zero there), or drop zero_off_actions (the pipeline then "
                "zeroes the objective itself)"
            ]
    return []


def gate_detached(s: Subject) -> None:
    """Gradient only through logp: a correction's weight, ``active`` and tensor metrics carry none, and none
    reaches old_logp, behavior_logp, ref_logp or the advantage.

    An undetached correction weight blocks the checks that need this one (the pipeline refuses it, so none of them
    could run), and so does gradient reaching another input (it reads the raw batch, masked positions included);
    metrics or ``active`` that carry gradient leave the loss and its gradient computable, so they do not.
    The loss step runs at metrics="off": whether the metric level changes it is metric_levels' question."""
    f = check_fields()
    everything = ("logp", "old_logp", "behavior_logp", "ref_logp", "advantage")
    inp, _ = gate_input(f, grad=everything)
    out = call_gate(s, inp, "with every input requiring gradient")
    if s.role == "correction" and checked_weight(out).requires_grad:
        raise CheckFailed(
            "the correction's weight carries gradient (requires_grad=True): compute it under "
            "torch.no_grad() or .detach() it — a correction is a detached coefficient, gradient must "
            "flow only through the update gate's logp"
        )
    if isinstance(out.active, Tensor) and out.active.requires_grad:
        raise CheckFailed("`active` carries gradient; it must be a bool mask", blocking=False)
    live = metrics_with_gradient(out)
    if live:
        raise CheckFailed(
            f"metric(s) {', '.join(live)} carry gradient: declare them as functions (evaluated under "
            "torch.no_grad() only when a metric level asks for them) or detach them (a logged metric "
            "with a graph keeps the whole graph alive)",
            blocking=False,
        )
    run = run_loss(s, f, normalizer=normalizer_for(f), grad=everything, metrics="off")
    leaks = {
        k: float(g.abs().sum()) for k, g in run.grads.items() if k != "logp" and g is not None and bool((g != 0).any())
    }
    if leaks:  # GateInput's fields but logp are detached and zero off the actions: this read the raw batch
        names = ", ".join(f"{k} (Σ|grad| = {v:.3g})" for k, v in leaks.items())
        raise CheckFailed(
            f"gradient reached {names}: only logp may carry gradient. GateInput's fields (inp.old_logp, "
            "inp.advantage, …) are detached and zero off the actions, so this comes from reading the raw batch "
            "(inp.batch.*): read GateInput's fields instead — the raw batch also holds whatever sits at masked "
            "positions (NaN, inf)"
        )


@check(
    "ratio_one",
    ("gate",),
    "identical log-probs give ratio 1: an update gate reduces to the policy gradient A, a correction to weight 1",
    # its diagnosis (the factor ∂J/∂logp ÷ A per response) presumes statistics over action tokens, within each row
    needs=("microbatch_split",),
)
def ratio_one(s: Subject) -> None:
    f = check_fields()
    f["old_logp"] = f["logp"].clone()
    f["behavior_logp"] = f["logp"].clone()
    mask = f["action_mask"]
    if s.role == "correction":
        inp, _ = gate_input(f)
        weight = checked_weight(call_gate(s, inp, "with old_logp = behavior_logp = logp"))
        where = mask if weight.ndim == 2 else torch.ones_like(weight, dtype=torch.bool)
        diff = first_diff(weight, torch.ones_like(weight), where, rtol=1e-6, atol=1e-9)
        if diff:
            raise CheckFailed(
                f"with old_logp = behavior_logp every engine ratio is 1, so the correction's weight "
                f"must be 1; it is not {diff}"
            )
        return
    run = run_loss(s, f, normalizer=normalizer_for(f))
    n = int(mask.sum())
    coefficient = -n * run.logp_grad  # loss = −Σ J / N under the token reduction
    expected = torch.where(mask, f["advantage"].unsqueeze(-1).expand_as(mask), 0)
    diff = first_diff(coefficient, expected, mask, rtol=1e-6, atol=1e-9)
    if diff:
        raise CheckFailed(
            "with logp = old_logp = behavior_logp (every ratio 1) an update gate must give the plain "
            f"policy gradient ∂J/∂logp = A on every action token; it does not {diff}. "
            + _scaling_cause(coefficient, expected, mask)
        )


def _scaling_cause(coefficient: Tensor, expected: Tensor, mask: Tensor) -> str:
    """The likely cause of an on-policy gradient that is not A: a flipped sign, or a denominator inside the gate
    (found from how ``coefficient / A`` varies: constant over the micro-batch, per response, or per token)."""
    used = mask & (expected != 0)
    factor = torch.where(used, coefficient / expected, float("nan")).double()
    if bool(torch.nanmean(factor) < 0):
        return "The sign is flipped: gates return objectives (to maximise), the pipeline negates them."
    lengths = mask.sum(-1).double()
    rows = used.any(-1)
    low = torch.where(used, factor, float("inf")).amin(-1)[rows]
    high = torch.where(used, factor, float("-inf")).amax(-1)[rows]
    reductions = (
        "Reductions own every denominator: a gate returns the per-token objective and the recipe's "
        "reduction (token, response, sequence_sum…) divides by the global population of the step — a "
        "denominator inside the gate is applied twice and is wrong under micro-batching."
    )
    if not bool(torch.allclose(low, high, rtol=1e-6, atol=1e-12)):
        return (
            "The factor ∂J/∂logp ÷ A varies within a response: the objective is not A·r at r = 1 (check the "
            "formula's value and derivative at ratio 1)."
        )
    per_row = low
    if bool(torch.allclose(per_row, 1 / lengths[rows], rtol=1e-6)):
        return (
            "The gradient is A divided by each response's own action-token count: the gate divides by "
            "|y_i|. " + reductions + " For a per-response mean use reduction: {name: response}."
        )
    if bool(torch.allclose(per_row, per_row[:1].expand_as(per_row), rtol=1e-6)):
        c = float(per_row[0])
        n = int(mask.sum())
        what = (
            f" = 1/{n}, the micro-batch's action-token count"
            if abs(c * n - 1) < 1e-6
            else f" = 1/{int(mask.shape[0])}, the micro-batch's response count"
            if abs(c * mask.shape[0] - 1) < 1e-6
            else ""
        )
        return (
            f"The gradient is A scaled by the constant {c:.6g}{what}: most likely a denominator or a "
            f"coefficient inside the gate. " + reductions
        )
    return (
        "The gradient is A scaled by a different factor in each response: most likely a denominator inside "
        "the gate. " + reductions
    )
