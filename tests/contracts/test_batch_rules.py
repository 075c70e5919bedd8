"""The rule tables: every field has a layout, and the quick path and the report are two readings of the same rules —
on any batch the quick test passes exactly when the report records nothing."""

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from lossplug import BatchValidationError, PackedTransitions, PolicyBatch
from lossplug.contracts.batch_rules import OFF_ACTION_REWARD, rewards_off_actions
from lossplug.contracts.checks import Checks
from lossplug.contracts.memo import forget_checked

NAN, INF = float("nan"), float("inf")


POLICY_BATCH_RULES = PolicyBatch.RULES
PACKED_RULES = PackedTransitions.RULES


def test_every_field_is_declared_once_with_its_layout_in_declaration_order():
    for contract in (PolicyBatch, PackedTransitions):
        assert tuple(contract.model_fields) == contract.FIELD_NAMES == tuple(contract.SPECS)
    # the shape rule of every PolicyBatch field but logp reads its declaration
    assert {spec.shape for spec in PolicyBatch.SPECS.values()} == {"token", "row", "row_or_token", "columns"}
    assert {spec.shape for spec in PackedTransitions.SPECS.values()} == {"transition"}


def _corrupt(rng: random.Random, t: torch.Tensor) -> torch.Tensor:
    """``t`` with one element set to a value some rule refuses (or that is harmless where it lands)."""
    t = t.clone()
    if t.numel():
        if t.dtype == torch.bool:
            t.view(-1)[rng.randrange(t.numel())] = rng.random() < 0.5
        elif t.is_floating_point():
            t.view(-1)[rng.randrange(t.numel())] = rng.choice([NAN, INF, -INF, 0.5, 1.5, -0.5])
        else:
            t.view(-1)[rng.randrange(t.numel())] = rng.choice([-1, 9])
    return t


def _policy_fields(rng: random.Random) -> dict[str, torch.Tensor]:
    B, T = rng.choice([(1, 1), (3, 4), (4, 7)])
    mask = torch.rand(B, T) < 0.7
    mask[:, 0] = True
    fields = {"logp": -torch.rand(B, T), "action_mask": mask}
    for name, spec in PolicyBatch.SPECS.items():
        per_token, per_row, kind = spec.per_token, spec.per_row, spec.kind
        if name in ("logp", "action_mask") or rng.random() < 0.6:
            continue
        shape = (B, T) if per_token and not (per_row and rng.random() < 0.5) else (B,) if per_row else (B, 3)
        if kind == "bool":
            fields[name] = torch.rand(shape) < 0.5
        elif kind == "int":
            fields[name] = torch.randint(0, 3, shape)
        else:
            fields[name] = torch.rand(shape) * (-1 if name.endswith("logp") else 1)
    if fields.get("reward") is not None and fields["reward"].ndim == 2:  # token rewards: 0 off the actions
        fields["reward"] = torch.where(mask, fields["reward"], 0)
    if "behavior_version" in fields and "policy_version" in fields:
        fields["policy_version"] = torch.full_like(fields["policy_version"], 2)
    for name in rng.sample(sorted(fields), k=rng.choice([0, 0, 1, 2])):
        fields[name] = _corrupt(rng, fields[name])
    return fields


def _packed_fields(rng: random.Random) -> dict[str, torch.Tensor]:
    N = rng.choice([1, 2, 5])
    boundary = torch.rand(N) < 0.5
    boundary[-1] = True
    fields = {
        "reward": torch.randn(N),
        "value": torch.randn(N),
        "next_value": torch.randn(N),
        "terminated": boundary & (torch.rand(N) < 0.5),
        "boundary": boundary,
    }
    if rng.random() < 0.5:
        fields["trajectory_id"] = torch.cumsum(boundary.long(), 0) - boundary.long()
    for name in rng.sample(sorted(fields), k=rng.choice([0, 1, 2])):
        fields[name] = _corrupt(rng, fields[name])
    return fields


@pytest.mark.parametrize(
    "contract, table, make",
    [(PolicyBatch, POLICY_BATCH_RULES, _policy_fields), (PackedTransitions, PACKED_RULES, _packed_fields)],
)
def test_the_quick_path_passes_exactly_when_the_report_is_empty(contract, table, make):
    rng = random.Random(0)
    outcomes = set()
    for _ in range(300):
        fields = contract.unchecked(**make(rng)).__dict__
        forget_checked()
        quick = table.passes(fields)
        forget_checked()
        checks = Checks(contract.__name__)
        table.report(checks, fields)
        try:
            checks.raise_if_any()
            reported = False
        except BatchValidationError:
            reported = True
        assert quick != reported, {k: v for k, v in fields.items() if v is not None}
        outcomes.add(quick)
    assert outcomes == {True, False}  # both kinds of batch were drawn
    forget_checked()


# ---------------------------------------------------------------------------------------------------------------------
# Token rewards are 0 off the actions


@given(
    shape=st.tuples(st.integers(1, 5), st.integers(1, 6)),
    seed=st.integers(0, 2**16),
    value=st.sampled_from([0.5, -1.0, 1e-30, NAN, INF]),
    place=st.booleans(),
)
def test_a_token_reward_off_the_actions_is_one_violation_naming_the_first_position_and_value(shape, seed, value, place):
    g = torch.Generator().manual_seed(seed)
    B, T = shape
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[:, -1] = True
    reward = torch.where(mask, torch.rand(B, T, generator=g), 0)
    off = (~mask).nonzero().tolist()
    if place and off:
        row, column = off[torch.randint(len(off), (1,), generator=g).item()]
        reward[row, column] = value
    fields = PolicyBatch.unchecked(logp=-torch.rand(B, T, generator=g), action_mask=mask, reward=reward).__dict__
    checks = Checks("PolicyBatch")
    POLICY_BATCH_RULES.report(checks, fields)
    reported = []
    try:
        checks.raise_if_any()
    except BatchValidationError as err:
        reported = err.violations
    if not (place and off):
        assert POLICY_BATCH_RULES.passes(fields) and reported == [] and rewards_off_actions(reward, mask) is None
        return
    assert not POLICY_BATCH_RULES.passes(fields)
    (violation,) = reported
    assert (violation.field, violation.rule) == ("reward", OFF_ACTION_REWARD)
    assert violation.where == f"(row {row}, pos {column}); the first is {value:g}"
    assert violation == rewards_off_actions(reward, mask)


class _RecordedCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


def test_the_token_reward_rule_reads_nothing_when_rewards_are_per_response():
    (rule,) = [r for stage in POLICY_BATCH_RULES.stages for r in stage if "_rewards_on_actions_only" in repr(r.passes)]
    mask = torch.ones(3, 4, dtype=torch.bool)
    fields = PolicyBatch.unchecked(logp=-torch.rand(3, 4), action_mask=mask, reward=torch.rand(3)).__dict__
    with _RecordedCalls() as recorded:
        assert rule.passes(fields)
        checks = Checks("PolicyBatch")
        rule.report(checks, fields)
    assert checks.violations == [] and checks._pending == []
    # only attribute reads (reward.ndim): no kernel, no comparison, no reduction
    assert all(getattr(func, "__name__", "") == "__get__" for func in recorded.calls), recorded.calls
