"""The batch contracts: :class:`PolicyBatch` (padded ``[B, T]``) and :class:`PackedTransitions` (packed 1-D).

Both are pydantic models holding torch tensors. Constructing one validates it in one O(N) pass of vectorised
checks with a single host synchronisation; every violated rule is reported at once, each naming the field, the rule
and the offending rows/positions. ``PolicyBatch.unchecked(...)`` builds one without checks for the hot path.

Masked (non-action) positions may hold anything, NaN and inf included: nothing downstream reads them.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, ClassVar, Literal, TypeVar, overload

import torch
from pydantic import BaseModel, ConfigDict, PrivateAttr, model_validator

from . import checks as checks_module
from .checks import Checks, any_of
from .errors import BatchValidationError, Violation, describe_positions, did_you_mean

#: log-probs may exceed 0 by this much (rounding in low-precision log-softmax) before they are rejected.
LOGP_TOLERANCE = 1e-3

#: entropies may fall below 0 by this much (rounding of −Σ p·log p in low precision) before they are rejected.
ENTROPY_TOLERANCE = 1e-3

#: a sum of squared probabilities may exceed 1 by this much (low-precision rounding) before it is rejected.
PROBABILITY_TOLERANCE = 1e-3

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
        self._entries: dict[int, tuple[weakref.ref[Tensor], int, bool, bool]] = {}

    def get(self, t: Tensor) -> tuple[bool, bool] | None:
        """``(finite, at_most_tolerance)`` of every element of ``t``, or None if ``t`` was not checked as it is now."""
        entry = self._entries.get(id(t))
        if entry is None or entry[0]() is not t or entry[1] != t._version:
            return None
        return entry[2], entry[3]

    def to_read(self, t: Tensor, whole: Tensor, *, below_too: bool = False) -> Tensor | None:
        """What a check of ``t`` must read, ``whole`` being the tensor whose remembered outcome covers it (its base):
        None when ``whole`` passed as it is now (the tolerance rule too if ``below_too``); ``whole`` when it was not
        checked as it is now; ``t`` itself when ``whole`` failed (garbage elsewhere in it: this slice on its own)."""
        known = self.get(whole)
        if known is None:
            return whole
        if known[0] and (known[1] or not below_too):
            return None
        return t

    def put(self, t: Tensor, finite: bool, below: bool) -> None:
        key = id(t)
        self._entries[key] = (
            weakref.ref(t, lambda _, key=key: self._entries.pop(key, None)),  # type: ignore[misc]
            t._version,
            finite,
            below,
        )

    def clear(self) -> None:
        self._entries.clear()


_CHECKED = _CheckedTensors()


def forget_checked() -> None:
    """Forget every remembered whole-tensor check: the next validation reads every field again."""
    _CHECKED.clear()


def _base_of(t: Tensor) -> Tensor:
    """The tensor whose whole-tensor check covers ``t``: its view base when that is not much larger, else ``t``."""
    base = t._base
    if (
        base is None
        or base.dtype != t.dtype
        or base.device != t.device
        or base.layout != torch.strided
        or base.numel() > _CheckedTensors.BASE_READ_LIMIT * max(t.numel(), 1)
    ):
        return t
    return base


def _token_value_rules(checks: Checks, name: str, t: Tensor, mask: Tensor, logprob: bool) -> None:
    """``t`` finite on action positions (and, for log-probs, ``<= LOGP_TOLERANCE``), cheaply: one ``aminmax`` pass
    over the whole tensor — or over its base, once per version (see :class:`_CheckedTensors`); NaN propagates into
    both ends. Only if that fails — non-action positions may hold anything — are the action positions selected and
    tested, and only if that fails too are the offending positions computed.

    A tensor that carries gradient (``logp``: the model's output of this forward pass) is read every time and never
    remembered — no later check will see it again."""

    def find() -> list[Violation]:
        found = []
        bad = mask & ~torch.isfinite(t)
        if bool(bad.any()):
            found.append(Violation(name, "must be finite on action positions", describe_positions(bad, noun="rows")))
        if logprob:
            big = mask & (t > LOGP_TOLERANCE)
            if bool(big.any()):
                found.append(
                    Violation(
                        name,
                        f"log-probs must be <= 0 (tolerance {LOGP_TOLERANCE}) on action positions",
                        describe_positions(big, noun="rows"),
                    )
                )
        return found

    if checks_module.on_host(t):  # the reductions' values are on the host already: Python tests, no flag kernels
        if not _values_pass_on_host(t, mask, logprob):
            checks.when_flag(True, find)
        return
    # on an accelerator the flags are resolved (and remembered) with the contract's single host synchronisation
    if t.numel() == 0:
        return
    fresh = t.requires_grad
    whole = t if fresh else _CHECKED.to_read(t, _base_of(t), below_too=logprob)
    if whole is None:
        return  # every element of the base passed: so does every slice, whatever its mask

    def find_on_actions() -> list[Violation]:
        finite, below = _extremes(torch.where(mask, t, 0), logprob, False)
        return find() if not (bool(finite) and bool(below)) else []  # failures all off the actions: allowed

    finite, below = _extremes(whole, logprob, False)
    checks.when_flag(
        ~(finite & below),
        find_on_actions,
        resolved=None
        if fresh
        else (lambda failed, whole=whole: _CHECKED.put(whole, not failed, not failed and logprob)),  # type: ignore[misc]
    )


def _values_pass_on_host(t: Tensor, mask: Tensor, logprob: bool) -> bool:
    """The quick test of :func:`_token_value_rules` on the CPU, reading what it reads: True if ``t`` passes on the
    action positions; False means the full rule must run and name the positions."""
    if t.numel() == 0:
        return True
    fresh = t.requires_grad  # this forward's logp: read every time, never remembered
    whole = t if fresh else _CHECKED.to_read(t, _base_of(t), below_too=logprob)
    if whole is None:
        return True
    finite, below = _extremes(whole, logprob, True)
    if not fresh:
        _CHECKED.put(whole, finite, finite and below and logprob)
    if finite and below:
        return True
    finite, below = _extremes(torch.where(mask, t, 0), logprob, True)  # garbage off the actions is allowed
    return finite and below


def _entropy_passes_on_host(entropy: Tensor, mask: Tensor) -> bool:
    """The quick test of the entropy rule on the CPU: finite and ≥ −tolerance on the actions."""
    if entropy.shape != mask.shape or not entropy.is_floating_point() or not entropy.is_cpu:
        return False
    ok = torch.isfinite(entropy) & (entropy >= -ENTROPY_TOLERANCE)
    return bool((ok | ~mask).all())


def _components_pass_on_host(t: Tensor, row_shape: torch.Size) -> bool:
    """The quick test of the ``reward_components`` rules on the CPU: ``[B, K≥1]`` float, finite."""
    return (
        t.ndim == 2
        and t.shape[:1] == row_shape
        and t.shape[1] > 0
        and t.is_floating_point()
        and t.is_cpu
        and math.isfinite(t.sum(dtype=torch.float64).item())
    )


def _token_view(t: Tensor, mask: Tensor) -> Tensor:
    """A ``[B]`` or ``[B, T]`` field seen as ``[B, T]`` (a per-row value repeated along the tokens)."""
    return t.unsqueeze(-1).expand_as(mask) if t.ndim == 1 else t


def _versions_pass_on_host(behavior: Tensor, policy: Tensor | None, mask: Tensor) -> bool:
    """The quick test of :func:`_version_rules` on the CPU."""
    if policy is None or not (behavior.is_cpu and policy.is_cpu):
        return False
    view = _token_view(behavior, mask)
    ok = (view >= 0) & (view <= policy.unsqueeze(-1))
    return bool((ok | ~mask).all())


def _version_rules(checks: Checks, behavior: Tensor | None, policy: Tensor | None, mask: Tensor) -> None:
    """``behavior_version`` ≥ 0 and ≤ the row's ``policy_version`` on the actions; each needs the other."""
    if behavior is None and policy is None:
        return
    if behavior is None or policy is None:
        given, missing = (
            ("behavior_version", "policy_version") if policy is None else ("policy_version", "behavior_version")
        )
        checks.fail(
            given,
            f"is read against {missing}: give both (the versions that generated the tokens and the "
            "version this update starts from)",
        )
        return
    view = _token_view(behavior, mask)
    checks.when_any(mask & (view < 0), "behavior_version", "must be >= 0 on action positions")
    checks.when_any(
        mask & (view > policy.unsqueeze(-1)),
        "behavior_version",
        "must be <= the row's policy_version on action positions: a token cannot come from a policy newer than "
        "the one this update starts from",
    )


def _finite_on_host(t: Tensor) -> bool:
    """The quick test of :func:`_finite_rule` on the CPU (a per-response float field)."""
    if not t.is_floating_point() or t.numel() == 0:
        return False  # the full rule reports
    whole = _CHECKED.to_read(t, _base_of(t))
    if whole is None:
        return True
    finite = math.isfinite(whole.sum(dtype=torch.float64 if whole.element_size() < 4 else whole.dtype).item())
    _CHECKED.put(whole, finite, False)
    return finite


def _rows_act_on_host(mask: Tensor) -> bool:
    """Every row of the CPU bool ``mask`` has an action: read once per step — a micro-batch that is a range of rows of
    a mask whose every row passed (same version) passes without a pass over it."""
    whole = _CHECKED.to_read(mask, _rows_of(mask))
    if whole is None:
        return True
    ok = whole.view(torch.uint8).amax(-1).amin().item() != 0
    _CHECKED.put(whole, ok, False)
    return ok


@overload
def _extremes(x: Tensor, logprob: bool, host: Literal[True]) -> tuple[bool, bool]: ...
@overload
def _extremes(x: Tensor, logprob: bool, host: Literal[False]) -> tuple[Tensor, Tensor]: ...


def _extremes(x: Tensor, logprob: bool, host: bool) -> tuple[bool, bool] | tuple[Tensor, Tensor]:
    """``(finite, at_most_tolerance)`` of every element of ``x``: Python bools on the host, else 0-d flags."""
    if not logprob and x.element_size() >= 4:  # finiteness alone: the sum (any NaN or inf reaches it)
        total = x.sum()
        if host:
            return math.isfinite(total.item()), True
        return torch.isfinite(total), torch.ones((), dtype=torch.bool, device=x.device)
    low, high = torch.aminmax(x.detach())
    if host:
        lo, hi = low.item(), high.item()  # NaN fails both comparisons
        return lo > -math.inf, (hi <= LOGP_TOLERANCE) if logprob else (hi < math.inf)
    return low > float("-inf"), (high <= LOGP_TOLERANCE) if logprob else (high < float("inf"))


def _rows_of(t: Tensor) -> Tensor:
    """The tensor whose per-row outcome covers ``t``'s rows: its base when ``t`` is a range of the base's rows (a
    micro-batch sliced from the step's batch: same row layout), else ``t`` itself."""
    base = t._base
    if (
        base is None
        or base.dtype != t.dtype
        or base.ndim != t.ndim
        or base.shape[1:] != t.shape[1:]
        or base.stride() != t.stride()
        or base.numel() > _CheckedTensors.BASE_READ_LIMIT * max(t.numel(), 1)
    ):
        return t
    return base


def _every_row_acts(checks: Checks, mask: Tensor) -> None:
    """Every response has at least one action token: the least number of actions of any row is > 0 (through the
    ``uint8`` view: the CPU vectorises its max). On the CPU a step's mask is read once (:func:`_rows_act_on_host`)."""
    if checks_module.on_host(mask):
        if not _rows_act_on_host(mask):
            checks.when_flag(True, lambda: _empty_rows_of(mask))
        return
    checks.when_flag(mask.view(torch.uint8).amax(-1).amin() == 0, lambda: _empty_rows_of(mask))


def _empty_rows_of(mask: Tensor) -> list[Violation]:
    bad = ~any_of(mask, -1)
    if not bool(bad.any()):
        return []
    return [
        Violation("action_mask", "every response needs at least one action token", describe_positions(bad, noun="rows"))
    ]


def _finite_rule(checks: Checks, name: str, t: Tensor) -> None:
    """A per-response float field (``[B]`` advantage, reward) is finite; on the CPU read once per step like the
    token fields (:func:`_finite_on_host`)."""
    if not (checks_module.on_host(t) and _finite_on_host(t)):
        checks.when_not_finite(t, name)


_M = TypeVar("_M", bound="_TensorModel")


class _TensorModel(BaseModel):
    """Shared machinery: tensor-only fields, typo-aware unknown-field errors, checked/unchecked construction."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True, extra="forbid")
    _validated: bool = PrivateAttr(default=False)
    _DEFAULTS: ClassVar[dict[str, None]]  # per-class caches, set on first use (read from the class's own __dict__)
    _REQUIRED: ClassVar[tuple[str, ...]]

    def __init__(self, /, **data: Any) -> None:
        # A contract is built once per micro-batch in a trainer's hot loop. pydantic's own validation would only
        # repeat the type checks of _tensors_only (every field a tensor or None) at several µs: the fields are set
        # as model_construct sets them and the contract runs right after, exactly as after pydantic's validation.
        cls = type(self)
        cls._tensors_only(data)  # type: ignore[operator]  # pydantic's validator proxy calls through
        values = dict(cls._defaults())
        values.update(data)
        object.__setattr__(self, "__dict__", values)
        object.__setattr__(self, "__pydantic_fields_set__", set(data))
        object.__setattr__(self, "__pydantic_extra__", None)
        object.__setattr__(self, "__pydantic_private__", {"_validated": False})
        self.check(types_checked=True)

    @classmethod
    def _defaults(cls) -> dict[str, None]:
        defaults = cls.__dict__.get("_DEFAULTS")
        if defaults is None:
            defaults = {k: None for k, f in cls.model_fields.items() if not f.is_required()}
            cls._DEFAULTS = defaults
        return defaults

    @model_validator(mode="before")
    @classmethod
    def _tensors_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls._plain_tensors(data):
            return data
        if not isinstance(data, dict):
            raise BatchValidationError(
                cls.__name__, [Violation("<batch>", f"expected keyword fields, got {type(data).__name__}")]
            )
        checks = Checks(cls.__name__)
        fields = cls.model_fields
        for key in data:
            if key not in fields:
                checks.fail(key, "unknown field" + did_you_mean(key, fields), f"fields are: {', '.join(fields)}")
        cls._field_types({k: v for k, v in data.items() if k in fields}, checks)
        checks.raise_if_any()
        return data

    @classmethod
    def _plain_tensors(cls, data: dict[str, Any]) -> bool:
        """Every key a field, every value a dense tensor or None, every required field given: the common case, tested
        without building a report (:meth:`_field_types` names what is wrong otherwise)."""
        fields = cls.__pydantic_fields__
        strided = torch.strided
        for key, value in data.items():
            if key not in fields or (
                value is not None and (not isinstance(value, torch.Tensor) or value.layout != strided)
            ):
                return False
        return all(data.get(key) is not None for key in cls._required())

    @classmethod
    def _required(cls) -> tuple[str, ...]:
        required = cls.__dict__.get("_REQUIRED")
        if required is None:
            required = tuple(k for k, f in cls.model_fields.items() if f.is_required())
            cls._REQUIRED = required
        return required

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
    def _run_contract(self) -> _TensorModel:
        self.check(types_checked=True)
        return self

    @classmethod
    def unchecked(cls: type[_M], **fields: Tensor | None) -> _M:
        """Build without any validation (hot path). ``policy_loss(validate="full")`` still checks it later."""
        # None: _fields_set, as by default; the pydantic plugin types model_construct on the declaring class
        return cls.model_construct(None, **fields)  # type: ignore[return-value]

    @property
    def validated(self) -> bool:
        return self._validated

    def check(self, types_checked: bool = False) -> None:
        """Run every contract rule; raise :class:`BatchValidationError` listing all violations."""
        if not (types_checked and self._passes()):
            checks = Checks(type(self).__name__)
            if not types_checked:  # (an unchecked batch may hold anything) the rules below assume tensors
                self._field_types({k: getattr(self, k, None) for k in type(self).model_fields}, checks)
                checks.raise_if_any()
            self._rules(checks)
            checks.raise_if_any()
        self.__pydantic_private__["_validated"] = True  # type: ignore[index]  # set in __init__/model_construct

    def _passes(self) -> bool:
        """True when every rule holds, tested the quick way (on the CPU: no report, no flags); False when a rule
        fails or the quick test does not apply — :meth:`_rules` then runs and names what is wrong. It runs once per
        micro-batch in a trainer's hot loop."""
        return False

    def _rules(self, checks: Checks) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def replace(self: _M, **fields: Tensor | None) -> _M:
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
    #: and regularisers
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

    TOKEN_FLOATS: ClassVar[tuple[str, ...]] = ("logp", "old_logp", "behavior_logp", "ref_logp", "teacher_logp", "value")
    LOGPROBS: ClassVar[tuple[str, ...]] = ("logp", "old_logp", "behavior_logp", "ref_logp", "teacher_logp")

    @property
    def batch_size(self) -> int:
        return self.logp.shape[0]

    @property
    def action_lengths(self) -> Tensor:
        """Number of action tokens of each response, ``[B]``."""
        return self.action_mask.sum(-1)

    #: every field but logp: may it be [B, T], may it be [B], and its dtype kind
    _LAYOUT: ClassVar[dict[str, tuple[bool, bool, str]]] = {
        "old_logp": (True, False, "float"),
        "behavior_logp": (True, False, "float"),
        "ref_logp": (True, False, "float"),
        "value": (True, False, "float"),
        "action_mask": (True, False, "bool"),
        "advantage": (True, True, "float"),
        "reward": (True, True, "float"),
        "group_id": (False, True, "int"),
        "trajectory_id": (False, True, "int"),
        "terminated": (False, True, "bool"),
        "final_value": (False, True, "float"),
        "entropy": (True, False, "float"),
        "sum_pi_squared": (True, False, "float"),
        "reward_baseline": (False, True, "float"),
        "reward_components": (False, False, "float"),  # [B, K]: its own shape rule
        "teacher_logp": (True, False, "float"),
        "behavior_version": (True, True, "int"),
        "policy_version": (False, True, "int"),
        "anchor_id": (False, True, "int"),
    }
    #: the fields whose values are checked: finite on the actions (log-probs also ≤ LOGP_TOLERANCE), or finite per row
    _VALUE_FIELDS: ClassVar[tuple[str, ...]] = TOKEN_FLOATS + ("advantage", "reward", "reward_baseline")

    def _passes(self) -> bool:
        fields = self.__dict__
        logp = fields["logp"]
        if not checks_module.on_host(logp):
            return False  # on an accelerator the rules queue their flags for one synchronisation
        shape = logp.shape
        if len(shape) != 2 or not shape[0] or not shape[1] or not logp.is_floating_point():
            return False
        row_shape, layout = shape[:1], self._LAYOUT
        for name, t in fields.items():
            if t is None or name == "logp":
                continue
            per_token, per_row, kind = layout[name]
            t_shape = t.shape
            if name == "reward_components":
                if not _components_pass_on_host(t, row_shape):
                    return False
                continue
            if (
                not ((per_token and t_shape == shape) or (per_row and t_shape == row_shape))
                or not (
                    t.is_floating_point()
                    if kind == "float"
                    else t.dtype is torch.bool
                    if kind == "bool"
                    else not (t.is_floating_point() or t.is_complex() or t.dtype is torch.bool)
                )
                or not t.is_cpu
            ):  # (logp is on the CPU: so must every field be)
                return False
        if not _rows_act_on_host(fields["action_mask"]):
            return False
        seen: list[tuple[Any, ...]] = []
        for name in self._VALUE_FIELDS:
            t = fields.get(name)
            if t is None:
                continue
            if t.ndim == 1:
                if not _finite_on_host(t):
                    return False
                continue
            logprob = name in self.LOGPROBS
            key = (t.data_ptr(), t.stride(), t.dtype, logprob)
            if key in seen:
                continue
            seen.append(key)
            if not _values_pass_on_host(t, fields["action_mask"], logprob):
                return False
        entropy = fields.get("entropy")
        if entropy is not None and not _entropy_passes_on_host(entropy, fields["action_mask"]):
            return False
        if fields.get("sum_pi_squared") is not None:
            return False  # its [0, 1] rule: the full path
        behavior_version = fields.get("behavior_version")
        if behavior_version is not None and not _versions_pass_on_host(
            behavior_version, fields.get("policy_version"), fields["action_mask"]
        ):
            return False
        if fields.get("policy_version") is not None and behavior_version is None:
            return False  # the full path says what policy_version needs
        if fields.get("anchor_id") is not None and fields.get("group_id") is None:
            return False
        final_value = fields.get("final_value")
        return final_value is None  # truncation rules: the full path

    def _rules(self, checks: Checks) -> None:
        fields = self.__dict__
        logp, mask = fields["logp"], fields["action_mask"]
        if logp.ndim != 2:
            checks.fail("logp", f"must be [B, T], got shape {tuple(logp.shape)}")
            return
        B, T = shape = logp.shape
        if B == 0:
            checks.fail("logp", f"a batch needs at least one response, got shape {list(shape)}")
            return
        ok = checks.dtype("logp", logp, "float")
        row_shape = shape[:1]
        device = logp.device
        present = [(name, t) for name, t in fields.items() if t is not None and name != "logp"]
        # (this runs once per micro-batch: the common case is tested first, the report built only on failure)
        for name, t in present:
            per_token, per_row, kind = self._LAYOUT[name]
            t_shape = t.shape
            if name == "reward_components":
                if t.ndim != 2 or t_shape[0] != B or t_shape[1] == 0:
                    checks.fail(
                        name, f"must be [B={B}, K] with one column per reward function (K >= 1), got {list(t_shape)}"
                    )
                    ok = False
            elif not ((per_token and t_shape == shape) or (per_row and t_shape == row_shape)):
                want = " or ".join(str(list(s)) for s, allowed in ((row_shape, per_row), (shape, per_token)) if allowed)
                checks.fail(name, f"shape must align with logp [B={B}, T={T}]: expected {want}, got {list(t_shape)}")
                ok = False
            if not (t.is_floating_point() if kind == "float" else checks.dtype(name, t, kind)):
                if kind == "float":
                    checks.dtype(name, t, kind)
                ok = False
            if t.device != device:
                checks.fail(name, f"must be on logp's device {device}, got {t.device}")
                ok = False
        if not ok:
            return  # value rules below assume aligned, well-typed tensors

        if T > 0:
            _every_row_acts(checks, mask)
        else:
            checks.when_any(~any_of(mask, -1), "action_mask", "every response needs at least one action token")
        seen: list[tuple[Any, ...]] = []
        for name in self._VALUE_FIELDS:
            t = fields.get(name)
            if t is None:
                continue
            if t.ndim == 2:
                logprob = name in self.LOGPROBS
                # a field that is the same elements as one checked under the same rule (TRL's on-policy
                # old_logp = logp.detach()) is not read twice
                key = (t.data_ptr(), t.stride(), t.dtype, logprob)
                if key in seen:
                    continue
                seen.append(key)
                _token_value_rules(checks, name, t, mask, logprob=logprob)
            else:
                _finite_rule(checks, name, t)
        components = fields.get("reward_components")
        if components is not None:
            checks.when_not_finite(components, "reward_components", noun="rows")
        entropy = fields.get("entropy")
        if entropy is not None:
            checks.when_any(
                mask & ~(torch.isfinite(entropy) & (entropy >= -ENTROPY_TOLERANCE)),
                "entropy",
                f"must be finite and >= 0 (tolerance {ENTROPY_TOLERANCE}) on action positions",
            )
        sum_pi_squared = fields.get("sum_pi_squared")
        if sum_pi_squared is not None:
            checks.when_any(
                mask & ~((sum_pi_squared >= 0) & (sum_pi_squared <= 1 + PROBABILITY_TOLERANCE)),
                "sum_pi_squared",
                f"must be in [0, 1] (tolerance {PROBABILITY_TOLERANCE}) on action positions: Σ_v π(v)² of a distribution",
            )
        _version_rules(checks, fields.get("behavior_version"), fields.get("policy_version"), mask)
        if fields.get("anchor_id") is not None and fields.get("group_id") is None:
            checks.fail(
                "anchor_id",
                "names states within a prompt group: give group_id [B] with it (rows of one group with equal "
                "anchor_id saw the same state)",
            )
        final_value = fields.get("final_value")
        if final_value is not None:
            terminated = fields.get("terminated")
            if terminated is None:
                checks.fail(
                    "final_value",
                    "is only read for truncated responses: give terminated [B] bool with it "
                    "(False where the response was cut by a time limit)",
                )
            else:
                checks.when_any(
                    ~terminated & ~torch.isfinite(final_value),
                    "final_value",
                    "must be finite for truncated (not terminated) responses",
                )


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
    trajectory_id: Tensor | None = None

    def _rules(self, checks: Checks) -> None:
        reward = self.reward
        if reward.ndim != 1 or reward.numel() == 0:
            checks.fail(
                "reward", f"packed fragments must be non-empty and one-dimensional, got shape {list(reward.shape)}"
            )
            return
        (N,) = reward.shape
        kinds = {
            "reward": "float",
            "value": "float",
            "next_value": "float",
            "terminated": "bool",
            "boundary": "bool",
            "trajectory_id": "int",
        }
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
            checks.fail(
                "boundary",
                "packed fragments must be closed: the last transition must be a boundary",
                f"position {N - 1}",
            )
        checks.when_any(
            self.terminated & ~self.boundary,
            "terminated",
            "a terminal transition must close its trajectory (terminated ⇒ boundary)",
            noun="positions",
        )
        checks.when_any(~torch.isfinite(self.reward), "reward", "must be finite", noun="positions")
        checks.when_any(~torch.isfinite(self.value), "value", "must be finite", noun="positions")
        checks.when_any(
            ~self.terminated & ~torch.isfinite(self.next_value),
            "next_value",
            "must be finite where the transition bootstraps (not terminated)",
            noun="positions",
        )
        if self.trajectory_id is not None and N > 1:
            changes = self.trajectory_id[1:] != self.trajectory_id[:-1]
            checks.when_any(
                changes & ~self.boundary[:-1],
                "trajectory_id",
                "a fragment must not mix trajectories: the id changes without a boundary after",
                noun="positions",
            )
