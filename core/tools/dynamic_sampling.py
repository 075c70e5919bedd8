"""DAPO dynamic sampling: keep only the prompt groups whose rewards are mixed — and report what it cost.

Under a binary verifier only a group holding both right and wrong answers carries a group-relative ranking signal;
an all-right or all-wrong group has zero advantage everywhere (GRPO/RLOO) and only dilutes the learner batch. For a
group ``g`` with rewards ``{r_i : group_id_i = g}``::

    keep_g = max_i r_i > min_i r_i            (DAPO's rule: the group is not constant; singletons are dropped)

Groups come from ``group_id`` (scattered rows, unequal sizes: no adjacency or equal-size assumption), or from a
``[prompt, rollout]`` layout where row ``g`` of a 2-D ``reward`` is group ``g``.

Filtering raises the learner batch's signal density; it does not make sampling cheaper: a fair comparison
reports the full generation cost, not only the retained batch. So every call returns, next to the keep
mask, a :class:`SamplingCost` report (pydantic): generated vs retained groups, sequences and tokens, the retention
rates, optional generation wall-clock, and the retention **by difficulty** — groups are bucketed by their pass rate
``p_g = #{i : r_i ≥ pass_threshold} / |g|``::

    all_wrong        p_g = 0
    mixed_<lo>-<hi>  lo < 100·p_g ≤ hi, ``bins`` equal bins of (0, 100) percent
    all_right        p_g = 1

(For binary rewards the mixed buckets are exactly the kept groups; with graded rewards a group can be all-pass and
still mixed, and is then kept in ``all_right``.) Reports of several generation rounds (DAPO resamples until the batch
is full) add up with ``+`` / :meth:`SamplingCost.merge`. Nothing here carries a gradient.

Paper: Yu et al., 2025, *DAPO: An Open-Source LLM Reinforcement Learning System at Scale*, arXiv:2503.14476
(dynamic sampling).
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeVar, cast

import torch
from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from lossplug.contracts import LossplugError
from lossplug.contracts.checks import Checks
from lossplug.ops import Groups

Tensor = torch.Tensor

__all__ = [
    "BucketCost",
    "DynamicSample",
    "SamplingCost",
    "difficulty_buckets",
    "keep_mixed_groups",
    "mixed_group_rows",
]


def _rate(num: int | None, den: int | None) -> float | None:
    if num is None or den is None:
        return None
    return num / den if den else None


_N = TypeVar("_N", int, float)


def _add_opt(a: _N | None, b: _N | None) -> _N | None:
    return None if a is None or b is None else a + b


class _Report(BaseModel):
    """Frozen, strict models whose dumps (computed fields included) validate back: derived keys are dropped."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_computed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            computed = set(cls.model_computed_fields)
            data = {k: v for k, v in data.items() if k not in computed}
        return data

    @model_validator(mode="after")
    def _retained_within_generated(self) -> _Report:
        for kind in ("groups", "sequences", "tokens"):
            gen = getattr(self, f"generated_{kind}", getattr(self, kind, None))
            kept = getattr(self, f"retained_{kind}")
            if (gen is None) != (kept is None) or (gen is not None and kept > gen):
                raise LossplugError(
                    f"{type(self).__name__}: retained_{kind}: must be <= the generated count ({gen}), got {kept}"
                )
        return self


class BucketCost(_Report):
    """Generated and retained counts of one difficulty bucket."""

    groups: int = Field(ge=0)
    retained_groups: int = Field(ge=0)
    sequences: int = Field(ge=0)
    retained_sequences: int = Field(ge=0)
    tokens: int | None = Field(None, ge=0)
    retained_tokens: int | None = Field(None, ge=0)

    @computed_field  # type: ignore[prop-decorator]  # (pydantic's documented form)
    @property
    def retention(self) -> float | None:
        """Retained share of this bucket's groups (``None`` for an empty bucket: nothing to retain)."""
        return _rate(self.retained_groups, self.groups)

    def __add__(self, other: BucketCost) -> BucketCost:
        return BucketCost(
            groups=self.groups + other.groups,
            retained_groups=self.retained_groups + other.retained_groups,
            sequences=self.sequences + other.sequences,
            retained_sequences=self.retained_sequences + other.retained_sequences,
            tokens=_add_opt(self.tokens, other.tokens),
            retained_tokens=_add_opt(self.retained_tokens, other.retained_tokens),
        )


class SamplingCost(_Report):
    """The full cost of one (or, merged, several) dynamic-sampling rounds: what was generated, what was kept."""

    rounds: int = Field(1, ge=1)
    generated_groups: int = Field(ge=0)
    retained_groups: int = Field(ge=0)
    generated_sequences: int = Field(ge=0)
    retained_sequences: int = Field(ge=0)
    #: generated response tokens (``None`` when neither ``lengths`` nor ``action_mask`` was given)
    generated_tokens: int | None = Field(None, ge=0)
    retained_tokens: int | None = Field(None, ge=0)
    #: generation wall-clock of the round(s), when the caller measured it
    generation_seconds: float | None = Field(None, ge=0)
    pass_threshold: float
    by_difficulty: dict[str, BucketCost]

    @computed_field  # type: ignore[prop-decorator]  # (pydantic's documented form)
    @property
    def rejected_groups(self) -> int:
        return self.generated_groups - self.retained_groups

    @computed_field  # type: ignore[prop-decorator]  # (pydantic's documented form)
    @property
    def rejected_sequences(self) -> int:
        return self.generated_sequences - self.retained_sequences

    @computed_field  # type: ignore[prop-decorator]  # (pydantic's documented form)
    @property
    def rejected_tokens(self) -> int | None:
        if self.generated_tokens is None:
            return None
        return self.generated_tokens - self.retained_tokens  # type: ignore[operator]  # both set (the validator)

    @computed_field  # type: ignore[prop-decorator]  # (pydantic's documented form)
    @property
    def group_retention(self) -> float | None:
        return _rate(self.retained_groups, self.generated_groups)

    @computed_field  # type: ignore[prop-decorator]  # (pydantic's documented form)
    @property
    def sequence_retention(self) -> float | None:
        return _rate(self.retained_sequences, self.generated_sequences)

    @computed_field  # type: ignore[prop-decorator]  # (pydantic's documented form)
    @property
    def token_retention(self) -> float | None:
        return _rate(self.retained_tokens, self.generated_tokens)

    def merge(self, other: SamplingCost) -> SamplingCost:
        """The cost of both rounds together (buckets must match: same ``bins`` and ``pass_threshold``)."""
        if not isinstance(other, SamplingCost):
            raise LossplugError(f"SamplingCost.merge: other must be a SamplingCost, got {type(other).__name__}")
        if list(self.by_difficulty) != list(other.by_difficulty) or self.pass_threshold != other.pass_threshold:
            raise LossplugError(
                "SamplingCost.merge: by_difficulty: the reports use different buckets "
                f"({list(self.by_difficulty)} at pass_threshold {self.pass_threshold} vs "
                f"{list(other.by_difficulty)} at {other.pass_threshold}); merge reports made with the same settings"
            )
        return SamplingCost(
            rounds=self.rounds + other.rounds,
            generated_groups=self.generated_groups + other.generated_groups,
            retained_groups=self.retained_groups + other.retained_groups,
            generated_sequences=self.generated_sequences + other.generated_sequences,
            retained_sequences=self.retained_sequences + other.retained_sequences,
            generated_tokens=_add_opt(self.generated_tokens, other.generated_tokens),
            retained_tokens=_add_opt(self.retained_tokens, other.retained_tokens),
            generation_seconds=_add_opt(self.generation_seconds, other.generation_seconds),
            pass_threshold=self.pass_threshold,
            by_difficulty={k: self.by_difficulty[k] + other.by_difficulty[k] for k in self.by_difficulty},
        )

    __add__ = merge

    def metrics(self, prefix: str = "dynamic_sampling") -> dict[str, float]:
        """A flat ``{name: float}`` dict for a logger (``None`` fields are left out)."""
        out: dict[str, float] = {}
        for key, value in self.model_dump(exclude={"by_difficulty", "pass_threshold"}).items():
            if value is not None:
                out[f"{prefix}/{key}"] = float(value)
        for bucket, cost in self.by_difficulty.items():
            if cost.retention is not None:
                out[f"{prefix}/retention/{bucket}"] = cost.retention
            out[f"{prefix}/groups/{bucket}"] = float(cost.groups)
            if cost.tokens is not None:
                out[f"{prefix}/tokens/{bucket}"] = float(cost.tokens)
        return out


class DynamicSample(NamedTuple):
    """``keep`` — bool, ``[B]`` rows (``group_id`` layout) or ``[G]`` groups (``[prompt, rollout]`` layout) — and the
    cost ``report``. Unpacks as ``keep, report = keep_mixed_groups(...)``."""

    keep: Tensor
    report: SamplingCost


def difficulty_buckets(bins: int = 4) -> list[str]:
    """The bucket names, easiest-to-fail first: ``all_wrong``, ``mixed_<lo>-<hi>`` × bins, ``all_right``."""
    edges = [f"{100 * k / bins:g}" for k in range(bins + 1)]
    return ["all_wrong"] + [f"mixed_{edges[k]}-{edges[k + 1]}" for k in range(bins)] + ["all_right"]


def _mixed_groups(reward: Tensor, group_id: Tensor) -> tuple[Groups, Tensor]:
    """The groups of ``group_id`` and, ``[G]``, whether each one's rewards are not all equal."""
    groups = Groups.from_ids(group_id)
    return groups, ~groups.constant(reward if reward.is_floating_point() else reward.double())


def mixed_group_rows(reward: Tensor, group_id: Tensor) -> Tensor:
    """``[B]`` bool: the rows whose prompt group's rewards are not all equal — :func:`keep_mixed_groups`'s rule,
    without its cost report (the ``zero_variance`` filter's test; one host synchronisation less)."""
    groups, keep_group = _mixed_groups(reward, group_id)
    return keep_group[groups.inverse]


def keep_mixed_groups(
    reward: Tensor,
    group_id: Tensor | None = None,
    *,
    action_mask: Tensor | None = None,
    lengths: Tensor | None = None,
    pass_threshold: float = 0.5,
    bins: int = 4,
    generation_seconds: float | None = None,
    validate: bool = True,
) -> DynamicSample:
    """Keep the groups whose rewards are not all equal; return the keep mask and the full :class:`SamplingCost`.

    * ``reward [B]`` with ``group_id [B]`` (int; scattered, unequal groups): ``keep`` is ``[B]`` per row;
    * ``reward [G, n]`` without ``group_id`` (``[prompt, rollout]``): ``keep`` is ``[G]`` per group.

    Tokens, for the report: ``lengths`` (generated tokens per response, same layout as ``reward``) or
    ``action_mask`` (bool, ``reward``'s shape plus ``T``). ``pass_threshold``: a reward ``≥`` it counts as a pass for
    the difficulty buckets (0.5 fits {0, 1} and {−1, 1} verifiers).
    """
    if validate:
        _check(reward, group_id, action_mask, lengths, pass_threshold, bins, generation_seconds)
    per_group_layout = group_id is None
    if per_group_layout:
        G, n = reward.shape
        group_id = torch.arange(G, device=reward.device).repeat_interleave(n)
    flat_reward = reward.reshape(-1)
    if not flat_reward.is_floating_point():
        flat_reward = flat_reward.double()
    if action_mask is not None:
        lengths = action_mask.sum(-1)
    flat_len = None if lengths is None else lengths.reshape(-1).long()

    groups, keep_group = _mixed_groups(flat_reward, cast(Tensor, group_id).reshape(-1))  # given, or made above
    keep_row = keep_group[groups.inverse]

    counts = groups.counts
    passes = groups.sum((flat_reward >= pass_threshold).long())
    mixed_bin = (passes * bins + counts - 1) // counts  # 1..bins for 0 < passes < counts
    bucket = torch.where(passes == 0, 0, torch.where(passes == counts, bins + 1, mixed_bin))
    nb = bins + 2
    kg = keep_group.long()
    rows = [torch.ones_like(kg), kg, counts, counts * kg]
    if flat_len is not None:
        group_tokens = groups.sum(flat_len)
        rows += [group_tokens, group_tokens * kg]
    table = torch.stack(
        [torch.zeros(nb, dtype=torch.long, device=kg.device).index_add_(0, bucket, r.long()) for r in rows]
    )
    on_host: list[list[int]] = table.tolist()  # the one host sync
    names = difficulty_buckets(bins)
    by_difficulty: dict[str, BucketCost] = {}
    for b, name in enumerate(names):
        col = [row[b] for row in on_host]
        by_difficulty[name] = BucketCost(
            groups=col[0],
            retained_groups=col[1],
            sequences=col[2],
            retained_sequences=col[3],
            tokens=col[4] if flat_len is not None else None,
            retained_tokens=col[5] if flat_len is not None else None,
        )
    totals = [sum(row) for row in on_host]
    report = SamplingCost(
        generated_groups=totals[0],
        retained_groups=totals[1],
        generated_sequences=totals[2],
        retained_sequences=totals[3],
        generated_tokens=totals[4] if flat_len is not None else None,
        retained_tokens=totals[5] if flat_len is not None else None,
        generation_seconds=generation_seconds,
        pass_threshold=pass_threshold,
        by_difficulty=by_difficulty,
    )
    keep = keep_group if per_group_layout else keep_row
    return DynamicSample(keep=keep, report=report)


def _check(
    reward: Any, group_id: Any, action_mask: Any, lengths: Any, pass_threshold: Any, bins: Any, generation_seconds: Any
) -> None:
    c = Checks("keep_mixed_groups")
    ok = c.tensor("reward", reward, kind="number", ndim=(1, 2))
    if ok:
        if group_id is None and reward.ndim == 1:
            c.fail("group_id", "is required with [B] rewards (or pass reward as [prompt, rollout] without group_id)")
            ok = False
        elif group_id is not None and reward.ndim == 2:
            c.fail(
                "group_id",
                f"must be omitted with [prompt, rollout] rewards (got reward {list(reward.shape)}); "
                "pass reward as [B] with group_id [B] for scattered groups",
            )
            ok = False
        elif reward.numel() == 0:
            c.fail("reward", f"needs at least one response, got shape {list(reward.shape)}")
            ok = False
    shape = tuple(reward.shape) if ok else None
    if group_id is not None:
        ok &= c.tensor("group_id", group_id, kind="int", shape=shape, like="reward")
    if action_mask is not None and lengths is not None:
        c.fail("lengths", "give either lengths or action_mask, not both")
    elif action_mask is not None:
        want = None
        if shape is not None and isinstance(action_mask, Tensor) and action_mask.ndim >= 1:
            want = shape + tuple(action_mask.shape[-1:])
        ok &= c.tensor(
            "action_mask",
            action_mask,
            kind="bool",
            ndim=None if want else (2, 3),
            shape=want,
            like="reward's shape + [T]",
        )
    elif lengths is not None:
        ok &= c.tensor("lengths", lengths, kind="int", shape=shape, like="reward")
        if ok:
            c.when_any((lengths < 0).reshape(-1), "lengths", "must be >= 0")
    c.number("pass_threshold", pass_threshold)
    c.number("bins", bins, ge=1, integer=True)
    if generation_seconds is not None:
        c.number("generation_seconds", generation_seconds, ge=0.0)
    if ok:
        c.when_any(~torch.isfinite(reward.reshape(-1).double()), "reward", "must be finite")
    c.raise_if_any()
