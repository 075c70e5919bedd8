"""The batch contracts: :class:`PolicyBatch` (padded ``[B, T]``) and :class:`PackedTransitions` (packed 1-D).

Both are frozen dataclasses of torch tensors. Constructing one checks that every keyword is a field and every value
a dense tensor (or None), then runs the contract — the class's rule table (:mod:`lossplug.contracts.batch_rules`)
— in one O(N) pass of vectorised checks with a single host synchronisation; every violated rule is reported at
once, each naming the field, the rule and the offending rows/positions. ``PolicyBatch.unchecked(...)`` builds one
without checks for the hot path; ``check()`` runs the contract later.

They are dataclasses rather than pydantic models because a contract is built once per micro-batch in a trainer's
hot loop: pydantic's validation would only repeat the tensor-or-None test at several µs more per batch (far more
with the caches cold from the loss step), and bypassing it meant writing pydantic's internals.

Masked (non-action) positions may hold anything, NaN and inf included: nothing downstream reads them — except a
token-level reward, which must be 0 there (see :mod:`lossplug.contracts.batch_rules`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from .batch_rules import (
    ENTROPY_TOLERANCE,
    LOGP_TOLERANCE,
    LOGPROBS,
    PACKED_RULES,
    POLICY_BATCH_RULES,
    PROBABILITY_TOLERANCE,
    TOKEN_FLOATS,
)
from .checks import Checks
from .errors import BatchValidationError, Violation, did_you_mean
from .memo import forget_checked
from .rules import RuleTable

__all__ = [
    "ENTROPY_TOLERANCE",
    "LOGP_TOLERANCE",
    "PROBABILITY_TOLERANCE",
    "PackedTransitions",
    "PolicyBatch",
    "forget_checked",
]

Tensor = torch.Tensor

_M = TypeVar("_M", bound="_TensorModel")


class _TensorModel:
    """Shared machinery of the batch contracts (frozen dataclasses of tensors): keyword-only construction that
    checks, typo-aware unknown-field errors, unchecked construction; each contract's rules are its ``RULES`` table."""

    RULES: ClassVar[RuleTable]
    #: per contract (set by :func:`_declare`): its field names in declaration order, the required ones, the defaults
    FIELD_NAMES: ClassVar[tuple[str, ...]] = ()
    _NAMES: ClassVar[frozenset[str]] = frozenset()
    _REQUIRED: ClassVar[tuple[str, ...]] = ()
    _DEFAULTS: ClassVar[dict[str, None]] = {}

    def __init__(self, *args: object, **data: Any) -> None:
        cls = type(self)
        if args or not cls._plain_tensors(data):
            cls._refuse(args, data)
        self.__dict__.update(cls._DEFAULTS)  # (frozen: the fields are set past __setattr__, as dataclasses do)
        self.__dict__.update(data)
        self.check(types_checked=True)

    @classmethod
    def _plain_tensors(cls, data: dict[str, Any]) -> bool:
        """Every key a field, every value a dense tensor or None, every required field given: the common case, tested
        without building a report (:meth:`_refuse` names what is wrong otherwise)."""
        defaults = cls._DEFAULTS
        strided = torch.strided
        for key, value in data.items():
            if value is None:
                if key not in defaults:  # an unknown field, or a required one given as None
                    return False
            elif not isinstance(value, torch.Tensor) or value.layout != strided or key not in cls._NAMES:
                return False
        return all(data.get(key) is not None for key in cls._REQUIRED)

    @classmethod
    def _refuse(cls, args: tuple[object, ...], data: dict[str, Any]) -> None:
        """Raise :class:`BatchValidationError` naming every keyword that is not a field, every value that is not a
        dense tensor and every missing required field."""
        if args:
            raise BatchValidationError(
                cls.__name__, [Violation("<batch>", f"expected keyword fields, got {type(args[0]).__name__}")]
            )
        checks = Checks(cls.__name__)
        names = cls.FIELD_NAMES
        for key in data:
            if key not in names:
                checks.fail(key, "unknown field" + did_you_mean(key, names), f"fields are: {', '.join(names)}")
        cls._field_types({k: v for k, v in data.items() if k in names}, checks)
        checks.raise_if_any()

    @classmethod
    def _field_types(cls, values: dict[str, Any], checks: Checks) -> None:
        """Every field a dense tensor (or None), every required field present."""
        for key, value in values.items():
            if value is None:
                continue
            if not isinstance(value, torch.Tensor):
                checks.fail(key, f"must be a torch.Tensor, got {type(value).__name__}")
            elif value.layout != torch.strided:
                checks.fail(key, f"must be a dense tensor, got layout {value.layout} (convert with .to_dense())")
        for key in cls._REQUIRED:
            if values.get(key) is None:
                checks.fail(key, "is required")

    @classmethod
    def unchecked(cls: type[_M], **fields: Tensor | None) -> _M:
        """Build without any validation (hot path). ``policy_loss(validate="full")`` still checks it later. Unknown
        keywords are dropped; a required field not given stays unset (``check()`` names it)."""
        batch = cls.__new__(cls)
        batch.__dict__.update(cls._DEFAULTS)
        batch.__dict__.update((k, v) for k, v in fields.items() if k in cls._NAMES)
        return batch

    @property
    def validated(self) -> bool:
        """Whether the contract ran on this batch and every rule held."""
        return bool(self.__dict__.get("_validated", False))

    def check(self, types_checked: bool = False) -> None:
        """Run every contract rule; raise :class:`BatchValidationError` listing all violations.

        The quick path (:meth:`RuleTable.passes`) runs first — once per micro-batch in a trainer's hot loop, no
        report built — and only if it fails, or does not apply (an accelerator), is the report built."""
        cls = type(self)
        fields = self.__dict__  # the field values, by name
        if not types_checked:  # (an unchecked batch may hold anything) the rules assume tensors
            checks = Checks(cls.__name__)
            cls._field_types({k: fields.get(k) for k in cls.FIELD_NAMES}, checks)
            checks.raise_if_any()
        if not cls.RULES.passes(fields):
            checks = Checks(cls.__name__)
            cls.RULES.report(checks, fields)
            checks.raise_if_any()
        fields["_validated"] = True  # (not a field: the rule table reads fields by name)

    def __repr__(self) -> str:
        values = self.__dict__
        shown = (
            f"{k}=<{'x'.join(map(str, v.shape))} {str(v.dtype).removeprefix('torch.')} {v.device}>"
            if isinstance(v, torch.Tensor)
            else f"{k}={v!r}"
            for k in type(self).FIELD_NAMES
            if (v := values.get(k)) is not None
        )
        return f"{type(self).__name__}({', '.join(shown)})"

    def replace(self: _M, **fields: Tensor | None) -> _M:
        """A copy with some fields replaced, validated again."""
        return type(self)(**{**self.fields(), **fields})

    def fields(self) -> dict[str, Tensor]:
        """The tensors that are set, by field name."""
        values = self.__dict__
        return {k: values[k] for k in type(self).FIELD_NAMES if values.get(k) is not None}


def _declare(cls: type[_M]) -> type[_M]:
    """Record a contract's fields (its dataclass fields, in declaration order) for construction and checks."""
    declared = dataclasses.fields(cls)  # type: ignore[arg-type]
    cls.FIELD_NAMES = tuple(f.name for f in declared)
    cls._NAMES = frozenset(cls.FIELD_NAMES)
    cls._REQUIRED = tuple(f.name for f in declared if f.default is dataclasses.MISSING)
    cls._DEFAULTS = {f.name: None for f in declared if f.default is not dataclasses.MISSING}
    return cls


@_declare
@dataclass(frozen=True, eq=False, init=False, repr=False)
class PolicyBatch(_TensorModel):
    """A padded batch of B responses of up to T tokens.

    Per-token fields are ``[B, T]``; per-sequence fields are ``[B]``. Only ``logp`` and ``action_mask`` are required;
    which other fields a recipe needs is declared by its plugins and checked before any tensor is touched.
    """

    #: current-policy log-probs of the sampled tokens; the only field that carries gradient
    logp: Tensor
    #: True where the position is a policy action (not prompt, observation/tool output or padding)
    action_mask: Tensor
    #: training engine, before this update (numerator of the engine ratio, denominator of the update ratio)
    old_logp: Tensor | None = None
    #: rollout engine (e.g. vLLM) that sampled the tokens
    behavior_logp: Tensor | None = None
    #: frozen reference policy (KL penalties)
    ref_logp: Tensor | None = None
    #: ``[B]`` (sequence) or ``[B, T]`` (token) advantages
    advantage: Tensor | None = None
    #: ``[B]`` sequence score or ``[B, T]`` token rewards
    reward: Tensor | None = None
    #: critic values V_old(s_t) at each position, ``[B, T]``
    value: Tensor | None = None
    #: prompt group of each response, ``[B]`` integer; groups may be scattered and of unequal size
    group_id: Tensor | None = None
    #: trajectory of each response, ``[B]`` integer (several rows may be turns of one trajectory)
    trajectory_id: Tensor | None = None
    #: ``[B]`` bool: the response ended in a terminal state (no bootstrap); False means time-limit truncation
    terminated: Tensor | None = None
    #: ``[B]`` value of the real final observation of truncated responses (read only where ``terminated`` is False)
    final_value: Tensor | None = None
    #: per-token entropy of the current policy's distribution at each position, ``[B, T]`` (≥ 0 on the actions;
    #: TRL's ``_get_per_token_logps_and_entropies``, verl's ``entropy``); detached data for entropy-aware gates
    #: and regularizers
    entropy: Tensor | None = None
    #: ``[B, T]`` Σ_v π_old(v)² over the vocabulary at each position (verl's ``sum_pi_squared``,
    #: ``actor.calculate_sum_pi_squared=True``): in [0, 1] on the actions; the optimal token baselines read it
    sum_pi_squared: Tensor | None = None
    #: ``[B]`` reward of a baseline response to the same prompt (ReMax: the greedy decode's reward)
    reward_baseline: Tensor | None = None
    #: ``[B, K]`` one column per reward function, before any aggregation (TRL's ``normalize_then_sum``, verl's GDPO)
    reward_components: Tensor | None = None
    #: ``[B, T]`` log-probs of the sampled tokens under a teacher policy (on-policy distillation: the per-token
    #: reverse KL ``logp − teacher_logp`` is the signal); a frozen policy of its own, never the reference
    teacher_logp: Tensor | None = None
    #: ``[B, T]`` (per token) or ``[B]`` integer ≥ 0: the version of the policy that generated each token
    #: (asynchronous trainers: AReaL's ``versions``; one sequence may span several versions when generation is
    #: interrupted by a weight update)
    behavior_version: Tensor | None = None
    #: ``[B]`` integer: the version of the policy this update starts from (π_old's version), ≥ every
    #: ``behavior_version`` of its row on the actions
    policy_version: Tensor | None = None
    #: ``[B]`` integer: the environment state a row starts from (multi-turn agents, one row per step): rows of one
    #: prompt group with equal ``anchor_id`` saw the same state (GiGPO's step-level groups); requires ``group_id``
    anchor_id: Tensor | None = None

    TOKEN_FLOATS: ClassVar[tuple[str, ...]] = TOKEN_FLOATS
    LOGPROBS: ClassVar[tuple[str, ...]] = LOGPROBS
    RULES: ClassVar[RuleTable] = POLICY_BATCH_RULES

    @property
    def batch_size(self) -> int:
        return self.logp.shape[0]

    @property
    def action_lengths(self) -> Tensor:
        """Number of action tokens of each response, ``[B]``."""
        return self.action_mask.sum(-1)


@_declare
@dataclass(frozen=True, eq=False, init=False, repr=False)
class PackedTransitions(_TensorModel):
    """The packed layout: N transitions of several trajectories laid end to end, all ``[N]``.

    ``terminated`` decides whether the TD target bootstraps from ``next_value``; ``boundary`` decides whether the
    GAE trace continues into the next transition. A time-limit truncation is ``terminated=False, boundary=True``
    with ``next_value`` the value of the real final observation.
    """

    reward: Tensor
    value: Tensor
    #: V(s_{t+1}); ignored (may be NaN) where ``terminated``
    next_value: Tensor
    terminated: Tensor
    boundary: Tensor
    trajectory_id: Tensor | None = None

    RULES: ClassVar[RuleTable] = PACKED_RULES
