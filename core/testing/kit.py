"""The conformance checks and the machinery that runs them.

Each check is a function of a :class:`Subject` (a resolved plugin plus the parameters to test it with) that returns
normally when the invariant holds, raises :class:`CheckFailed` with a message that names the invariant and what was
observed, or :class:`CheckSkipped` when it does not apply. Gates and reductions are exercised through the real
:func:`lossplug.policy_loss` (the path a trainer takes), advantages through :func:`lossplug.estimate_advantages`;
checks that inspect a gate's raw output call it directly on the pipeline's own :class:`~lossplug.GateInput`.
"""

from __future__ import annotations

import contextlib
import json
import traceback
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

import lossplug
from lossplug.contracts import (
    BatchValidationError,
    LossplugError,
    Normalizer,
    PackedTransitions,
    PolicyBatch,
    Recipe,
    RecipeError,
)
from lossplug.needs import required_fields
from lossplug.plugin import (
    AnyPlugin,
    GateInput,
    GateOutput,
    Params,
    Population,
    evaluate,
)

from . import batches as _b

if TYPE_CHECKING:
    from lossplug.pipeline import MetricLevel

Tensor = torch.Tensor
KINDS = ("advantage", "gate", "reduction", "regulariser")
RTOL, ATOL = 1e-9, 1e-12  # float64 comparisons

# ---------------------------------------------------------------------------------------------------------------------
# Results


class CheckFailed(AssertionError):
    """Raised inside a check when the invariant does not hold."""


class CheckSkipped(Exception):
    """Raised inside a check when it does not apply to this plugin."""


class ConformanceError(AssertionError):
    """A plugin failed one or more conformance checks; the message lists each with what was observed."""

    def __init__(self, report: ConformanceReport):
        self.report = report
        super().__init__(str(report))


@dataclass(frozen=True)
class CheckResult:
    check: str
    status: str  # "passed" | "failed" | "skipped"
    message: str = ""
    summary: str = ""

    @property
    def ok(self) -> bool:
        return self.status != "failed"


@dataclass
class ConformanceReport:
    """The outcome of every check run against one plugin."""

    kind: str
    name: str
    source: str
    params: dict[str, Any]
    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "failed"]

    @property
    def title(self) -> str:
        params = f" with {self.params}" if self.params else ""
        return f"{self.kind} '{self.name}'{params} ({self.source})"

    def __str__(self) -> str:
        n_fail = len(self.failures)
        head = (
            f"{self.title} passes all {len(self.results)} conformance checks"
            if not n_fail
            else f"{self.title} failed {n_fail} of {len(self.results)} conformance checks:"
        )
        lines = [head]
        for r in self.results:
            if r.status == "failed":
                body = r.message.replace("\n", "\n      ")
                lines.append(f"  ✗ {r.check} — {r.summary}\n      {body}")
        return "\n".join(lines)

    def raise_for_failures(self) -> ConformanceReport:
        if not self.ok:
            raise ConformanceError(self)
        return self


# ---------------------------------------------------------------------------------------------------------------------
# The subject under test


def reference_update_gate() -> str:
    """The update gate that corrections and reductions are composed with: ``reinforce`` (J = A·logp)."""
    reg = lossplug.registry()
    return "reinforce" if "reinforce" in reg.plugins["gate"] else "ppo_clip"


@dataclass
class Subject:
    kind: str
    name: str
    #: an AnyPlugin of ``kind``; Any, because each check reads the attributes of the kind(s) it applies to
    plugin: Any
    params: dict[str, Any]
    source: str

    @property
    def spec(self) -> dict[str, Any]:
        return {"name": self.name, **self.params}

    @property
    def role(self) -> str | None:
        return getattr(self.plugin, "role", None)

    def recipe(self, reduction: str | Mapping[str, Any] = "token") -> Recipe:
        ref = reference_update_gate()
        if self.kind == "gate":
            gates = [self.spec] if self.role == "update" else [ref, self.spec]
            return Recipe.model_validate({"gates": gates, "reduction": reduction})
        if self.kind == "reduction":
            return Recipe.model_validate({"gates": [ref], "reduction": self.spec})
        if self.kind == "regulariser":
            return Recipe.model_validate({"gates": [ref], "reduction": reduction, "regularisers": [self.spec]})
        return Recipe.model_validate({"advantage": self.spec, "gates": [ref], "reduction": "token"})

    def param_model(self) -> Params:
        params: Params = self.plugin.params.model_validate(self.params)
        return params

    @property
    def requires(self) -> tuple[str, ...]:
        """The batch fields the plugin reads with the parameters under test."""
        return required_fields(self.plugin, self.param_model())


# ---------------------------------------------------------------------------------------------------------------------
# The check registry


@dataclass(frozen=True)
class Check:
    name: str
    kinds: tuple[str, ...]
    summary: str
    fn: Callable[[Subject], None]


CHECKS: dict[str, Check] = {}


def _check(
    name: str, kinds: tuple[str, ...], summary: str
) -> Callable[[Callable[[Subject], None]], Callable[[Subject], None]]:
    def deco(fn: Callable[[Subject], None]) -> Callable[[Subject], None]:
        CHECKS[name] = Check(name, kinds, summary, fn)
        return fn

    return deco


# ---------------------------------------------------------------------------------------------------------------------
# Helpers


def _fields(**kw: Any) -> dict[str, Tensor]:
    """Every PolicyBatch field (:func:`lossplug.testing.batches.policy_fields`) plus a per-token ``entropy`` (> 0), a
    ``reward_baseline`` ``[B]``, two ``reward_components`` ``[B, 2]`` (their sum is ``reward``) and a per-token
    ``sum_pi_squared`` consistent with ``old_logp``."""
    fields = _b.policy_fields(**kw)
    g = torch.Generator().manual_seed(int(kw.get("seed", 0)) + 11)
    logp = fields["logp"]
    fields["entropy"] = (0.05 + 2.0 * torch.rand(logp.shape, generator=g, dtype=torch.float64)).to(logp.dtype)
    reward = fields["reward"]
    first = torch.randn(reward.shape, generator=g, dtype=torch.float64).to(reward.dtype)
    fields["reward_components"] = torch.stack([first, reward - first], dim=-1)
    fields["reward_baseline"] = torch.randn(reward.shape, generator=g, dtype=torch.float64).to(reward.dtype)
    # Σ_v π(v)² of a distribution whose sampled token has probability p = exp(old_logp): between p² and p² + (1 − p)²
    p = torch.exp(fields["old_logp"].to(torch.float64))
    spread = torch.rand(logp.shape, generator=g, dtype=torch.float64)
    fields["sum_pi_squared"] = (p**2 + spread * (1 - p) ** 2).to(logp.dtype)
    # a teacher near the behaviour policy; tokens from the last three policy versions (asynchronous rollouts); two
    # anchor states per prompt group
    teacher = fields["old_logp"] + 0.3 * torch.randn(logp.shape, generator=g, dtype=torch.float64).to(logp.dtype)
    fields["teacher_logp"] = teacher.clamp(max=-1e-3)
    B, T = logp.shape
    fields["policy_version"] = torch.full((B,), 3, dtype=torch.int64)
    fields["behavior_version"] = torch.randint(1, 4, (B, T), generator=g, dtype=torch.int64)
    fields["anchor_id"] = torch.arange(B, dtype=torch.int64) % 2
    return fields


#: the per-token fields a check poisons off the actions
TOKEN_FIELDS = _b.TOKEN_FIELDS + ("entropy", "sum_pi_squared", "teacher_logp")


BUDGET = 16.0  # the fixed token budget per response the checks' Normalizers carry


def _normalizer(fields: Mapping[str, Tensor]) -> Normalizer:
    return Normalizer.for_masks([fields["action_mask"]], budget=BUDGET, group_ids=[fields["group_id"]])


@dataclass
class Run:
    loss: Tensor
    grads: dict[str, Tensor | None]
    metrics: dict[str, Tensor]

    @property
    def logp_grad(self) -> Tensor:
        """d loss / d logp: always set (zeros when the loss does not depend on logp)."""
        return cast(Tensor, self.grads["logp"])


def _run(
    subject: Subject,
    fields: Mapping[str, Tensor | None],
    *,
    reduction: str | Mapping[str, Any] = "token",
    normalizer: Normalizer | None = None,
    grad: Iterable[str] = ("logp",),
    metrics: MetricLevel = "full",
) -> Run:
    """``policy_loss`` of the subject's recipe on ``fields``; backward; the gradients of the ``grad`` fields."""
    leaves = {k: (v.detach().clone() if isinstance(v, Tensor) else v) for k, v in fields.items() if v is not None}
    for name in grad:
        if name in leaves:
            leaves[name].requires_grad_(True)
    batch = PolicyBatch(**leaves)
    result = lossplug.policy_loss(batch, subject.recipe(reduction), normalizer, metrics=metrics)
    loss = result.loss
    if loss.requires_grad:
        loss.backward()
    grads = {k: leaves[k].grad for k in grad if k in leaves}
    if grads.get("logp") is None:  # an objective that does not depend on logp at all
        grads["logp"] = torch.zeros_like(leaves["logp"])
    return Run(loss.detach(), grads, dict(result.metric_tensors))


def _gate_input(
    fields: Mapping[str, Tensor | None], grad: Iterable[str] = ("logp",)
) -> tuple[GateInput, dict[str, Tensor]]:
    """The pipeline's own gate input for ``fields`` (``grad``: the fields made leaves that require gradient)."""
    leaves = {k: (v.detach().clone() if isinstance(v, Tensor) else v) for k, v in fields.items() if v is not None}
    for name in grad:
        if name in leaves and leaves[name].is_floating_point():
            leaves[name].requires_grad_(True)
    return GateInput.from_batch(PolicyBatch(**leaves)), leaves


def _declared(out: GateOutput) -> tuple[dict[str, Any], Any]:
    """Every metric a gate declared (``metrics`` and ``details``) and its ``active``, evaluated as the pipeline does
    at ``metrics="full"`` (under ``torch.no_grad()``)."""
    with torch.no_grad():
        values = {key: evaluate(v) for part in (out.metrics, out.details) for key, v in part.items()}
        return values, None if out.active is None else evaluate(out.active)


def _where(bad: Tensor) -> str:
    from lossplug.contracts.errors import describe_positions

    return describe_positions(bad, noun="rows")


def _first_diff(a: Tensor, b: Tensor, mask: Tensor | None = None, rtol: float = RTOL, atol: float = ATOL) -> str | None:
    """'' when allclose on ``mask``; else a description of the first differing places."""
    a, b = a.detach().double(), b.detach().double()
    close = torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=False)
    bad = ~close if mask is None else (~close & mask)
    if not bool(bad.any()):
        return None
    if a.ndim == 0:
        return f"expected {b.item():.10g}, got {a.item():.10g}"
    idx = bad.nonzero()[0].tolist()
    return (
        f"at {_where(bad)}: first at {tuple(idx)} expected {b[tuple(idx)].item():.6g}, got {a[tuple(idx)].item():.6g}"
    )


def _fmt_exc(err: BaseException) -> str:
    """The error and where it was raised — in the plugin, when the pipeline wrapped the plugin's exception."""
    origin = err.__cause__ if err.__cause__ is not None else err
    tb = traceback.extract_tb(origin.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno}, in {tb[-1].name})" if tb else ""
    return f"{type(err).__name__}: {err}{where}"


def _advantage_of(subject: Subject, batch: PolicyBatch | PackedTransitions) -> Tensor:
    return lossplug.estimate_advantages(batch, subject.recipe()).advantage


def _padded_only(subject: Subject) -> None:
    if subject.kind == "advantage" and "padded" not in subject.plugin.layouts:
        raise CheckSkipped("applies to padded-layout advantages only")


def _adv_fields(subject: Subject, token_reward: bool = False, **kw: Any) -> dict[str, Tensor]:
    f = _fields(group_size=max(3, subject.plugin.min_group_size), **kw)
    f.pop("advantage")
    if token_reward:
        g = torch.Generator().manual_seed(11)
        f["reward"] = torch.where(f["action_mask"], torch.randn(f["logp"].shape, generator=g, dtype=torch.float64), 0)
    return f


# ---------------------------------------------------------------------------------------------------------------------
# Checks for every kind


@_check("docstring", KINDS, "the plugin has a docstring (the formula `lossplug show` prints)")
def _docstring(s: Subject) -> None:
    doc = (s.plugin.doc or "").strip()
    if not doc:
        raise CheckFailed(
            f"'{s.name}' has no docstring. Write one: its first line is the summary `lossplug list` "
            "shows, and the formula belongs there (or in the module docstring `lossplug show` prints)."
        )


@_check("params_schema", KINDS, "parameters are a lossplug.Params model with a JSON schema, defaults and descriptions")
def _params_schema(s: Subject) -> None:
    model = s.plugin.params
    if not (isinstance(model, type) and issubclass(model, Params)):
        raise CheckFailed(
            f"params is {model!r}: it must be a subclass of lossplug.Params (a pydantic model that "
            "rejects unknown parameter names and is immutable)"
        )
    if model.model_config.get("extra") != "forbid":
        raise CheckFailed(
            f"{model.__name__} accepts unknown parameters (model_config extra="
            f"{model.model_config.get('extra')!r}); keep lossplug.Params' extra='forbid' so a typo "
            "in a recipe is an error"
        )
    problems = []
    try:
        json.dumps(model.model_json_schema())
    except Exception as err:
        problems.append(f"its JSON schema cannot be generated: {_fmt_exc(err)}")
    required = [n for n, f in model.model_fields.items() if f.is_required()]
    if required:
        problems.append(
            f"parameter(s) {', '.join(required)} have no default: a recipe that names the plugin "
            f"without parameters ({{name: {s.name}}}) fails"
        )
    undocumented = [n for n, f in model.model_fields.items() if not (f.description or "").strip()]
    if undocumented:
        problems.append(
            f"parameter(s) {', '.join(undocumented)} have no description "
            "(Field(..., description=...)); `lossplug show` prints it"
        )
    if not required:
        try:
            model()
        except Exception as err:
            problems.append(f"the defaults do not validate: {_fmt_exc(err)}")
    try:
        value = model.model_validate(s.params)
        if model.model_validate(value.model_dump()) != value:
            problems.append("parameters do not survive a dump/validate round trip (recipes are stored as data)")
    except Exception as err:
        problems.append(f"the parameters under test {s.params} do not validate: {_fmt_exc(err)}")
    if problems:
        raise CheckFailed("; ".join(problems))


@_check("output_contract", KINDS, "the plugin returns what its kind promises (shapes, dtypes, 0-d metrics)")
def _output_contract(s: Subject) -> None:
    if s.kind == "gate":
        return _gate_output_contract(s)
    if s.kind == "regulariser":
        from .kit_regularisers import regulariser_output_contract

        return regulariser_output_contract(s)
    if s.kind == "reduction":
        f = _fields()
        mask = f["action_mask"]
        objective = torch.where(mask, torch.randn(mask.shape, dtype=torch.float64), 0)
        pop = Population(int(mask.sum()), mask.shape[0], 2, BUDGET)
        out = s.plugin(objective, mask, mask.sum(-1), pop, s.param_model())
        if not isinstance(out, Tensor) or out.ndim != 0 or not out.is_floating_point():
            raise CheckFailed(
                f"a reduction must return a 0-d float tensor, got "
                f"{type(out).__name__}{'' if not isinstance(out, Tensor) else list(out.shape)}"
            )
        return None
    # advantage
    layouts = tuple(s.plugin.layouts)
    if not layouts or set(layouts) - {"padded", "packed"}:
        raise CheckFailed(f"layouts must be a non-empty subset of ('padded', 'packed'), got {layouts}")
    contract_fields = set()
    if "padded" in layouts:
        contract_fields |= set(PolicyBatch.model_fields)
    if "packed" in layouts:
        contract_fields |= set(PackedTransitions.model_fields)
    unknown = set(s.requires) - contract_fields
    if unknown:
        raise CheckFailed(f"requires names fields no batch contract has: {sorted(unknown)}")
    if "padded" in layouts:
        f = _adv_fields(s)
        for name in ("reward", "value"):
            f[name] = f[name].clone().requires_grad_(True)
        result = lossplug.estimate_advantages(PolicyBatch(**f), s.recipe())
    else:
        result = lossplug.estimate_advantages(PackedTransitions(**_b.packed_fields()), s.recipe())
    if result.advantage.requires_grad:
        raise CheckFailed("the advantages carry gradient: advantages are constants of the policy loss")


def _gate_output_contract(s: Subject) -> None:
    unknown = set(s.requires) - set(PolicyBatch.model_fields)
    if unknown:
        raise CheckFailed(
            f"requires names fields PolicyBatch does not have: {sorted(unknown)} "
            f"(fields are {', '.join(PolicyBatch.model_fields)})"
        )
    if s.plugin.role not in ("update", "correction") or s.plugin.level not in ("token", "sequence"):
        raise CheckFailed(
            f"role must be update|correction and level token|sequence, got {s.plugin.role!r}, {s.plugin.level!r}"
        )
    f = _fields()
    inp, _ = _gate_input(f)
    out = s.plugin(inp, s.param_model())
    B, T = f["logp"].shape
    if not isinstance(out, GateOutput):
        raise CheckFailed(f"a gate must return lossplug.GateOutput, got {type(out).__name__}")
    problems = []
    if s.plugin.role == "update":
        if not isinstance(out.objective, Tensor) or tuple(out.objective.shape) != (B, T):
            problems.append(
                f"an update gate must set objective [B, T] = [{B}, {T}], got "
                f"{None if out.objective is None else list(out.objective.shape)}"
            )
        elif not out.objective.is_floating_point():
            problems.append(f"objective must be a float tensor, got {out.objective.dtype}")
        if out.weight is not None:
            problems.append("an update gate sets objective, not weight (weights are for role='correction')")
    else:
        want = (B, T) if s.plugin.level == "token" else (B,)
        if not isinstance(out.weight, Tensor) or tuple(out.weight.shape) != want:
            problems.append(
                f"a {s.plugin.level}-level correction must set weight {list(want)}, got "
                f"{None if out.weight is None else list(out.weight.shape)}"
            )
        if out.objective is not None:
            problems.append("a correction sets weight, not objective (it multiplies the update gate's objective)")
    for part in ("metrics", "details"):
        if not isinstance(getattr(out, part), Mapping):
            problems.append(
                f"GateOutput.{part} must be a mapping of metric name → 0-d tensor or a function "
                f"returning one, got {type(getattr(out, part)).__name__}"
            )
    if problems:
        raise CheckFailed("; ".join(problems))
    values, active = _declared(out)
    if active is not None:
        if not isinstance(active, Tensor) or active.dtype != torch.bool or tuple(active.shape) not in ((B, T), (B,)):
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


@_check(
    "requires_declared",
    ("gate", "advantage", "regulariser"),
    "the plugin runs on a batch holding only the fields it declares in requires=",
)
def _requires_declared(s: Subject) -> None:
    full = _adv_fields(s) if s.kind == "advantage" else _fields()
    keep = {"logp", "action_mask", *s.requires}
    if s.kind in ("gate", "regulariser"):
        keep.add("advantage")
        if s.role == "correction" or s.kind == "regulariser":
            ref = lossplug.registry().plugins["gate"][reference_update_gate()]
            keep |= set(required_fields(ref))
    elif s.plugin.min_group_size > 0:
        keep.add("group_id")
    minimal = {k: v for k, v in full.items() if k in keep}
    if s.kind == "advantage" and "padded" not in s.plugin.layouts:
        raise CheckSkipped("applies to padded-layout advantages (a packed batch has no optional fields)")
    try:
        if s.kind in ("gate", "regulariser"):
            _run(s, minimal)
        else:
            _advantage_of(s, PolicyBatch(**minimal))
    except (BatchValidationError, RecipeError):
        raise  # the kit's own batch or recipe is wrong: reported as an error, not blamed on the plugin
    except Exception as err:
        raise CheckFailed(
            f"with only the fields {sorted(keep)} it raised {_fmt_exc(err)} — declare every optional "
            f"PolicyBatch field it reads in requires=(...), so that a batch without it fails "
            f"validation with a clear message instead"
        ) from None


# ---------------------------------------------------------------------------------------------------------------------
# Gates


@_check(
    "ratio_one",
    ("gate",),
    "identical log-probs give ratio 1: an update gate reduces to the policy gradient A, a correction to weight 1",
)
def _ratio_one(s: Subject) -> None:
    f = _fields()
    f["old_logp"] = f["logp"].clone()
    f["behavior_logp"] = f["logp"].clone()
    mask = f["action_mask"]
    if s.role == "correction":
        inp, _ = _gate_input(f)
        out = s.plugin(inp, s.param_model())
        weight = out.weight
        where = mask if weight.ndim == 2 else torch.ones_like(weight, dtype=torch.bool)
        diff = _first_diff(weight, torch.ones_like(weight), where, rtol=1e-6, atol=1e-9)
        if diff:
            raise CheckFailed(
                f"with old_logp = behavior_logp every engine ratio is 1, so the correction's weight "
                f"must be 1; it is not {diff}"
            )
        return
    run = _run(s, f, normalizer=_normalizer(f))
    n = int(mask.sum())
    coefficient = -n * run.logp_grad  # loss = −Σ J / N under the token reduction
    expected = torch.where(mask, f["advantage"].unsqueeze(-1).expand_as(mask), 0)
    diff = _first_diff(coefficient, expected, mask, rtol=1e-6, atol=1e-9)
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


@_check("zero_advantage", ("gate", "reduction"), "zero advantage gives exactly zero gradient")
def _zero_advantage(s: Subject) -> None:
    f = _fields()
    f["advantage"] = torch.zeros_like(f["advantage"])
    run = _run(s, f, normalizer=_normalizer(f))
    grad = run.logp_grad
    bad = (grad != 0) | ~torch.isfinite(grad)
    if bool(bad.any()):
        raise CheckFailed(
            f"with A = 0 everywhere the gradient must be exactly 0, but it is not at {_where(bad)} "
            f"(max |grad| {grad.abs().max().item():.3g}) — is there a term independent of the "
            "advantage, or an inf/NaN weight multiplying it?"
        )
    if s.kind == "reduction" and float(run.loss) != 0.0:
        raise CheckFailed(f"a zero objective must reduce to 0, got {float(run.loss):.6g}")


@_check(
    "masked_poison",
    KINDS,
    "masked positions never influence the result or the gradient (they are poisoned with NaN/±inf/1e30)",
)
def _masked_poison(s: Subject) -> None:
    _padded_only(s)
    if s.kind == "advantage":
        clean = _adv_fields(s, token_reward=True)
        mask = clean["action_mask"]
        dirty = dict(clean)
        for name in _b.TOKEN_FIELDS + ("reward",):
            dirty[name] = _b.poison(clean[name], ~mask, seed=hash(name) % 1000)
        adv_a = _advantage_of(s, PolicyBatch(**clean))
        adv_b = _advantage_of(s, PolicyBatch(**dirty))
        where = mask if adv_a.ndim == 2 else None
        diff = _first_diff(adv_b, adv_a, where)
        if diff:
            raise CheckFailed(
                f"poisoning non-action positions changed the advantages {diff}: read token inputs "
                "only where action_mask is True (torch.where(mask, x, 0), not x * mask)"
            )
        return
    for token_adv in (False, True):
        clean = _fields(token_advantage=token_adv)
        mask = clean["action_mask"]
        dirty = dict(clean)
        for name in TOKEN_FIELDS + (("advantage",) if token_adv else ()):
            dirty[name] = _b.poison(clean[name], ~mask, seed=len(name))
        norm = _normalizer(clean)
        a = _run(s, clean, normalizer=norm)
        b = _run(s, dirty, normalizer=norm)
        what = "token-level" if token_adv else "sequence-level"
        if not bool(torch.isfinite(b.loss)):
            raise CheckFailed(
                f"with NaN/±inf at masked positions (non-action tokens; {what} advantages) the loss "
                f"is {float(b.loss)} — something reads the raw batch (inp.batch.*) or masks by "
                "multiplication (0·NaN = NaN); read GateInput's tensors, which are zero off actions"
            )
        if _first_diff(b.loss, a.loss) is not None:
            raise CheckFailed(
                f"poisoning masked positions changed the loss ({what} advantages): "
                f"{float(a.loss):.10g} → {float(b.loss):.10g}"
            )
        grad = b.logp_grad
        leak = ~mask & ((grad != 0) | ~torch.isfinite(grad))
        if bool(leak.any()):
            raise CheckFailed(
                f"the gradient reaches masked positions {_where(leak)} (it must be exactly 0 off actions)"
            )
        diff = _first_diff(grad, a.logp_grad, mask)
        if diff:
            raise CheckFailed(f"poisoning masked positions changed the gradient on action tokens {diff}")


@_check(
    "masked_layout",
    KINDS,
    "adding masked columns (a prompt in front, padding behind) changes neither the result nor the gradient",
)
def _masked_layout(s: Subject) -> None:
    _padded_only(s)
    before, after = 2, 3
    if s.kind == "advantage":
        clean = _adv_fields(s, token_reward=True)
        wide = _b.insert_masked_columns(clean, before, after)
        adv_a = _advantage_of(s, PolicyBatch(**clean))
        adv_b = _advantage_of(s, PolicyBatch(**wide))
        if adv_a.ndim == 2:
            adv_b = adv_b[:, before : before + adv_a.shape[1]]
        diff = _first_diff(adv_b, adv_a, clean["action_mask"] if adv_a.ndim == 2 else None)
        if diff:
            raise CheckFailed(
                f"adding {before} masked columns in front and {after} behind changed the advantages "
                f"{diff} — statistics must be taken over action tokens only"
            )
        return
    clean = _fields()
    wide = _b.insert_masked_columns(clean, before, after)
    a = _run(s, clean, normalizer=_normalizer(clean))
    b = _run(s, wide, normalizer=_normalizer(wide))
    if _first_diff(b.loss, a.loss) is not None:
        raise CheckFailed(
            f"adding {before} masked columns in front and {after} behind changed the loss "
            f"{float(a.loss):.10g} → {float(b.loss):.10g} — does it average over all T positions "
            "instead of the action tokens (use the mask / inp.lengths)?"
        )
    T = clean["logp"].shape[1]
    diff = _first_diff(b.logp_grad[:, before : before + T], a.logp_grad, clean["action_mask"])
    if diff:
        raise CheckFailed(f"adding masked columns changed the gradient on action tokens {diff}")


@_check(
    "detached",
    ("gate", "regulariser"),
    "gradient flows only through logp (a regulariser's also through entropy): corrections' weights, metrics, "
    "`active` and observations carry none, and nothing reaches old_logp, behavior_logp, ref_logp or the advantage",
)
def _detached(s: Subject) -> None:
    if s.kind == "regulariser":
        from .kit_regularisers import regulariser_detached

        return regulariser_detached(s)
    f = _fields()
    everything = ("logp", "old_logp", "behavior_logp", "ref_logp", "advantage")
    inp, _ = _gate_input(f, grad=everything)
    out = s.plugin(inp, s.param_model())
    if s.role == "correction" and out.weight is not None and out.weight.requires_grad:
        raise CheckFailed(
            "the correction's weight carries gradient (requires_grad=True): compute it under "
            "torch.no_grad() or .detach() it — a correction is a detached coefficient, gradient must "
            "flow only through the update gate's logp"
        )
    if isinstance(out.active, Tensor) and out.active.requires_grad:
        raise CheckFailed("`active` carries gradient; it must be a bool mask")
    # a metric given as a tensor was computed when the gate ran (a function is evaluated under no_grad)
    live = sorted(
        k for part in (out.metrics, out.details) for k, v in part.items() if isinstance(v, Tensor) and v.requires_grad
    )
    if live:
        raise CheckFailed(
            f"metric(s) {', '.join(live)} carry gradient: declare them as functions (evaluated under "
            "torch.no_grad() only when a metric level asks for them) or detach them (a logged metric "
            "with a graph keeps the whole graph alive)"
        )
    run = _run(s, f, normalizer=_normalizer(f), grad=everything)
    leaks = {
        k: float(g.abs().sum()) for k, g in run.grads.items() if k != "logp" and g is not None and bool((g != 0).any())
    }
    if leaks:
        names = ", ".join(f"{k} (Σ|grad| = {v:.3g})" for k, v in leaks.items())
        raise CheckFailed(
            f"gradient reached {names}: only logp may carry gradient. Treat the other inputs as "
            "constants — .detach() them (inp.old_logp.detach(), inp.advantage.detach()); otherwise "
            "a batch built with old_logp=logp (without .detach()) silently cancels the ratio's "
            "gradient"
        )


EXTREME_ROWS = (  # (logp, old_logp, behavior_logp): update and engine log-ratios up to ±1000
    (-1e-6, -100.0, -100.0),
    (-100.0, -1e-6, -1e-6),
    (-1e-6, -1000.0, -1e-6),
    (-1000.0, -1e-6, -1000.0),
    (-30.0, -1e-6, -80.0),
    (-1e-6, -50.0, -1e-6),
    (-1e-8, -1e-8, -700.0),
    (-700.0, -700.0, -1e-8),
)


@_check(
    "metric_levels",
    ("gate", "regulariser"),
    "metrics 'off', 'basic' and 'full' give the same loss and gradient; 'basic' reports a subset of 'full' with "
    "the same values",
)
def _metric_levels(s: Subject) -> None:
    f = _fields()
    runs = {}
    for level in ("off", "basic", "full"):
        try:
            runs[level] = _run(s, f, normalizer=_normalizer(f), metrics=level)
        except Exception as err:
            if level == "off":
                raise
            raise CheckFailed(
                f"with metrics='{level}' the loss step raised {_fmt_exc(err)}, with metrics='off' it "
                "did not: the loss must not depend on the metric level — declared metrics are "
                "evaluated right after the gate, and must not modify the tensors the gate computed (no "
                "in-place writes)"
            ) from None
    for level in ("basic", "full"):
        if not torch.equal(runs[level].loss, runs["off"].loss):
            raise CheckFailed(
                f"the loss with metrics='{level}' ({float(runs[level].loss):.10g}) differs from "
                f"metrics='off' ({float(runs['off'].loss):.10g}): the loss must not depend on the "
                "metric level, only the diagnostics may"
            )
        if not torch.equal(runs[level].logp_grad, runs["off"].logp_grad):
            raise CheckFailed(
                f"the gradient with metrics='{level}' differs from metrics='off' "
                f"{_first_diff(runs[level].logp_grad, runs['off'].logp_grad, rtol=0, atol=0)}"
            )
    if runs["off"].metrics:
        raise CheckFailed(f"metrics='off' still reported {sorted(runs['off'].metrics)}")
    basic, full = runs["basic"].metrics, runs["full"].metrics
    missing = sorted(set(basic) - set(full))
    if missing:
        raise CheckFailed(
            f"metric(s) {', '.join(missing)} appear with metrics='basic' but not with 'full': 'full' "
            "must report everything 'basic' does"
        )
    differ = [k for k in basic if _first_diff(basic[k], full[k], rtol=1e-6, atol=1e-9) is not None]
    if differ:
        raise CheckFailed(
            "metric(s) differ between metrics='basic' and 'full': "
            + ", ".join(f"{k} {float(basic[k]):.6g} vs {float(full[k]):.6g}" for k in differ)
        )


@_check(
    "extreme_ratios",
    ("gate", "regulariser"),
    "log-ratios of ±50 to ±1000 (update and engine) give a finite loss, gradient and metrics in fp32 and bf16",
)
def _extreme_ratios(s: Subject) -> None:
    rows = len(EXTREME_ROWS)
    T = 4
    base = torch.tensor(EXTREME_ROWS, dtype=torch.float64)  # [rows, 3]
    jitter = torch.linspace(0, 1e-3, T, dtype=torch.float64)
    logp, old, beh = (base[:, i : i + 1] - jitter for i in range(3))
    mask = torch.ones(rows, T, dtype=torch.bool)
    mask[1, -1] = False
    adv = torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0).to(torch.float64)
    for dtype in (torch.float32, torch.bfloat16):
        f = dict(logp=logp, old_logp=old, behavior_logp=beh, ref_logp=old.flip(0), advantage=adv, action_mask=mask)
        f["entropy"] = torch.linspace(0, 12, rows * T, dtype=torch.float64).reshape(rows, T)  # 0 to ≈ log(vocab)
        f = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in f.items()}
        f["group_id"] = torch.arange(rows) // 2
        for a_sign in (1, -1):
            g = dict(f, advantage=f["advantage"] * a_sign)
            run = _run(s, g, normalizer=_normalizer(g))
            if not bool(torch.isfinite(run.loss)):
                raise CheckFailed(
                    f"loss is {float(run.loss)} in {dtype} for log-ratios up to ±1000 — clamp the "
                    "log-ratio before exp (log_ratio_clamp) and keep every branch of a torch.where "
                    "finite (NaN in an unselected branch still poisons the gradient)"
                )
            grad = run.logp_grad
            bad = ~torch.isfinite(grad)
            if bool(bad.any()):
                raise CheckFailed(f"gradient is not finite in {dtype} for log-ratios up to ±1000 at {_where(bad)}")
            nan = sorted(k for k, v in run.metrics.items() if bool(torch.isnan(v).any()))
            if nan:
                raise CheckFailed(f"metric(s) {', '.join(nan)} are NaN in {dtype} for extreme log-ratios")


def _splits(B: int) -> list[list[list[int]]]:
    g = torch.Generator().manual_seed(5)
    perm = torch.randperm(B, generator=g).tolist()
    return [
        [[i] for i in range(B)],  # one row per micro-batch
        [list(range(1)), list(range(1, B - 1)), [B - 1]],  # uneven
        [sorted(perm[: B // 2]), sorted(perm[B // 2 :])],  # scattered rows (a shuffled trainer batch)
    ]


@_check(
    "microbatch_split",
    ("gate", "reduction", "regulariser"),
    "under a Normalizer, the losses and gradients of any split into micro-batches add up to the full batch's",
)
def _microbatch_split(s: Subject) -> None:
    if s.kind == "regulariser" and getattr(s.param_model(), "population", "step") != "step":
        raise CheckSkipped("population='micro_batch' reduces over each micro-batch alone, by design")
    f = _fields(B=6)
    norm = _normalizer(f)
    full = _run(s, f, normalizer=norm)
    B = f["logp"].shape[0]
    for split in _splits(B):
        total = torch.zeros((), dtype=torch.float64)
        grad = torch.zeros_like(f["logp"])
        for rows in split:
            idx = torch.tensor(rows)
            part = {
                k: (v[idx] if isinstance(v, Tensor) and v.ndim >= 1 and v.shape[0] == B else v) for k, v in f.items()
            }
            run = _run(s, part, normalizer=norm)
            total = total + run.loss.double()
            grad[idx] += run.logp_grad
        if _first_diff(total, full.loss) is not None:
            raise CheckFailed(
                f"split into micro-batches {split} (same Normalizer), the losses add up to "
                f"{float(total):.10g}, but the full batch gives {float(full.loss):.10g} — "
                "denominators must come from the Normalizer's population, and statistics must not "
                "span rows of the micro-batch"
            )
        diff = _first_diff(grad, full.logp_grad, f["action_mask"])
        if diff:
            raise CheckFailed(f"split into micro-batches {split}, the gradients differ from the full batch's {diff}")


# ---------------------------------------------------------------------------------------------------------------------
# Reductions


@_check(
    "positive_weights",
    ("reduction",),
    "every action token gets a positive weight and nothing else any (the sign convention: objective, not loss)",
)
def _positive_weights(s: Subject) -> None:
    f = _fields()
    run = _run(s, f, normalizer=_normalizer(f))
    mask = f["action_mask"]
    adv = f["advantage"].unsqueeze(-1).expand_as(mask)
    weight = torch.where(mask, -run.logp_grad / adv, 0)  # reference gate J = A·logp; loss = −reduce(J)
    bad = mask & ~(weight > 0)
    if bool(bad.any()):
        hint = (
            " The sign is flipped: a reduction returns the reduced objective; the pipeline negates it."
            if bool((weight[mask] < 0).all())
            else ""
        )
        raise CheckFailed(
            f"action tokens at {_where(bad)} get a weight ≤ 0 (min {weight[mask].min().item():.3g}).{hint}"
        )
    off = ~mask & (run.logp_grad != 0)
    if bool(off.any()):
        raise CheckFailed(f"non-action positions get gradient at {_where(off)}")


# ---------------------------------------------------------------------------------------------------------------------
# Advantages


@_check(
    "row_permutation",
    ("advantage",),
    "shuffling the rows (groups scattered differently) shuffles the advantages the same way",
)
def _row_permutation(s: Subject) -> None:
    _padded_only(s)
    f = _adv_fields(s)
    B = f["logp"].shape[0]
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(3))
    shuffled = {k: (v[perm] if v.ndim >= 1 and v.shape[0] == B else v) for k, v in f.items()}
    a = _advantage_of(s, PolicyBatch(**f))
    b = _advantage_of(s, PolicyBatch(**shuffled))
    mask = f["action_mask"][perm] if a.ndim == 2 else None
    diff = _first_diff(b, a[perm], mask)
    if diff:
        raise CheckFailed(
            f"after shuffling the rows the advantages are not the shuffled advantages {diff} — group "
            "statistics must come from group_id, never from row order"
        )


# ---------------------------------------------------------------------------------------------------------------------
# Resolving plugins and running checks


def _find(plugin: str | AnyPlugin, kind: str | None) -> tuple[str, str, AnyPlugin, str, bool]:
    """(kind, name, plugin, source, registered)."""
    reg = lossplug.registry()
    if isinstance(plugin, str):
        kinds = [kind] if kind else list(KINDS)
        found = [k for k in kinds if plugin in reg.plugins[k] or (k, plugin) in reg.duplicates]
        if not found:
            k = kind or "gate"
            if kind is None:
                others = [kk for kk in KINDS if plugin in reg.plugins[kk]]
                k = others[0] if others else "gate"
            failed_imports = [b for b in reg.broken if b.failed_to_import]
            if failed_imports:  # then "is it installed?" misleads: it is, and its import error is the answer
                from lossplug.contracts.errors import did_you_mean

                raise LookupError(
                    f"unknown {k} plugin '{plugin}'{did_you_mean(plugin, sorted(reg.plugins[k]))}. It may be "
                    "provided by an installed plugin whose import failed, so nothing it registers exists: "
                    + "; ".join(map(str, failed_imports))
                    + ". Fix that import error and run again"
                ) from None
            try:
                reg.lookup(k, plugin, "lossplug.testing")
            except LossplugError as err:
                raise LookupError(
                    f"{err}. Is the distribution that provides it installed (pip install -e .), "
                    f"with a [project.entry-points.lossplug] entry?"
                ) from None
        if len(found) > 1:
            raise LookupError(f"'{plugin}' names plugins of several kinds ({', '.join(found)}); pass kind=")
        k = found[0]
        obj = reg.lookup(k, plugin, "lossplug.testing")  # raises on duplicates
        return k, plugin, obj, reg.origin(k, plugin), True
    k = getattr(plugin, "kind", "")
    if k not in KINDS or not hasattr(plugin, "params"):
        raise TypeError(
            f"expected a plugin name or an object made by @lossplug.gate/advantage/reduction, got {plugin!r}"
        )
    registered = reg.plugins[k].get(plugin.name)
    if registered is plugin:
        return k, plugin.name, plugin, reg.origin(k, plugin.name), True
    if registered is not None or (k, plugin.name) in reg.duplicates:
        raise LookupError(
            f"a different {k} is already registered as '{plugin.name}' ({reg.origin(k, plugin.name)}); "
            "rename yours or test the registered one by name"
        )
    return k, plugin.name, plugin, "unregistered, checked in-process", False


@contextlib.contextmanager
def _registered(kind: str, plugin: AnyPlugin, needed: bool) -> Iterator[None]:
    if not needed:
        yield
        return
    from lossplug.plugin_registry import HOOKS

    shim = types.SimpleNamespace()

    def register_hook(register: Callable[[AnyPlugin], None]) -> None:
        register(plugin)

    setattr(shim, HOOKS[kind], lossplug.hookimpl(register_hook))
    register_hook.__name__ = HOOKS[kind]
    lossplug.register_plugin(shim, name=f"lossplug.testing:{plugin.name}")
    try:
        yield
    finally:
        lossplug.unregister_plugin(shim)


def checks_for(plugin: str | AnyPlugin, *, kind: str | None = None) -> list[str]:
    """The names of the checks that apply to this plugin's kind."""
    k = _find(plugin, kind)[0] if isinstance(plugin, str) else plugin.kind
    return [name for name, c in CHECKS.items() if k in c.kinds]


def _run_one(subject: Subject, name: str) -> CheckResult:
    check = CHECKS[name]
    try:
        check.fn(subject)
    except CheckSkipped as skip:
        return CheckResult(name, "skipped", str(skip), check.summary)
    except CheckFailed as fail:
        return CheckResult(name, "failed", str(fail), check.summary)
    except Exception as err:  # the plugin (or a contract it feeds) raised: that is a failure, with where
        return CheckResult(name, "failed", f"raised {_fmt_exc(err)}", check.summary)
    return CheckResult(name, "passed", "", check.summary)


def check_plugin(
    plugin: str | AnyPlugin,
    *,
    kind: str | None = None,
    params: Mapping[str, Any] | None = None,
    checks: Iterable[str] | None = None,
    skip: Iterable[str] | Mapping[str, str] = (),
) -> ConformanceReport:
    """Run the conformance checks against one plugin and return a :class:`ConformanceReport` (never raises for a
    failing check; see :func:`assert_conforms`).

    ``plugin`` is a registered name (``kind=`` disambiguates) or a plugin object made by ``@lossplug.gate`` /
    ``advantage`` / ``reduction`` — an unregistered object is registered in-process for the duration of the run.
    ``params`` are the plugin's parameters to test with (default: its defaults). ``checks`` restricts the run to
    these names; ``skip`` lists checks that do not apply by design (a mapping gives the reason for each).
    """
    k, name, obj, source, registered = _find(plugin, kind)
    applicable = [n for n, c in CHECKS.items() if k in c.kinds]
    wanted = list(checks) if checks is not None else applicable
    unknown = [n for n in wanted if n not in CHECKS] + [n for n in skip if n not in CHECKS]
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; checks are: {', '.join(CHECKS)}")
    reasons = dict(skip) if isinstance(skip, Mapping) else {n: "skipped by the caller" for n in skip}
    report = ConformanceReport(k, name, source, dict(params or {}))
    subject = Subject(k, name, obj, dict(params or {}), source)
    with _registered(k, obj, needed=not registered), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for n in wanted:
            if n not in applicable:
                report.results.append(CheckResult(n, "skipped", f"does not apply to a {k}", CHECKS[n].summary))
            elif n in reasons:
                report.results.append(CheckResult(n, "skipped", reasons[n], CHECKS[n].summary))
            else:
                report.results.append(_run_one(subject, n))
    return report


def run_check(
    plugin: str | AnyPlugin, check: str, *, kind: str | None = None, params: Mapping[str, Any] | None = None
) -> CheckResult:
    """Run one named check; returns its :class:`CheckResult`."""
    return check_plugin(plugin, kind=kind, params=params, checks=[check]).results[0]


def assert_conforms(
    plugin: str | AnyPlugin,
    *,
    kind: str | None = None,
    params: Mapping[str, Any] | None = None,
    checks: Iterable[str] | None = None,
    skip: Iterable[str] | Mapping[str, str] = (),
) -> ConformanceReport:
    """:func:`check_plugin`, raising :class:`ConformanceError` (an ``AssertionError``) listing every failure."""
    return check_plugin(plugin, kind=kind, params=params, checks=checks, skip=skip).raise_for_failures()


# the regularisers' own checks register themselves in CHECKS (they use the helpers above)
from . import kit_regularisers as _kit_regularisers  # noqa: E402,F401
