"""The batch contracts: :class:`PolicyBatch` (padded ``[B, T]``) and :class:`PackedTransitions` (packed 1-D).

Both are pydantic models holding torch tensors. Constructing one validates it in one O(N) pass of vectorised
checks with a single host synchronisation; every violated rule is reported at once, each naming the field, the rule
and the offending rows/positions. ``PolicyBatch.unchecked(...)`` builds one without checks for the hot path.

Masked (non-action) positions may hold anything, NaN and inf included: nothing downstream reads them.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, ClassVar, Optional

import torch
from pydantic import BaseModel, ConfigDict, PrivateAttr, model_validator

from . import checks as checks_module
from .checks import Checks, any_of
from .errors import BatchValidationError, Violation, describe_positions, did_you_mean

#: log-probs may exceed 0 by this much (rounding in low-precision log-softmax) before they are rejected.
LOGP_TOLERANCE = 1e-3

Tensor = torch.Tensor


class _CheckedTensors:
    """Tensors whose *every* element passed the value rules, remembered weakly by object and version.

    A training step validates the same constant tensors over and over: every micro-batch of every epoch slices its
    ``old_logp``, advantages, reference log-probs out of the step's batch (TRL's buffered generation batch, verl's
    ``DataProto``). The first check of such a slice checks its whole base tensor once (one pass) and remembers the
    outcome here; later slices of it — still views of the same base at the same version — skip the pass. Only
    ``logp``, new on every forward, is read again. Rules:

    * an entry holds the base's ``_version``: any in-place write (through it or any view of it) bumps the version
      and voids the entry; writes that bypass autograd's version counter (``.data``, numpy or DLPack aliases) are
      not seen — validate such tensors again with :func:`forget_checked`;
    * an entry dies with its tensor (weak reference), so a later tensor at the same address is never mistaken for it;
    * a base that fails the whole-tensor check (garbage off the actions) is remembered too: its slices are then
      checked on their own, on the action positions, without reading the base again;
    * bases much larger than the slice (above ``BASE_READ_LIMIT`` times its size) are not read; the slice is.
    """

    BASE_READ_LIMIT = 256

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, int, bool, bool]] = {}

    def get(self, t: Tensor) -> Optional[tuple[bool, bool]]:
        """``(finite, at_most_tolerance)`` of every element of ``t``, or None if ``t`` was not checked as it is now."""
        entry = self._entries.get(id(t))
        if entry is None or entry[0]() is not t or entry[1] != t._version:
            return None
        return entry[2], entry[3]

    def put(self, t: Tensor, finite: bool, below: bool) -> None:
        key = id(t)
        self._entries[key] = (weakref.ref(t, lambda _, key=key: self._entries.pop(key, None)), t._version, finite,
                              below)

    def clear(self) -> None:
        self._entries.clear()


_CHECKED = _CheckedTensors()


def forget_checked() -> None:
    """Forget every remembered whole-tensor check: the next validation reads every field again."""
    _CHECKED.clear()


def _base_of(t: Tensor) -> Tensor:
    """The tensor whose whole-tensor check covers ``t``: its view base when that is not much larger, else ``t``."""
    base = t._base
    if (base is None or base.dtype != t.dtype or base.device != t.device or base.layout != torch.strided
            or base.numel() > _CheckedTensors.BASE_READ_LIMIT * max(t.numel(), 1)):
        return t
    return base


def _token_value_rules(checks: Checks, name: str, t: Tensor, mask: Tensor, logprob: bool) -> None:
    """``t`` finite on action positions (and, for log-probs, ``<= LOGP_TOLERANCE``), cheaply: one ``aminmax`` pass
    over the whole tensor — or over its base, once per version (see :class:`_CheckedTensors`); NaN propagates into
    both ends. Only if that fails — non-action positions may hold anything — are the action positions selected and
    tested, and only if that fails too are the offending positions computed."""
    if t.numel() == 0:
        return
    whole = _base_of(t)
    known = _CHECKED.get(whole)
    if known is not None and known[0] and (known[1] or not logprob):
        return  # every element of the base passed: so does every slice, whatever its mask

    host = checks_module.on_host(t)  # the reductions' values are on the host already: Python tests, no kernels

    def extremes(x: Tensor):
        if not logprob and x.element_size() >= 4:  # finiteness alone: the sum (any NaN or inf reaches it)
            total = x.sum()
            if host:
                return math.isfinite(total.item()), True
            return torch.isfinite(total), torch.ones((), dtype=torch.bool, device=x.device)
        low, high = torch.aminmax(x)
        if host:
            low, high = low.item(), high.item()  # NaN fails both comparisons
            return low > -math.inf, (high <= LOGP_TOLERANCE) if logprob else (high < math.inf)
        return low > float("-inf"), (high <= LOGP_TOLERANCE) if logprob else (high < float("inf"))

    def find() -> list[Violation]:
        finite, below = extremes(torch.where(mask, t, 0))
        if bool(finite) and bool(below):  # the failing values are all at non-action positions
            return []
        found = []
        bad = mask & ~torch.isfinite(t)
        if bool(bad.any()):
            found.append(Violation(name, "must be finite on action positions", describe_positions(bad, noun="rows")))
        if logprob:
            big = mask & (t > LOGP_TOLERANCE)
            if bool(big.any()):
                found.append(Violation(name, f"log-probs must be <= 0 (tolerance {LOGP_TOLERANCE}) on action "
                                             f"positions", describe_positions(big, noun="rows")))
        return found

    if known is not None:  # the base failed as a whole (garbage off the actions): check this slice on its own
        whole = t
    finite, below = extremes(whole)
    # the outcome is remembered for `whole` once the contract's single host sync has resolved it
    checks.when_flag(not (finite and below) if host else ~(finite & below), find,
                     resolved=lambda failed, whole=whole: _CHECKED.put(whole, not failed, not failed and logprob))


class _TensorModel(BaseModel):
    """Shared machinery: tensor-only fields, typo-aware unknown-field errors, checked/unchecked construction."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True, extra="forbid")
    _validated: bool = PrivateAttr(default=False)

    @model_validator(mode="before")
    @classmethod
    def _tensors_only(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise BatchValidationError(cls.__name__, [Violation("<batch>", f"expected keyword fields, got {type(data).__name__}")])
        checks = Checks(cls.__name__)
        fields = cls.model_fields
        for key in data:
            if key not in fields:
                checks.fail(key, "unknown field" + did_you_mean(key, fields), f"fields are: {', '.join(fields)}")
        cls._field_types({k: v for k, v in data.items() if k in fields}, checks)
        checks.raise_if_any()
        return data

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
        for key, info in cls.model_fields.items():
            if info.is_required() and values.get(key) is None:
                checks.fail(key, "is required")

    @model_validator(mode="after")
    def _run_contract(self):
        self.check(types_checked=True)
        return self

    @classmethod
    def unchecked(cls, **fields: Optional[Tensor]):
        """Build without any validation (hot path). ``policy_loss(validate="full")`` still checks it later."""
        return cls.model_construct(**fields)

    @property
    def validated(self) -> bool:
        return self._validated

    def check(self, types_checked: bool = False) -> None:
        """Run every contract rule; raise :class:`BatchValidationError` listing all violations."""
        checks = Checks(type(self).__name__)
        if not types_checked:  # (an unchecked batch may hold anything) the rules below assume tensors
            self._field_types({k: getattr(self, k, None) for k in type(self).model_fields}, checks)
            checks.raise_if_any()
        self._rules(checks)
        checks.raise_if_any()
        self._validated = True

    def _rules(self, checks: Checks) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def replace(self, **fields: Optional[Tensor]):
        """A copy with some fields replaced, validated again."""
        return type(self)(**{**self.fields(), **fields})

    def fields(self) -> dict[str, Tensor]:
        """The tensors that are set, by field name."""
        return {k: getattr(self, k) for k in type(self).model_fields if getattr(self, k) is not None}


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
    old_logp: Optional[Tensor] = None
    #: rollout engine (e.g. vLLM) that sampled the tokens
    behavior_logp: Optional[Tensor] = None
    #: frozen reference policy (KL penalties)
    ref_logp: Optional[Tensor] = None
    #: ``[B]`` (sequence) or ``[B, T]`` (token) advantages
    advantage: Optional[Tensor] = None
    #: ``[B]`` sequence score or ``[B, T]`` token rewards
    reward: Optional[Tensor] = None
    #: critic values V_old(s_t) at each position, ``[B, T]``
    value: Optional[Tensor] = None
    #: prompt group of each response, ``[B]`` integer; groups may be scattered and of unequal size
    group_id: Optional[Tensor] = None
    #: trajectory of each response, ``[B]`` integer (several rows may be turns of one trajectory)
    trajectory_id: Optional[Tensor] = None
    #: ``[B]`` bool: the response ended in a terminal state (no bootstrap); False means time-limit truncation
    terminated: Optional[Tensor] = None
    #: ``[B]`` value of the real final observation of truncated responses (read only where ``terminated`` is False)
    final_value: Optional[Tensor] = None

    TOKEN_FLOATS: ClassVar[tuple[str, ...]] = ("logp", "old_logp", "behavior_logp", "ref_logp", "value")
    LOGPROBS: ClassVar[tuple[str, ...]] = ("logp", "old_logp", "behavior_logp", "ref_logp")

    @property
    def batch_size(self) -> int:
        return self.logp.shape[0]

    @property
    def action_lengths(self) -> Tensor:
        """Number of action tokens of each response, ``[B]``."""
        return self.action_mask.sum(-1)

    #: every field but logp: the shapes it may have ("BT": [B, T], "B": [B]) and its dtype kind
    _LAYOUT: ClassVar[dict[str, tuple[tuple[str, ...], str]]] = {
        "old_logp": (("BT",), "float"), "behavior_logp": (("BT",), "float"), "ref_logp": (("BT",), "float"),
        "value": (("BT",), "float"), "action_mask": (("BT",), "bool"), "advantage": (("B", "BT"), "float"),
        "reward": (("B", "BT"), "float"), "group_id": (("B",), "int"), "trajectory_id": (("B",), "int"),
        "terminated": (("B",), "bool"), "final_value": (("B",), "float"),
    }

    def _rules(self, checks: Checks) -> None:
        fields = self.__dict__
        logp, mask = fields["logp"], fields["action_mask"]
        if logp.ndim != 2:
            checks.fail("logp", f"must be [B, T], got shape {tuple(logp.shape)}")
            return
        B, T = logp.shape
        if B == 0:
            checks.fail("logp", f"a batch needs at least one response, got shape {list(logp.shape)}")
            return
        ok = checks.dtype("logp", logp, "float")
        shape_ok = True
        sizes = {"BT": (B, T), "B": (B,)}
        device = logp.device
        for name, (shapes, kind) in self._LAYOUT.items():
            t = fields.get(name)
            if t is None:
                continue
            if not any(t.shape == sizes[s] for s in shapes):
                want = " or ".join(str(list(sizes[s])) for s in shapes)
                checks.fail(name, f"shape must align with logp [B={B}, T={T}]: expected {want}, got {list(t.shape)}")
                shape_ok = False
            if not checks.dtype(name, t, kind):
                shape_ok = False
            if t.device != device:
                checks.fail(name, f"must be on logp's device {device}, got {t.device}")
                shape_ok = False
        if not (ok and shape_ok):
            return  # value rules below assume aligned, well-typed tensors

        if T > 0:  # the least number of actions of any row, > 0 (the uint8 view: the CPU vectorises its max)
            def empty_rows() -> list[Violation]:
                return [Violation("action_mask", "every response needs at least one action token",
                                  describe_positions(~any_of(mask, -1), noun="rows"))]
            fewest = mask.view(torch.uint8).amax(-1).amin()
            checks.when_flag(fewest.item() == 0 if checks_module.on_host(mask) else fewest == 0, empty_rows)
        else:
            checks.when_any(~any_of(mask, -1), "action_mask", "every response needs at least one action token")
        seen: set[tuple] = set()
        for name in self.TOKEN_FLOATS + ("advantage", "reward"):
            t = fields.get(name)
            if t is None:
                continue
            if t.ndim == 2:
                logprob = name in self.LOGPROBS
                # a field that is the same elements as one checked under the same rule (TRL's on-policy
                # old_logp = logp.detach()) is not read twice
                key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, logprob)
                if key in seen:
                    continue
                seen.add(key)
                _token_value_rules(checks, name, t, mask, logprob=logprob)
            else:
                checks.when_not_finite(t, name)
        if self.final_value is not None:
            if self.terminated is None:
                checks.fail("final_value", "is only read for truncated responses: give terminated [B] bool with it "
                                           "(False where the response was cut by a time limit)")
            else:
                checks.when_any(~self.terminated & ~torch.isfinite(self.final_value), "final_value",
                                "must be finite for truncated (not terminated) responses")


class PackedTransitions(_TensorModel):
    """The seeds' packed layout: N transitions of several trajectories laid end to end, all ``[N]``.

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
    trajectory_id: Optional[Tensor] = None

    def _rules(self, checks: Checks) -> None:
        reward = self.reward
        if reward.ndim != 1 or reward.numel() == 0:
            checks.fail("reward", f"packed fragments must be non-empty and one-dimensional, got shape {list(reward.shape)}")
            return
        (N,) = reward.shape
        kinds = {"reward": "float", "value": "float", "next_value": "float", "terminated": "bool",
                 "boundary": "bool", "trajectory_id": "int"}
        aligned = True
        for name, kind in kinds.items():
            t = getattr(self, name)
            if t is None:
                continue
            if tuple(t.shape) != (N,):
                checks.fail(name, f"all transition tensors must align with reward [N={N}], got {list(t.shape)}")
                aligned = False
            if not checks.dtype(name, t, kind):
                aligned = False
        if not aligned:
            return
        if not bool(self.boundary[-1]):
            checks.fail("boundary", "packed fragments must be closed: the last transition must be a boundary",
                        f"position {N - 1}")
        checks.when_any(self.terminated & ~self.boundary, "terminated",
                        "a terminal transition must close its trajectory (terminated ⇒ boundary)", noun="positions")
        checks.when_any(~torch.isfinite(self.reward), "reward", "must be finite", noun="positions")
        checks.when_any(~torch.isfinite(self.value), "value", "must be finite", noun="positions")
        checks.when_any(~self.terminated & ~torch.isfinite(self.next_value), "next_value",
                        "must be finite where the transition bootstraps (not terminated)", noun="positions")
        if self.trajectory_id is not None and N > 1:
            changes = self.trajectory_id[1:] != self.trajectory_id[:-1]
            checks.when_any(changes & ~self.boundary[:-1], "trajectory_id",
                            "a fragment must not mix trajectories: the id changes without a boundary after",
                            noun="positions")
