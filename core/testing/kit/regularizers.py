"""The conformance checks of regularizers (listed in :data:`lossplug.testing.kit.CHECKS`).

A regularizer is exercised through the real :func:`lossplug.policy_loss` with the reference update gate
(``reinforce``) and the regularizer as the recipe's only regularizer stage; the checks that inspect its raw output
call it directly on the pipeline's own :class:`~lossplug.GateInput`. The kind's generic checks (docstring,
parameters, masked poison and layout, metric levels, extreme log-ratios, micro-batch splits, requires) live in
:mod:`lossplug.testing.kit.every_kind` and :mod:`lossplug.testing.kit.loss_checks`; the ones below are the kind's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch

from lossplug.contracts import PolicyBatch
from lossplug.plugin import RegularizerOutput, RegularizerParams

from ._common import (
    CheckFailed,
    CheckSkipped,
    Subject,
    Tensor,
    check,
    check_fields,
    first_diff,
    gate_input,
    metrics_with_gradient,
    normalizer_for,
    run_loss,
)

#: the fields a regularizer may differentiate: the log-probs and the entropy (computed from the same logits)
DIFFERENTIABLE = ("logp", "entropy")


def regularizer_output_problems(out: object, shape: tuple[int, int]) -> list[str]:
    """What is wrong with a regularizer's raw output for a batch of ``shape`` [B, T]: its type, the term (a float
    tensor like logp), the types of ``metrics`` / ``details`` and of the observation. The kit reads a regularizer's
    output only after this."""
    if not isinstance(out, RegularizerOutput):
        return [f"a regularizer must return lossplug.RegularizerOutput or a tensor, got {type(out).__name__}"]
    B, T = shape
    problems = []
    if not isinstance(out.term, Tensor) or tuple(out.term.shape) != (B, T) or not out.term.is_floating_point():
        what = f"{out.term.dtype} {list(out.term.shape)}" if isinstance(out.term, Tensor) else type(out.term).__name__
        problems.append(f"term must be a float tensor [B, T] = [{B}, {T}] like logp, got {what}")
    for part in ("metrics", "details"):
        value = getattr(out, part)
        if not isinstance(value, Mapping):
            problems.append(f"RegularizerOutput.{part} must be a mapping, got {type(value).__name__}")
    if out.observation is not None and not isinstance(out.observation, Tensor):
        problems.append(f"observation must be a tensor or None, got {type(out.observation).__name__}")
    return problems


def _output(
    s: Subject, fields: Mapping[str, Tensor], grad: tuple[str, ...] = DIFFERENTIABLE, on: str = "on an ordinary batch"
) -> RegularizerOutput:
    """The regularizer's output on ``fields``, checked by :func:`regularizer_output_problems` before it is read."""
    inp, _ = gate_input(fields, grad=grad)
    out = s.plugin(inp, s.param_model())
    problems = regularizer_output_problems(out, (inp.logp.shape[0], inp.logp.shape[1]))
    if problems:
        raise CheckFailed(f"{on}: " + "; ".join(problems))
    return cast(RegularizerOutput, out)


def regularizer_output_contract(s: Subject) -> None:
    """A RegularizerOutput whose term is a float ``[B, T]`` tensor, declared metrics 0-d tensors, the observation a
    tensor or None; parameters subclassing RegularizerParams."""
    if not issubclass(s.plugin.params, RegularizerParams):
        raise CheckFailed(
            f"params {s.plugin.params.__name__} must subclass lossplug.RegularizerParams (coef, reduction, population)"
        )
    unknown = set(s.requires) - set(PolicyBatch.FIELD_NAMES)
    if unknown:
        raise CheckFailed(f"requires names fields PolicyBatch does not have: {sorted(unknown)}")
    f = check_fields()
    out = _output(s, f)
    problems = []
    if not bool(torch.isfinite(out.term[f["action_mask"]]).all()):
        problems.append("term is not finite on action tokens for ordinary inputs")
    for part in ("metrics", "details"):
        with torch.no_grad():
            for key, metric in getattr(out, part).items():
                v = metric() if callable(metric) else metric
                if not isinstance(key, str) or not isinstance(v, Tensor) or v.ndim != 0:
                    problems.append(f"metric {key!r} must be a 0-d tensor (or a function returning one)")
    if problems:
        raise CheckFailed("; ".join(problems))


def regularizer_detached(s: Subject) -> None:
    """Gradient only through logp and entropy: none reaches old_logp, behavior_logp, ref_logp or the advantage; the
    declared metrics and the observation carry none. Gradient reaching another input blocks the checks that need this
    one (it reads the raw batch, masked positions included); metrics or an observation that carry gradient leave the
    loss and its gradient computable, so they do not. The loss step runs at metrics="off"."""
    f = check_fields()
    everything = ("logp", "entropy", "old_logp", "behavior_logp", "ref_logp", "advantage")
    out = _output(s, f, grad=everything, on="with every input requiring gradient")
    live = metrics_with_gradient(out)
    if live:
        raise CheckFailed(
            f"metric(s) {', '.join(live)} carry gradient: declare them as functions (evaluated under no_grad) or "
            "detach them",
            blocking=False,
        )
    if isinstance(out.observation, Tensor) and out.observation.requires_grad:
        raise CheckFailed(
            "the observation (fed to the controller across steps) carries gradient: .detach() it", blocking=False
        )
    run = run_loss(s, f, normalizer=normalizer_for(f), grad=everything, metrics="off")
    leaks = {
        k: float(g.abs().sum())
        for k, g in run.grads.items()
        if k not in DIFFERENTIABLE and g is not None and bool((g != 0).any())
    }
    if leaks:
        names = ", ".join(f"{k} (Σ|grad| = {v:.3g})" for k, v in leaks.items())
        raise CheckFailed(
            f"gradient reached {names}: a regularizer differentiates logp (and entropy) only. GateInput's other "
            "fields (inp.ref_logp, inp.old_logp, …) are detached and zero off the actions, so this comes from "
            "reading the raw batch (inp.batch.*): read GateInput's fields instead"
        )


@check(
    "coefficient_linear",
    ("regularizer",),
    "the loss is the policy loss plus coef · reduce(term): linear in coef, and reg/<name>/value is reduce(term)",
    needs=("metric_levels",),
)
def coefficient_linear(s: Subject) -> None:
    if s.plugin.make_controller(s.param_model()) is not None:
        raise CheckSkipped("the coefficient is its controller's (adaptive), not the recipe's coef")
    f = check_fields()
    norm = normalizer_for(f)
    runs = {}
    for coef in (0.0, 1.0, 2.5):
        subject = Subject(s.kind, s.name, s.plugin, {**s.params, "coef": coef}, s.source)
        runs[coef] = run_loss(subject, f, normalizer=norm, grad=DIFFERENTIABLE)
    base, one, other = runs[0.0], runs[1.0], runs[2.5]
    term = one.loss - base.loss
    diff = first_diff(other.loss, base.loss + 2.5 * term, rtol=1e-7, atol=1e-10)
    if diff:
        raise CheckFailed(f"the loss is not linear in coef: with coef=2.5 {diff}")
    for name in DIFFERENTIABLE:
        g0, g1, g2 = (r.grads.get(name) for r in (base, one, other))
        if g0 is None or g1 is None or g2 is None:
            continue
        diff = first_diff(g2, g0 + 2.5 * (g1 - g0), rtol=1e-7, atol=1e-10)
        if diff:
            raise CheckFailed(f"the gradient through {name} is not linear in coef {diff}")
    key = next((k for k in one.metrics if k.startswith(f"reg/{s.name}") and k.endswith("/value")), None)
    if key is None:
        raise CheckFailed(f"no reg/{s.name}/value metric was reported")
    diff = first_diff(one.metrics[key], term, rtol=1e-7, atol=1e-10)
    if diff:
        raise CheckFailed(f"{key} is not the reduced term (loss(coef=1) − loss(coef=0)): {diff}")
