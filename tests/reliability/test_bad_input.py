"""A catalogue of bad input: every malformed batch, recipe, normaliser or plugin is refused with a clear
:class:`lossplug.LossplugError` whose message names the field, the rule it broke and where (row / position /
recipe stage / parameter) — never a raw torch, pydantic or Python error.

The catalogue is data: ``CASES`` is a list of :class:`Case` (name, a builder that must raise, the fragments the
message must contain). A hypothesis fuzz of the validators closes the file: random shapes, dtypes and values never
produce anything but a ``LossplugError`` (or a valid batch whose loss is finite).

A case marked ``known_bug`` documents an error that still escapes as a raw exception; it runs as a strict xfail, so
fixing the bug turns it into a failure that asks for the mark to be removed. (None is open at the moment.)
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pydantic
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import lossplug
from lossplug import (
    BatchValidationError,
    LossplugError,
    Normalizer,
    PackedTransitions,
    PluginError,
    PolicyBatch,
    Recipe,
    RecipeError,
    compute_advantages,
    policy_loss,
)

NAN, INF = float("nan"), float("inf")
B, T = 2, 3

#: exception types that must never reach a user directly
RAW = (
    pydantic.ValidationError,
    RuntimeError,
    TypeError,
    ValueError,
    AttributeError,
    KeyError,
    IndexError,
    NotImplementedError,
    AssertionError,
)


# ---------------------------------------------------------------------------------------------------------------------
# Builders


def fields(**over: Any) -> dict[str, Any]:
    """A valid PolicyBatch of 2 responses × 3 positions (row 0 has a padded last position)."""
    out = dict(
        logp=torch.full((B, T), -1.0),
        action_mask=torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool),
        old_logp=torch.full((B, T), -1.1),
        behavior_logp=torch.full((B, T), -1.2),
        advantage=torch.tensor([1.0, -1.0]),
    )
    out.update(over)
    return {k: v for k, v in out.items() if v is not None}


def with_value(name: str, row: int, pos: int, value: float, **over: Any) -> dict[str, Any]:
    f = fields(**over)
    t = f[name].clone()
    t[row, pos] = value
    f[name] = t
    return f


def batch(**over: Any) -> PolicyBatch:
    return PolicyBatch(**fields(**over))


def packed(**over: Any) -> dict[str, Any]:
    """A valid PackedTransitions: two fragments [0, 1] and [2] (the second one a time-limit truncation)."""
    out = dict(
        reward=torch.tensor([0.0, 1.0, 0.5]),
        value=torch.tensor([0.1, 0.2, 0.3]),
        next_value=torch.tensor([0.2, NAN, 0.4]),
        terminated=torch.tensor([False, True, False]),
        boundary=torch.tensor([False, True, True]),
    )
    out.update(over)
    return out


def recipe(**over: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"gates": ["ppo_clip"], "reduction": "token"}
    out.update(over)
    return out


def grouped(group_id, reward=None, **over) -> PolicyBatch:
    n = len(group_id)
    return PolicyBatch(
        logp=torch.full((n, 2), -1.0),
        action_mask=torch.ones(n, 2, dtype=torch.bool),
        reward=torch.arange(n, dtype=torch.float32) if reward is None else reward,
        group_id=torch.tensor(group_id),
        **over,
    )


def with_plugin(plugin: object, name: str, action: Callable[[], Any]) -> Callable[[], Any]:
    """Run ``action`` with an in-process plugin registered, and unregister it afterwards."""

    def run():
        lossplug.register_plugin(plugin, name)
        try:
            return action()
        finally:
            lossplug.unregister_plugin(plugin)

    return run


# -- misbehaving plugins ----------------------------------------------------------------------------------------------


class _Boom(Exception):
    pass


@lossplug.gate("lpx_raising_gate")
def _raising_gate(inp, p):
    """A gate with a bug."""
    raise ZeroDivisionError("division by zero in my gate")


@lossplug.gate("lpx_shapeless_gate")
def _shapeless_gate(inp, p):
    """A gate that returns a per-response objective where a per-token one is due."""
    return lossplug.GateOutput(objective=inp.advantage.sum(-1))


@lossplug.gate("lpx_no_objective_gate")
def _no_objective_gate(inp, p):
    """An update gate that forgets its objective."""
    return lossplug.GateOutput(weight=torch.ones_like(inp.logp))


@lossplug.gate("lpx_bad_weight", role="correction")
def _bad_weight(inp, p):
    """A correction whose weight has the wrong shape."""
    return lossplug.GateOutput(weight=torch.ones(inp.logp.shape[0] + 1))


@lossplug.advantage("lpx_raising_adv")
def _raising_adv(batch, p):
    """An advantage estimator with a bug."""
    raise IndexError("index 7 is out of bounds")


@lossplug.advantage("lpx_list_adv")
def _list_adv(batch, p):
    """An advantage estimator that returns a list."""
    return [0.0] * batch.batch_size


@lossplug.regularizer("lpx_raising_regularizer")
def _raising_regularizer(inp, p):
    """A regularizer with a bug."""
    raise ZeroDivisionError("division by zero in my regularizer")


@lossplug.regularizer("lpx_shapeless_regularizer")
def _shapeless_regularizer(inp, p):
    """A regularizer that returns a per-response term where a per-token one is due."""
    return inp.logp.sum(-1)


@lossplug.regularizer("lpx_list_regularizer")
def _list_regularizer(inp, p):
    """A regularizer that returns a list."""
    return [0.0]


@lossplug.regularizer("lpx_nan_regularizer")
def _nan_regularizer(inp, p):
    """A regularizer whose term is NaN on the actions."""
    return inp.logp * NAN


@lossplug.reduction("lpx_raising_reduction")
def _raising_reduction(objective, mask, lengths, population, p):
    """A reduction with a bug."""
    raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")


class _Registers:
    def __init__(self, *plugins):
        self.plugins = plugins

    @lossplug.hookimpl
    def lossplug_register_gates(self, register):
        for p in self.plugins:
            if p.kind == "gate":
                register(p)

    @lossplug.hookimpl
    def lossplug_register_advantages(self, register):
        for p in self.plugins:
            if p.kind == "advantage":
                register(p)

    @lossplug.hookimpl
    def lossplug_register_reductions(self, register):
        for p in self.plugins:
            if p.kind == "reduction":
                register(p)

    @lossplug.hookimpl
    def lossplug_register_regularizers(self, register):
        for p in self.plugins:
            if p.kind == "regularizer":
                register(p)


class _RaisingValidator:
    @lossplug.hookimpl
    def lossplug_validate_batch(self, batch, recipe):
        raise KeyError("group_size")


class _BadViolations:
    @lossplug.hookimpl
    def lossplug_validate_batch(self, batch, recipe):
        return ["not a Violation"]


class _RaisingMetrics:
    @lossplug.hookimpl
    def lossplug_extra_metrics(self, batch, objective, recipe):
        raise _Boom("metric backend unavailable")


class _WrappingValidator:
    @lossplug.hookimpl(wrapper=True)
    def lossplug_validate_batch(self, batch, recipe):
        return (yield)


class _ListMetrics:
    @lossplug.hookimpl
    def lossplug_extra_metrics(self, batch, objective, recipe):
        return [1.0, 2.0]


def _dup_gate(name):
    @lossplug.gate(name)
    def g(inp, p):
        """Duplicate."""
        return lossplug.GateOutput(objective=inp.advantage * inp.logp)

    return g


def _duplicates():
    first, second = _Registers(_dup_gate("lpx_twice")), _Registers(_dup_gate("lpx_twice"))
    lossplug.register_plugin(first, "first-package")
    lossplug.register_plugin(second, "second-package")
    try:
        with pytest.warns(lossplug.LossplugPluginWarning, match="registered more than once"):
            lossplug.registry()
        return Recipe.model_validate(recipe(gates=["lpx_twice"]))
    finally:
        lossplug.unregister_plugin(first)
        lossplug.unregister_plugin(second)


# ---------------------------------------------------------------------------------------------------------------------
# The catalogue


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], Any]
    fragments: tuple[str, ...]
    error: type = LossplugError
    known_bug: str | None = None
    tags: tuple[str, ...] = field(default=())


C = Case
CASES: list[Case] = [
    # -- PolicyBatch: structure, shapes, dtypes ---------------------------------------------------------------------
    C(
        "logp is 1-D",
        lambda: PolicyBatch(**fields(logp=torch.zeros(3))),
        ("logp", "must be [B, T]", "(3,)"),
        BatchValidationError,
    ),
    C(
        "logp is 3-D",
        lambda: PolicyBatch(**fields(logp=torch.zeros(B, T, 5))),
        ("logp", "must be [B, T]", "(2, 3, 5)"),
        BatchValidationError,
    ),
    C(
        "logp is an integer tensor",
        lambda: batch(logp=torch.zeros(B, T, dtype=torch.long)),
        ("logp", "must be a float tensor", "torch.int64"),
        BatchValidationError,
    ),
    C(
        "logp is complex",
        lambda: batch(logp=torch.zeros(B, T, dtype=torch.complex64)),
        ("logp", "must be a float tensor", "complex64"),
        BatchValidationError,
    ),
    C(
        "action_mask is float",
        lambda: batch(action_mask=torch.ones(B, T)),
        ("action_mask", "must be a bool tensor", "torch.float32", ".bool()"),
        BatchValidationError,
    ),
    C(
        "action_mask is uint8",
        lambda: batch(action_mask=torch.ones(B, T, dtype=torch.uint8)),
        ("action_mask", "must be a bool tensor", "torch.uint8"),
        BatchValidationError,
    ),
    C(
        "old_logp has the wrong width",
        lambda: batch(old_logp=torch.zeros(B, T + 1)),
        ("old_logp", "shape must align with logp [B=2, T=3]", "expected [2, 3]", "got [2, 4]"),
        BatchValidationError,
    ),
    C(
        "advantage has one row too many",
        lambda: batch(advantage=torch.zeros(B + 1)),
        ("advantage", "expected [2] or [2, 3]", "got [3]"),
        BatchValidationError,
    ),
    C(
        "group_id is per token",
        lambda: batch(group_id=torch.zeros(B, T, dtype=torch.long)),
        ("group_id", "expected [2]", "got [2, 3]"),
        BatchValidationError,
    ),
    C(
        "group_id is float",
        lambda: batch(group_id=torch.zeros(B)),
        ("group_id", "must be an int tensor", "torch.float32"),
        BatchValidationError,
    ),
    C(
        "terminated is int",
        lambda: batch(terminated=torch.zeros(B, dtype=torch.long)),
        ("terminated", "must be a bool tensor", "torch.int64"),
        BatchValidationError,
    ),
    C(
        "a field is a Python list",
        lambda: batch(advantage=[1.0, -1.0]),
        ("advantage", "must be a torch.Tensor", "got list"),
        BatchValidationError,
    ),
    C(
        "a field is a numpy array",
        lambda: batch(logp=pytest.importorskip("numpy").zeros((B, T))),
        ("logp", "must be a torch.Tensor", "ndarray"),
        BatchValidationError,
    ),
    C(
        "a field name has a typo",
        lambda: batch(old_logps=torch.zeros(B, T)),
        ("old_logps", "unknown field", "did you mean 'old_logp'"),
        BatchValidationError,
    ),
    C(
        "the required action_mask is missing",
        lambda: PolicyBatch(logp=torch.zeros(B, T)),
        ("action_mask", "is required"),
        BatchValidationError,
    ),
    C(
        "the batch is not keyword fields",
        lambda: PolicyBatch([1, 2]),
        ("<batch>", "expected keyword fields", "list"),
        BatchValidationError,
    ),
    C(
        "the batch has no responses",
        lambda: batch(
            logp=torch.zeros(0, T),
            action_mask=torch.ones(0, T, dtype=torch.bool),
            old_logp=None,
            behavior_logp=None,
            advantage=None,
        ),
        ("logp", "at least one response", "[0, 3]"),
        BatchValidationError,
    ),
    C(
        "a sparse tensor",
        lambda: batch(old_logp=torch.full((B, T), -1.0).to_sparse()),
        ("old_logp", "dense", "sparse"),
        BatchValidationError,
    ),
    C(
        "an unchecked batch without logp",
        lambda: policy_loss(
            PolicyBatch.unchecked(action_mask=torch.ones(B, T, dtype=torch.bool), advantage=torch.ones(B)), "dapo"
        ),
        ("logp", "is required"),
        BatchValidationError,
    ),
    # -- PolicyBatch: values ---------------------------------------------------------------------------------------
    C(
        "NaN log-prob on an action position",
        lambda: PolicyBatch(**with_value("logp", 1, 2, NAN)),
        ("logp", "must be finite on action positions", "(row 1, pos 2)"),
        BatchValidationError,
    ),
    C(
        "-inf old log-prob on an action position",
        lambda: PolicyBatch(**with_value("old_logp", 0, 1, -INF)),
        ("old_logp", "must be finite on action positions", "(row 0, pos 1)"),
        BatchValidationError,
    ),
    C(
        "inf behaviour log-prob on an action position",
        lambda: PolicyBatch(**with_value("behavior_logp", 1, 0, INF)),
        ("behavior_logp", "must be finite on action positions", "(row 1, pos 0)"),
        BatchValidationError,
    ),
    C(
        "NaN advantage",
        lambda: batch(advantage=torch.tensor([1.0, NAN])),
        ("advantage", "must be finite", "row [1]"),
        BatchValidationError,
    ),
    C(
        "inf token reward on an action position",
        lambda: batch(reward=torch.tensor([[0.0, INF, 0.0], [0.0, 0.0, 1.0]])),
        ("reward", "must be finite on action positions", "(row 0, pos 1)"),
        BatchValidationError,
    ),
    C(
        "NaN value on an action position",
        lambda: batch(value=torch.tensor([[0.0, 0.0, 0.0], [NAN, 0.0, 0.0]])),
        ("value", "must be finite on action positions", "(row 1, pos 0)"),
        BatchValidationError,
    ),
    C(
        "a response with no action",
        lambda: batch(action_mask=torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)),
        ("action_mask", "every response needs at least one action token", "row [1]"),
        BatchValidationError,
    ),
    C(
        "an all-masked batch",
        lambda: batch(action_mask=torch.zeros(B, T, dtype=torch.bool)),
        ("action_mask", "every response needs at least one action token", "rows [0, 1]"),
        BatchValidationError,
    ),
    C(
        "a positive log-prob",
        lambda: PolicyBatch(**with_value("logp", 0, 1, 0.5)),
        ("logp", "log-probs must be <= 0", "(row 0, pos 1)"),
        BatchValidationError,
    ),
    C(
        "a positive behaviour log-prob",
        lambda: PolicyBatch(**with_value("behavior_logp", 1, 2, 2.0)),
        ("behavior_logp", "log-probs must be <= 0", "(row 1, pos 2)"),
        BatchValidationError,
    ),
    C(
        "NaN final value of a truncated response",
        lambda: batch(terminated=torch.tensor([False, True]), final_value=torch.tensor([NAN, NAN])),
        ("final_value", "must be finite for truncated", "row [0]"),
        BatchValidationError,
    ),
    C(
        "every violation is reported at once",
        lambda: PolicyBatch(**with_value("logp", 1, 1, NAN, old_logp=torch.full((B, T), 3.0))),
        ("2 contract checks", "logp: must be finite", "(row 1, pos 1)", "old_logp: log-probs must be <= 0"),
        BatchValidationError,
    ),
    # -- PackedTransitions -------------------------------------------------------------------------------------------
    C(
        "terminated without boundary",
        lambda: PackedTransitions(**packed(terminated=torch.tensor([True, True, False]))),
        ("terminated", "terminated ⇒ boundary", "position [0]"),
        BatchValidationError,
    ),
    C(
        "an unclosed packed fragment",
        lambda: PackedTransitions(**packed(boundary=torch.tensor([False, True, False]))),
        ("boundary", "must be closed", "position 2"),
        BatchValidationError,
    ),
    C(
        "an empty packed batch",
        lambda: PackedTransitions(**{k: v[:0] for k, v in packed().items()}),
        ("reward", "non-empty", "[0]"),
        BatchValidationError,
    ),
    C(
        "misaligned transitions",
        lambda: PackedTransitions(**packed(value=torch.zeros(2))),
        ("value", "must align with reward [N=3]", "[2]"),
        BatchValidationError,
    ),
    C(
        "NaN next value where it bootstraps",
        lambda: PackedTransitions(**packed(next_value=torch.tensor([NAN, 0.0, 0.0]))),
        ("next_value", "must be finite where the transition bootstraps", "position [0]"),
        BatchValidationError,
    ),
    C(
        "a fragment mixing trajectories",
        lambda: PackedTransitions(**packed(trajectory_id=torch.tensor([0, 1, 2]))),
        ("trajectory_id", "must not mix trajectories", "position [0]"),
        BatchValidationError,
    ),
    C(
        "boundary is int",
        lambda: PackedTransitions(**packed(boundary=torch.tensor([0, 1, 1]))),
        ("boundary", "must be a bool tensor", "torch.int64"),
        BatchValidationError,
    ),
    # -- what the recipe needs from the batch ---------------------------------------------------------------------
    C(
        "policy loss without advantages",
        lambda: policy_loss(batch(advantage=None), "dapo"),
        ("advantage", "required by policy_loss", "lossplug.compute_advantages"),
        BatchValidationError,
    ),
    C(
        "PPO clip without old log-probs",
        lambda: policy_loss(batch(old_logp=None), "dapo"),
        ("old_logp", "recipe.gates[0] (ppo_clip)", "old_logp=logp.detach()"),
        BatchValidationError,
    ),
    C(
        "TIS without behaviour log-probs",
        lambda: policy_loss(batch(behavior_logp=None), recipe(gates=["ppo_clip", "tis"])),
        ("behavior_logp", "recipe.gates[1] (tis)", "has none"),
        BatchValidationError,
    ),
    C(
        "GRPO without group ids",
        lambda: compute_advantages(batch(reward=torch.ones(B)), "grpo"),
        ("group_id", "recipe.advantage (grpo)", "has none"),
        BatchValidationError,
    ),
    C(
        "singleton groups for RLOO",
        lambda: compute_advantages(grouped([4, 4, 9, 11]), "rloo"),
        ("group_id", "recipe.advantage (rloo)", "at least 2 rollouts", "groups [9, 11]", "sizes [1, 1]"),
        BatchValidationError,
    ),
    C(
        "GAE without values",
        lambda: compute_advantages(batch(reward=torch.ones(B)), "ppo"),
        ("value", "recipe.advantage (gae)", "has none"),
        BatchValidationError,
    ),
    # -- the optional fields of the newer plugins (entropy-aware gates, regularizers, verl/TRL estimators) ---------
    C(
        "top_entropy without entropies",
        lambda: policy_loss(batch(), recipe(gates=["ppo_clip", "top_entropy"])),
        ("entropy", "recipe.gates[1] (top_entropy)", "has none"),
        BatchValidationError,
    ),
    C(
        "an entropy bonus without entropies",
        lambda: policy_loss(batch(), recipe(regularizers=[{"name": "entropy", "coef": 0.01}])),
        ("entropy", "recipe.regularizers[0] (entropy)", "has none"),
        BatchValidationError,
    ),
    C(
        "a KL regularizer without reference log-probs",
        lambda: policy_loss(batch(), recipe(regularizers=[{"name": "kl", "coef": 0.1}])),
        ("ref_logp", "recipe.regularizers[0] (kl", "has none"),
        BatchValidationError,
    ),
    C(
        "ReMax without the greedy reward",
        lambda: compute_advantages(batch(reward=torch.ones(B)), recipe(advantage="remax")),
        ("reward_baseline", "recipe.advantage (remax)", "has none"),
        BatchValidationError,
    ),
    C(
        "GDPO without reward components",
        lambda: compute_advantages(grouped([1, 1, 2, 2]), recipe(advantage="gdpo")),
        ("reward_components", "recipe.advantage (gdpo)", "has none"),
        BatchValidationError,
    ),
    C(
        "optimal token baseline without sum_pi_squared",
        lambda: compute_advantages(
            grouped([1, 1, 2, 2], old_logp=torch.full((4, 2), -1.0)), recipe(advantage="optimal_token_baseline")
        ),
        ("sum_pi_squared", "recipe.advantage (optimal_token_baseline)", "has none"),
        BatchValidationError,
    ),
    C(
        "a negative entropy on an action",
        lambda: batch(entropy=torch.tensor([[0.5, -1.0, 0.1], [0.2, 0.3, 0.4]])),
        ("entropy", "must be finite and >= 0", "on action positions", "(row 0, pos 1)"),
        BatchValidationError,
    ),
    C(
        "a NaN entropy on an action",
        lambda: batch(entropy=torch.tensor([[0.5, 0.1, 0.2], [NAN, 0.3, 0.4]])),
        ("entropy", "must be finite and >= 0", "(row 1, pos 0)"),
        BatchValidationError,
    ),
    C(
        "entropy per response",
        lambda: batch(entropy=torch.ones(B)),
        ("entropy", "shape must align with logp", "expected [2, 3]", "got [2]"),
        BatchValidationError,
    ),
    C(
        "sum_pi_squared above 1",
        lambda: batch(sum_pi_squared=torch.tensor([[0.5, 1.5, 0.1], [0.2, 0.3, 0.4]])),
        ("sum_pi_squared", "must be in [0, 1]", "(row 0, pos 1)"),
        BatchValidationError,
    ),
    C(
        "sum_pi_squared negative",
        lambda: batch(sum_pi_squared=torch.tensor([[0.5, 0.5, 0.1], [0.2, -0.3, 0.4]])),
        ("sum_pi_squared", "must be in [0, 1]", "(row 1, pos 1)"),
        BatchValidationError,
    ),
    C(
        "reward_components without a component axis",
        lambda: batch(reward_components=torch.ones(B)),
        ("reward_components", "must be [B=2, K]", "got [2]"),
        BatchValidationError,
    ),
    C(
        "reward_components with no column",
        lambda: batch(reward_components=torch.ones(B, 0)),
        ("reward_components", "(K >= 1)", "got [2, 0]"),
        BatchValidationError,
    ),
    C(
        "a NaN reward component",
        lambda: batch(reward_components=torch.tensor([[1.0, NAN], [0.0, 1.0]])),
        ("reward_components", "must be finite", "row 0"),
        BatchValidationError,
    ),
    C(
        "reward_baseline per token",
        lambda: batch(reward_baseline=torch.ones(B, T)),
        ("reward_baseline", "expected [2]", "got [2, 3]"),
        BatchValidationError,
    ),
    C(
        "an infinite reward_baseline",
        lambda: batch(reward_baseline=torch.tensor([1.0, INF])),
        ("reward_baseline", "must be finite", "row [1]"),
        BatchValidationError,
    ),
    # -- regularizer stages -------------------------------------------------------------------------------------------
    C(
        "an unknown regularizer",
        lambda: Recipe.model_validate(recipe(regularizers=[{"name": "kll"}])),
        ("recipe.regularizers[0]", "unknown regularizer plugin 'kll'", "did you mean 'kl'"),
        RecipeError,
    ),
    C(
        "a gate in the regularizer stage",
        lambda: Recipe.model_validate(recipe(regularizers=["tis"])),
        (
            "recipe.regularizers[0]",
            "unknown regularizer plugin 'tis'",
            # every registered regularizer, in order (read from the registry: a new built-in joins the list)
            "available: " + ", ".join(sorted(lossplug.registry().plugins["regularizer"])),
        ),
        RecipeError,
    ),
    C(
        "an unknown KL estimator",
        lambda: Recipe.model_validate(recipe(regularizers=[{"name": "kl", "estimator": "k4"}])),
        ("recipe.regularizers[0] (kl)", "parameter 'estimator'", "'low_var_kl'", "'k4'"),
        RecipeError,
    ),
    C(
        "a NaN regularizer coefficient",
        lambda: Recipe.model_validate(recipe(regularizers=[{"name": "kl", "coef": NAN}])),
        ("recipe.regularizers[0] (kl)", "parameter 'coef'", "finite"),
        RecipeError,
    ),
    C(
        "a regularizer's unknown reduction",
        lambda: Recipe.model_validate(recipe(regularizers=[{"name": "kl", "reduction": "tokn"}])),
        ("recipe.regularizers[0].reduction", "unknown reduction plugin 'tokn'", "did you mean 'token'"),
        RecipeError,
    ),
    C(
        "adaptive entropy bounds crossed",
        lambda: Recipe.model_validate(
            recipe(regularizers=[{"name": "entropy", "adaptive": True, "coef_min": 2, "coef_max": 1}])
        ),
        ("recipe.regularizers[0] (entropy)", "coef_min (2.0) must be <= coef_max (1.0)"),
        RecipeError,
    ),
    C(
        "top_entropy keeping more than every token",
        lambda: Recipe.model_validate(recipe(gates=["ppo_clip", {"name": "top_entropy", "quantile": 2}])),
        ("recipe.gates[1] (top_entropy)", "parameter 'quantile'", "less than or equal to 1", "got 2"),
        RecipeError,
    ),
    C(
        "packed transitions for a padded-only estimator",
        lambda: compute_advantages(PackedTransitions(**packed()), "grpo"),
        ("recipe.advantage (grpo)", "padded layout", "PackedTransitions"),
    ),
    C(
        "advantages from a recipe without an advantage stage",
        lambda: compute_advantages(batch(), recipe()),
        ("no advantage stage",),
    ),
    C(
        "an unchecked batch with misaligned tensors",
        lambda: policy_loss(PolicyBatch.unchecked(**fields(old_logp=torch.zeros(B, T + 1))), "dapo"),
        ("old_logp", "shape must align with logp", "got [2, 4]"),
        BatchValidationError,
    ),
    C("a dict instead of a PolicyBatch", lambda: policy_loss(fields(), "dapo"), ("policy_loss", "PolicyBatch", "dict")),
    C(
        "a dict instead of a batch for advantages",
        lambda: compute_advantages(fields(reward=torch.ones(B)), "grpo"),
        ("compute_advantages", "PolicyBatch", "dict"),
    ),
    # -- normaliser and reduction -----------------------------------------------------------------------------------
    C(
        "a normaliser smaller than the micro-batch",
        lambda: policy_loss(batch(), "dapo", Normalizer(action_tokens=2, sequences=2)),
        ("Normalizer", "smaller than this micro-batch", "action_tokens=5"),
    ),
    C(
        "a normaliser that is a dict",
        lambda: policy_loss(batch(), "dapo", {"action_tokens": 5, "sequences": 2}),
        ("normalizer", "Normalizer", "dict"),
    ),
    C(
        "fixed reduction without a budget",
        lambda: policy_loss(batch(), recipe(reduction="fixed")),
        ("reduction 'fixed'", "budget", "Normalizer(budget="),
    ),
    C(
        "an unknown validate mode",
        lambda: policy_loss(batch(), "dapo", validate="partial"),
        ("validate", "'full' or 'off'", "'partial'"),
    ),
    C(
        "reduce with a misaligned mask",
        lambda: lossplug.reduce(torch.zeros(B, T), torch.ones(B, T + 1, dtype=torch.bool), "dapo"),
        ("reduce", "values", "[2, 3]", "action_mask", "[2, 4]"),
    ),
    C(
        "reduce with a float mask",
        lambda: lossplug.reduce(torch.zeros(B, T), torch.ones(B, T), "dapo"),
        ("reduce", "action_mask", "bool", "torch.float32"),
    ),
    C(
        "a normaliser with zero tokens",
        lambda: Normalizer(action_tokens=0, sequences=1),
        ("action_tokens", "greater than 0"),
    ),
    C(
        "a normaliser for all-masked micro-batches",
        lambda: Normalizer.for_masks([torch.zeros(B, T, dtype=torch.bool)]),
        ("action_tokens", "no action"),
    ),
    # -- recipes ----------------------------------------------------------------------------------------------------
    C(
        "an unknown gate",
        lambda: Recipe.model_validate(recipe(gates=["ppo_clp"])),
        ("recipe.gates[0]", "unknown gate plugin 'ppo_clp'", "did you mean 'ppo_clip'", "available:"),
        RecipeError,
    ),
    C(
        "an unknown advantage",
        lambda: Recipe.model_validate(recipe(advantage="gpro")),
        ("recipe.advantage", "unknown advantage plugin 'gpro'", "did you mean 'grpo'"),
        RecipeError,
    ),
    C(
        "an unknown reduction",
        lambda: Recipe.model_validate(recipe(reduction="tokens")),
        ("recipe.reduction", "unknown reduction plugin 'tokens'", "did you mean 'token'"),
        RecipeError,
    ),
    C(
        "an unknown parameter",
        lambda: Recipe.model_validate(recipe(gates=[{"name": "ppo_clip", "eps": 0.2}])),
        ("recipe.gates[0] (ppo_clip)", "unknown parameter 'eps'", "allowed: eps_low, eps_high"),
        RecipeError,
    ),
    C(
        "a parameter of the wrong type",
        lambda: Recipe.model_validate(recipe(gates=[{"name": "ppo_clip", "eps_low": "abc"}])),
        ("recipe.gates[0] (ppo_clip)", "parameter 'eps_low'", "valid number", "'abc'"),
        RecipeError,
    ),
    C(
        "epsilon = 0",
        lambda: Recipe.model_validate(recipe(gates=[{"name": "ppo_clip", "eps_low": 0}])),
        ("recipe.gates[0] (ppo_clip)", "parameter 'eps_low'", "greater than 0", "got 0"),
        RecipeError,
    ),
    C(
        "epsilon < 0",
        lambda: Recipe.model_validate(recipe(gates=[{"name": "ppo_clip", "eps_high": -0.1}])),
        ("parameter 'eps_high'", "greater than 0", "got -0.1"),
        RecipeError,
    ),
    C(
        "eps_low >= 1",
        lambda: Recipe.model_validate(recipe(gates=[{"name": "ppo_clip", "eps_low": 1.5}])),
        ("parameter 'eps_low'", "less than 1", "got 1.5"),
        RecipeError,
    ),
    C(
        "dual-clip c <= 1",
        lambda: Recipe.model_validate(recipe(gates=[{"name": "ppo_clip", "dual_clip_c": 0.5}])),
        ("parameter 'dual_clip_c'", "greater than 1"),
        RecipeError,
    ),
    C(
        "a negative budget",
        lambda: Recipe.model_validate(recipe(reduction={"name": "fixed", "budget": -1})),
        ("recipe.reduction (fixed)", "parameter 'budget'", "greater than 0", "got -1"),
        RecipeError,
    ),
    C(
        "IcePop low > high",
        lambda: Recipe.model_validate(recipe(gates=["ppo_clip", {"name": "icepop", "low": 5, "high": 0.5}])),
        ("recipe.gates[1] (icepop)", "low (5.0) must not be above high (0.5)"),
        RecipeError,
    ),
    C(
        "an invalid choice",
        lambda: Recipe.model_validate(recipe(advantage={"name": "grpo", "scale": "grp"})),
        ("recipe.advantage (grpo)", "parameter 'scale'", "'group'", "'grp'"),
        RecipeError,
    ),
    C("no gates", lambda: Recipe.model_validate(recipe(gates=[])), ("recipe.gates", "at least one gate"), RecipeError),
    C(
        "no reduction",
        lambda: Recipe.model_validate({"gates": ["ppo_clip"]}),
        ("recipe.reduction", "required"),
        RecipeError,
    ),
    C(
        "a correction as the update gate",
        lambda: Recipe.model_validate(recipe(gates=["tis"])),
        ("recipe.gates[0] (tis)", "first gate must be an update gate", "correction"),
        RecipeError,
    ),
    C(
        "an update gate as a correction",
        lambda: Recipe.model_validate(recipe(gates=["ppo_clip", "ppo_clip"])),
        ("recipe.gates[1] (ppo_clip)", "detached corrections", "update gate"),
        RecipeError,
    ),
    C(
        "an unknown recipe key",
        lambda: Recipe.model_validate({"gate": "ppo_clip", "reduction": "token"}),
        ("unknown key 'gate'", "did you mean 'gates'"),
        RecipeError,
    ),
    C(
        "an unknown preset",
        lambda: Recipe.preset("grop"),
        ("unknown preset 'grop'", "did you mean 'grpo'"),
        RecipeError,
    ),
    C(
        "a stage without a name",
        lambda: Recipe.model_validate(recipe(gates=[{"eps_low": 0.2}])),
        ("recipe.gates[0]", "needs a 'name'"),
        RecipeError,
    ),
    C(
        "parameters both flat and nested",
        lambda: Recipe.model_validate(
            recipe(gates=[{"name": "ppo_clip", "eps_low": 0.1, "params": {"eps_high": 0.3}}])
        ),
        ("recipe.gates[0]", "either flat or under 'params'"),
        RecipeError,
    ),
    C(
        "a stage that is a number",
        lambda: Recipe.model_validate(recipe(gates=[3])),
        ("recipe.gates[0]", "expected a plugin name or a mapping", "int"),
        RecipeError,
    ),
    C(
        "a recipe that is a list",
        lambda: Recipe.from_yaml("- ppo_clip\n- token\n"),
        ("recipe", "expected a mapping", "list"),
        RecipeError,
    ),
    C(
        "invalid YAML",
        lambda: Recipe.from_yaml("gates: [ppo_clip\nreduction: token\n"),
        ("recipe", "not valid YAML"),
        RecipeError,
    ),
    C("invalid JSON", lambda: Recipe.from_json('{"gates": ["ppo_clip"], '), ("recipe", "not valid JSON"), RecipeError),
    C(
        "a recipe file that does not exist",
        lambda: Recipe.from_file("/nonexistent/recipe.yaml"),
        ("no such file", "/nonexistent/recipe.yaml"),
        RecipeError,
    ),
    C("a recipe that is a number", lambda: policy_loss(batch(), 42), ("cannot load a recipe from int",), RecipeError),
    C(
        "a recipe name that is not a string",
        lambda: Recipe.model_validate(recipe(name=5)),
        ("recipe", "name", "5"),
        RecipeError,
    ),
    C(
        "stage params that are a list",
        lambda: Recipe.model_validate(recipe(gates=[{"name": "ppo_clip", "params": [1, 2]}])),
        ("recipe.gates[0]", "params"),
        RecipeError,
    ),
    C(
        "stage params that are a string",
        lambda: Recipe.model_validate(recipe(gates=[{"name": "ppo_clip", "params": "eps_low=0.1"}])),
        ("recipe.gates[0]", "params"),
        RecipeError,
    ),
    C("gates that are a number", lambda: Recipe.model_validate(recipe(gates=5)), ("recipe.gates", "int"), RecipeError),
    C("a preset name that is a number", lambda: Recipe.model_validate({"preset": 5}), ("preset", "5"), RecipeError),
    # -- plugins ----------------------------------------------------------------------------------------------------
    C(
        "a plugin name registered twice",
        _duplicates,
        (
            "gate 'lpx_twice' is registered more than once",
            "in-process plugin 'first-package'",
            "in-process plugin 'second-package'",
        ),
        PluginError,
    ),
    C(
        "a gate that raises",
        with_plugin(
            _Registers(_raising_gate), "buggy-gates", lambda: policy_loss(batch(), recipe(gates=["lpx_raising_gate"]))
        ),
        (
            "recipe.gates[0] (lpx_raising_gate",
            "in-process plugin 'buggy-gates'",
            "raised ZeroDivisionError",
            "division by zero in my gate",
        ),
        PluginError,
    ),
    C(
        "a gate with a per-response objective",
        with_plugin(
            _Registers(_shapeless_gate),
            "buggy-gates",
            lambda: policy_loss(batch(), recipe(gates=["lpx_shapeless_gate"])),
        ),
        ("recipe.gates[0] (lpx_shapeless_gate", "objective", "shape [2, 3]", "got shape [2]"),
        PluginError,
    ),
    C(
        "an update gate without an objective",
        with_plugin(
            _Registers(_no_objective_gate),
            "buggy-gates",
            lambda: policy_loss(batch(), recipe(gates=["lpx_no_objective_gate"])),
        ),
        ("recipe.gates[0] (lpx_no_objective_gate", "objective", "None"),
        PluginError,
    ),
    C(
        "a correction with a misshapen weight",
        with_plugin(
            _Registers(_bad_weight),
            "buggy-gates",
            lambda: policy_loss(batch(), recipe(gates=["ppo_clip", "lpx_bad_weight"])),
        ),
        ("recipe.gates[1] (lpx_bad_weight", "weight", "[3]", "[2] or [2, 3]"),
        PluginError,
    ),
    C(
        "an advantage estimator that raises",
        with_plugin(
            _Registers(_raising_adv),
            "buggy-adv",
            lambda: compute_advantages(batch(), recipe(advantage="lpx_raising_adv")),
        ),
        ("recipe.advantage (lpx_raising_adv", "in-process plugin 'buggy-adv'", "raised IndexError", "index 7"),
        PluginError,
    ),
    C(
        "an advantage estimator that returns a list",
        with_plugin(
            _Registers(_list_adv), "buggy-adv", lambda: compute_advantages(batch(), recipe(advantage="lpx_list_adv"))
        ),
        ("recipe.advantage (lpx_list_adv", "in-process plugin 'buggy-adv'"),
        PluginError,
    ),
    C(
        "a regularizer that raises",
        with_plugin(
            _Registers(_raising_regularizer),
            "buggy-reg",
            lambda: policy_loss(batch(), recipe(regularizers=[{"name": "lpx_raising_regularizer", "coef": 0.1}])),
        ),
        (
            "recipe.regularizers[0] (lpx_raising_regularizer",
            "in-process plugin 'buggy-reg'",
            "raised ZeroDivisionError",
            "division by zero in my regularizer",
        ),
        PluginError,
    ),
    C(
        "a regularizer with a per-response term",
        with_plugin(
            _Registers(_shapeless_regularizer),
            "buggy-reg",
            lambda: policy_loss(batch(), recipe(regularizers=["lpx_shapeless_regularizer"])),
        ),
        ("recipe.regularizers[0] (lpx_shapeless_regularizer", "term", "shape [2, 3]", "got shape [2]"),
        PluginError,
    ),
    C(
        "a regularizer that returns a list",
        with_plugin(
            _Registers(_list_regularizer),
            "buggy-reg",
            lambda: policy_loss(batch(), recipe(regularizers=["lpx_list_regularizer"])),
        ),
        ("recipe.regularizers[0] (lpx_list_regularizer", "RegularizerOutput or a [B, T] tensor", "got list"),
        PluginError,
    ),
    C(
        "a regularizer whose term is NaN on the actions",
        with_plugin(
            _Registers(_nan_regularizer),
            "buggy-reg",
            lambda: policy_loss(batch(), recipe(regularizers=["lpx_nan_regularizer"])),
        ),
        ("recipe.regularizers[0] (lpx_nan_regularizer", "not finite on action positions", "(row 0, pos 0)"),
        PluginError,
    ),
    C(
        "regularizer parameters that are not RegularizerParams",
        lambda: lossplug.regularizer("lpx_plain_params", params=lossplug.Params),
        ("regularizer 'lpx_plain_params'", "must subclass lossplug.RegularizerParams"),
    ),
    C(
        "a reduction that raises",
        with_plugin(
            _Registers(_raising_reduction),
            "buggy-red",
            lambda: policy_loss(batch(), recipe(reduction="lpx_raising_reduction")),
        ),
        (
            "recipe.reduction (lpx_raising_reduction",
            "in-process plugin 'buggy-red'",
            "raised RuntimeError",
            "mat1 and mat2",
        ),
        PluginError,
    ),
    C(
        "a batch validator that raises",
        with_plugin(_RaisingValidator(), "strict-checks", lambda: policy_loss(batch(), "dapo")),
        ("plugin 'strict-checks'", "lossplug_validate_batch", "raised KeyError", "group_size"),
        PluginError,
    ),
    C(
        "a batch validator that returns strings",
        with_plugin(_BadViolations(), "strict-checks", lambda: policy_loss(batch(), "dapo")),
        ("plugin 'strict-checks'", "lossplug_validate_batch", "Violation", "str"),
        PluginError,
    ),
    C(
        "a batch validator that is a hook wrapper",
        with_plugin(_WrappingValidator(), "wrapping-checks", lambda: policy_loss(batch(), "dapo")),
        ("in-process plugin 'wrapping-checks'", "lossplug_validate_batch", "hook wrappers"),
        PluginError,
    ),
    C(
        "a metrics hook that raises",
        with_plugin(_RaisingMetrics(), "fancy-metrics", lambda: policy_loss(batch(), "dapo")),
        ("plugin 'fancy-metrics'", "lossplug_extra_metrics", "raised _Boom", "metric backend unavailable"),
        PluginError,
    ),
    C(
        "a metrics hook that returns a list",
        with_plugin(_ListMetrics(), "fancy-metrics", lambda: policy_loss(batch(), "dapo")),
        ("plugin 'fancy-metrics'", "lossplug_extra_metrics", "dict", "list"),
        PluginError,
    ),
]


def _param(case: Case):
    marks = [pytest.mark.xfail(strict=True, reason=f"known bug: {case.known_bug}")] if case.known_bug else []
    return pytest.param(case, id=case.name.replace(" ", "_"), marks=marks)


def test_the_catalogue_is_large_and_named_uniquely():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
    assert len([c for c in CASES if not c.known_bug]) >= 40


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input_is_a_clear_lossplug_error(case: Case, contract_flag_path):
    """Each case twice: the contract's value rules resolved on the host and as flag tensors (conftest)."""
    with pytest.raises(Exception) as info:  # not BaseException: a case's importorskip still skips
        case.build()
    err = info.value
    assert isinstance(err, LossplugError), f"{case.name}: raw {type(err).__module__}.{type(err).__name__}: {err}"
    assert isinstance(err, case.error), f"{case.name}: expected {case.error.__name__}, got {type(err).__name__}"
    assert not isinstance(err, RAW)
    message = str(err)
    missing = [f for f in case.fragments if f not in message]
    assert not missing, f"{case.name}: message lacks {missing}:\n{message}"


def test_a_plugin_bug_keeps_the_original_exception_as_its_cause():
    # the author of the broken plugin still gets the full traceback, chained under the clear error
    run = with_plugin(
        _Registers(_raising_gate), "buggy-gates", lambda: policy_loss(batch(), recipe(gates=["lpx_raising_gate"]))
    )
    with pytest.raises(PluginError) as info:
        run()
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_lossplug_errors_pass_through_plugins_unchanged():
    # a plugin that refuses input with a LossplugError of its own is not re-wrapped (its message is already clear)
    @lossplug.gate("lpx_refusing_gate")
    def refusing(inp, p):
        """Refuses."""
        raise BatchValidationError("PolicyBatch", [lossplug.Violation("reward", "my rule", "row [0]")])

    run = with_plugin(
        _Registers(refusing), "refusing", lambda: policy_loss(batch(), recipe(gates=["lpx_refusing_gate"]))
    )
    with pytest.raises(BatchValidationError, match="reward: my rule — row \\[0\\]"):
        run()


# ---------------------------------------------------------------------------------------------------------------------
# Batch files: safetensors or JSON only, never pickle


def _batch_loader():
    """``lossplug validate``'s batch-file loader."""
    from lossplug.cli.batch_files import load_batch_file

    return load_batch_file


class _Payload:
    """Unpickling this writes a file: proof that something was unpickled."""

    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return (_touch, (str(self.sentinel),))


def _touch(path):
    with open(path, "w") as fh:
        fh.write("unpickled!")
    return {"logp": torch.zeros(1, 1)}


def _bad_batch_files(tmp_path):
    pytest.importorskip("safetensors")  # writes the good file the others are made from
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in fields().items()}
    good = tmp_path / "batch.safetensors"
    save_file(tensors, str(good))
    sentinel = tmp_path / "UNPICKLED"
    files = {}

    def put(name, data):
        files[name] = tmp_path / name
        files[name].write_bytes(data)

    put("truncated.safetensors", good.read_bytes()[:-7])
    put("header-only.safetensors", good.read_bytes()[:40])
    put("empty.safetensors", b"")
    put("garbage.safetensors", b"\x00\x01 this is not a safetensors file at all")
    put("batch.pkl", pickle.dumps(tensors))
    torch.save(tensors, tmp_path / "batch.pt")
    files["batch.pt"] = tmp_path / "batch.pt"
    put("disguised-pt.safetensors", files["batch.pt"].read_bytes())  # torch.save's zip under another name
    for protocol in (0, 2, 5):  # a malicious pickle under innocent names
        payload = pickle.dumps(_Payload(sentinel), protocol=protocol)
        put(f"payload-p{protocol}.safetensors", payload)
        put(f"payload-p{protocol}", payload)
        put(f"payload-p{protocol}.json", payload)
    put("truncated.json", b'{"logp": [[-1.0, -1.0, -1.0], [-1.0, -1.0')
    put("ragged.json", b'{"logp": [[-1.0, -1.0], [-1.0]], "action_mask": [[true, true], [true]]}')
    put("list.json", b"[1, 2, 3]")
    return good, files, sentinel


def test_batch_files_that_are_pickles_truncated_or_not_safetensors_are_refused(tmp_path):
    load = _batch_loader()
    good, files, sentinel = _bad_batch_files(tmp_path)
    control = tmp_path / "CONTROL"
    pickle.loads(pickle.dumps(_Payload(control)))
    assert control.exists()  # the payload does run when unpickled
    assert PolicyBatch(**load(good)).batch_size == B
    for name, path in files.items():
        with pytest.raises(Exception) as info:
            load(path)
        assert isinstance(info.value, LossplugError), f"{name}: raw {type(info.value).__name__}: {info.value}"
        assert not isinstance(info.value, RAW)
        assert name in str(info.value), f"{name}: the message does not name the file: {info.value}"
    assert not sentinel.exists(), "a batch file was unpickled"


def test_the_validate_command_refuses_pickles_and_never_unpickles(tmp_path):
    _batch_loader()
    from typer.testing import CliRunner

    from lossplug.cli import app

    good, files, sentinel = _bad_batch_files(tmp_path)
    runner = CliRunner()
    assert runner.invoke(app, ["validate", str(good)]).exit_code == 0
    for name in (
        "batch.pkl",
        "batch.pt",
        "disguised-pt.safetensors",
        "payload-p2.safetensors",
        "payload-p0",
        "truncated.safetensors",
    ):
        result = runner.invoke(app, ["validate", str(files[name])])
        assert result.exit_code == 2, (name, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit), (name, result.exception)
    assert not sentinel.exists()


# ---------------------------------------------------------------------------------------------------------------------
# Fuzz: random shapes, dtypes and values never escape as anything but a LossplugError

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SPECIAL = [NAN, INF, -INF, 5.0, 1e6, -1e6]
ALIENS: list[Any] = [3, [1.0, 2.0], "logp"]
try:  # NumPy is no dependency of lossplug: a core-only install draws the other aliens
    import numpy as np

    ALIENS.append(np.zeros(2))
except ImportError:
    pass

SHAPES = {
    "logp": "BT",
    "action_mask": "BT",
    "old_logp": "BT",
    "behavior_logp": "BT",
    "ref_logp": "BT",
    "value": "BT",
    "advantage": "B",
    "reward": "B",
    "group_id": "B",
    "trajectory_id": "B",
    "terminated": "B",
    "final_value": "B",
    "entropy": "BT",
    "sum_pi_squared": "BT",
    "reward_baseline": "B",
    "reward_components": "BK",
}


def _floats(draw, shape, lo, hi):
    n = math.prod(shape)
    return torch.tensor(
        draw(st.lists(st.floats(lo, hi, allow_nan=False), min_size=n, max_size=n)), dtype=torch.float64
    ).reshape(shape)


@st.composite
def random_tensor(draw, shape=None):
    """Any shape, any dtype, any value."""
    if shape is None:
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    n = math.prod(shape)
    t = torch.tensor(
        draw(st.lists(st.sampled_from([0.0, -1.0, 2.5, *SPECIAL]), min_size=n, max_size=n)), dtype=torch.float64
    ).reshape(shape)
    if dtype == torch.bool:
        return t > 0
    if not dtype.is_floating_point and not dtype.is_complex:
        return torch.nan_to_num(t, nan=0.0, posinf=7, neginf=-7).abs().clamp(max=100).to(dtype)
    return t.to(dtype)


def _mutate(draw, out: dict, shapes: dict[str, str], dims: dict[str, tuple]) -> None:
    """One random corruption: a dtype, a shape, a special value at a random position, an empty row, a missing or
    alien field."""
    name = draw(st.sampled_from(sorted(shapes)))
    kind = draw(st.sampled_from(["dtype", "shape", "value", "value", "empty_row", "drop", "alien"]))
    t = out.get(name)
    if kind == "drop":
        out.pop(name, None)
    elif kind == "alien":
        out[name] = draw(st.sampled_from(ALIENS))
    elif kind == "shape":
        out[name] = draw(random_tensor())
    elif kind == "dtype":
        out[name] = draw(random_tensor(dims[shapes[name]]))
    elif isinstance(t, torch.Tensor) and t.numel() and kind == "value":
        flat = t.clone().reshape(-1)
        i = draw(st.integers(0, flat.numel() - 1))
        flat[i] = (
            draw(st.sampled_from(SPECIAL))
            if t.is_floating_point()
            else (not bool(flat[i]) if t.dtype == torch.bool else -1)
        )
        out[name] = flat.reshape(t.shape)
    elif isinstance(t, torch.Tensor) and t.ndim == 2 and t.dtype == torch.bool and kind == "empty_row":
        t = t.clone()
        t[draw(st.integers(0, t.shape[0] - 1))] = False
        out[name] = t


@st.composite
def policy_batches(draw):
    """A valid PolicyBatch's fields (random dtype, sizes, optional fields), then 0-3 random corruptions."""
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(FLOATS))
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))).reshape(b, t)
    mask[torch.arange(b), torch.tensor(draw(st.lists(st.integers(0, t - 1), min_size=b, max_size=b)))] = True
    out = {"logp": _floats(draw, (b, t), -8, 0).to(dtype), "action_mask": mask}
    for name in ("old_logp", "behavior_logp", "ref_logp"):
        if draw(st.integers(0, 3)):
            out[name] = _floats(draw, (b, t), -8, 0).to(dtype)
    if draw(st.booleans()):
        out["value"] = _floats(draw, (b, t), -100, 100)
    if draw(st.integers(0, 3)):
        out["advantage"] = _floats(draw, draw(st.sampled_from([(b,), (b, t)])), -100, 100)
    if draw(st.booleans()):
        out["reward"] = _floats(draw, draw(st.sampled_from([(b,), (b, t)])), -100, 100)
    if draw(st.booleans()):
        out["group_id"] = torch.tensor(draw(st.lists(st.integers(0, 2), min_size=b, max_size=b)))
    if draw(st.booleans()):
        out["trajectory_id"] = torch.arange(b)
    if draw(st.booleans()):
        out["terminated"] = torch.tensor(draw(st.lists(st.booleans(), min_size=b, max_size=b)))
        if draw(st.booleans()):
            out["final_value"] = _floats(draw, (b,), -100, 100)
    # the newer plugins' fields: entropy ≥ 0, sum_pi_squared consistent with old_logp (p² + s·(1 − p)², p the
    # sampled token's probability), a greedy-reward baseline, reward components
    if draw(st.booleans()):
        out["entropy"] = _floats(draw, (b, t), 0, 12).to(dtype)
    if draw(st.booleans()):
        p = torch.exp(out.get("old_logp", out["logp"]).to(torch.float64))
        out["sum_pi_squared"] = (p.square() + _floats(draw, (b, t), 0, 1) * (1 - p).square()).clamp(0, 1).to(dtype)
    if draw(st.booleans()):
        out["reward_baseline"] = _floats(draw, (b,), -100, 100)
    if draw(st.booleans()):
        out["reward_components"] = _floats(draw, (b, draw(st.integers(1, 3))), -100, 100)
    for _ in range(draw(st.integers(0, 3))):
        _mutate(draw, out, SHAPES, {"BT": (b, t), "B": (b,), "BK": (b, 2)})
    return out


@st.composite
def packed_batches(draw):
    """Valid packed transitions (random fragments), then 0-3 random corruptions."""
    n = draw(st.integers(1, 6))
    boundary = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    boundary[-1] = True
    terminated = boundary & torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    out = {
        "reward": _floats(draw, (n,), -100, 100),
        "value": _floats(draw, (n,), -100, 100),
        "next_value": torch.where(terminated, NAN, _floats(draw, (n,), -100, 100)),
        "terminated": terminated,
        "boundary": boundary,
    }
    if draw(st.booleans()):
        out["trajectory_id"] = torch.cat([torch.zeros(1, dtype=torch.long), boundary[:-1].long()]).cumsum(0)
    shapes = {k: "N" for k in ("reward", "value", "next_value", "terminated", "boundary", "trajectory_id")}
    for _ in range(draw(st.integers(0, 3))):
        _mutate(draw, out, shapes, {"N": (n,)})
    return out


def _expect_clean(action: Callable[[], Any]) -> Any:
    try:
        return action()
    except LossplugError:
        return None
    except Exception as err:
        pytest.fail(f"unexpected {type(err).__module__}.{type(err).__name__}: {err}")


FUZZ_RECIPES = [
    Recipe.model_validate({"gates": ["reinforce"], "reduction": "token"}),
    Recipe.model_validate({"gates": ["ppo_clip"], "reduction": "response"}),
    Recipe.model_validate({"advantage": "grpo", "gates": ["ppo_clip", "tis"], "reduction": "sequence_sum"}),
    Recipe.model_validate(
        {
            "gates": ["ppo_clip", {"name": "top_entropy", "quantile": 0.2}],
            "reduction": "token",
            "regularizers": [{"name": "kl", "coef": 0.1, "estimator": "k3"}, {"name": "entropy", "coef": 0.01}],
        }
    ),
    Recipe.model_validate({"advantage": "gdpo", "gates": ["ppo_clip"], "reduction": "token"}),
    Recipe.model_validate({"advantage": "remax", "gates": ["reinforce"], "reduction": "response"}),
    Recipe.model_validate({"advantage": "optimal_token_baseline", "gates": ["ppo_clip"], "reduction": "token"}),
]


@given(policy_batches(), st.sampled_from(FUZZ_RECIPES))
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
def test_fuzz_policy_batch_validation_never_escapes(raw, recipe_):
    built = _expect_clean(lambda: PolicyBatch(**raw))
    # the hot path checks the types at once and defers the rules: refused identically (or accepted)
    unchecked = _expect_clean(lambda: PolicyBatch.unchecked(**{k: v for k, v in raw.items() if v is not None}))
    result = None if unchecked is None else _expect_clean(lambda: policy_loss(unchecked, recipe_))
    event(f"contract {'accepted' if built is not None else 'refused'}, loss {'computed' if result else 'refused'}")
    if built is None:
        assert result is None, "policy_loss accepted a batch the contract refuses"
        return
    if recipe_.advantage is not None:
        advantages = _expect_clean(lambda: compute_advantages(built, recipe_))
        if advantages is not None:
            on_actions = advantages if advantages.ndim == 1 else advantages[built.action_mask]
            assert torch.isfinite(on_actions).all(), f"non-finite advantages {advantages}"
    if result is not None:
        assert torch.isfinite(result.loss.float()).all(), f"non-finite loss {result.loss} for a valid batch"


@given(packed_batches())
def test_fuzz_packed_validation_never_escapes(raw):
    built = _expect_clean(lambda: PackedTransitions(**raw))
    event(f"contract {'accepted' if built is not None else 'refused'}")
    if built is not None:
        adv = _expect_clean(lambda: compute_advantages(built, "ppo"))
        if adv is not None:
            assert torch.isfinite(adv).all()


@given(
    st.dictionaries(
        st.sampled_from(["advantage", "gates", "reduction", "name", "preset", "gate", "params"]),
        st.one_of(
            st.none(),
            st.integers(-2, 2),
            st.floats(allow_nan=True),
            st.text(max_size=6),
            st.sampled_from(["ppo_clip", "tis", "token", "fixed", "grpo", "dapo"]),
            st.lists(st.sampled_from(["ppo_clip", "tis", "icepop", 3, None]), max_size=3),
            st.dictionaries(
                st.sampled_from(["name", "eps_low", "budget", "params"]),
                st.one_of(st.floats(), st.text(max_size=4), st.integers()),
                max_size=3,
            ),
        ),
        max_size=4,
    )
)
def test_fuzz_recipe_validation_never_escapes(raw):
    try:
        Recipe.model_validate(raw)
    except LossplugError:
        pass


def test_the_validate_command_names_the_newer_plugins_missing_and_bad_fields(tmp_path):
    # a recipe reading entropy (top_entropy gate, entropy bonus), reward_components (gdpo) and sum_pi_squared: a
    # dump without them is refused naming each field and the stage that needs it; one with them passes; one whose
    # sum_pi_squared is out of [0, 1] is refused naming the rule and position
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file
    from typer.testing import CliRunner

    from lossplug.cli import app

    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(
        "advantage: gdpo\n"
        "gates: [ppo_clip, {name: top_entropy, quantile: 0.2}]\n"
        "reduction: token\n"
        "regularizers: [{name: entropy, coef: 0.01}]\n"
    )
    base = {
        "logp": torch.full((4, T), -1.0),
        "old_logp": torch.full((4, T), -1.1),
        "action_mask": torch.ones(4, T, dtype=torch.bool),
        "advantage": torch.tensor([1.0, -1.0, 0.5, -0.5]),
        "reward": torch.tensor([1.0, 0.0, 2.0, 1.0]),
        "group_id": torch.tensor([0, 0, 1, 1]),
    }
    complete = {
        **base,
        "entropy": torch.full((4, T), 0.7),
        "reward_components": torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.5, 0.5]]),
    }
    bad = {
        **complete,
        "sum_pi_squared": torch.full((4, T), 0.4).index_put_((torch.tensor([2]), torch.tensor([1])), torch.tensor(1.5)),
    }
    runner = CliRunner()
    for name, tensors, code, fragments in (
        ("missing", base, 1, ("entropy", "top_entropy", "regularizers[0]", "reward_components", "gdpo")),
        ("complete", complete, 0, ()),
        ("bad", bad, 1, ("sum_pi_squared", "must be in [0, 1]", "row 2, pos 1")),
    ):
        path = tmp_path / f"{name}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        result = runner.invoke(app, ["validate", str(path), "--recipe", str(recipe_file)])
        assert result.exit_code == code, (name, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit), (name, result.exception)
        missing = [f for f in fragments if f not in result.output]
        assert not missing, f"{name}: output lacks {missing}:\n{result.output}"
