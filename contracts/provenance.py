"""Provenance: which policy produced each kind of log-prob, and under which convention.

Mixing log-prob sources — vLLM log-probs of the raw distribution against training log-probs at temperature 0.7,
or a reference model scored in a different dtype — silently biases every ratio. A :class:`Provenance` records, for
the behaviour, old, current and reference log-probs, the checkpoint and engine that produced them and their
convention; :meth:`Provenance.check` refuses mixed conventions on the ratios that compare them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .errors import LossplugError


class LogProbSource(BaseModel):
    """Where one kind of log-prob came from and how it was computed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    checkpoint: str | None = Field(default=None, description="checkpoint / weights version (path, step, hash)")
    engine: str | None = Field(default=None, description="what computed them, e.g. 'vllm 0.11', 'transformers 5.1'")
    temperature: float = Field(default=1.0, gt=0, description="sampling temperature the logits were divided by")
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int | None = Field(default=None, gt=0)
    processed: bool = Field(
        default=False, description="log-probs of the processed (truncated/renormalised) distribution"
    )
    dtype: str | None = None

    def convention(self) -> tuple[float, float, int | None, bool]:
        return (self.temperature, self.top_p, self.top_k, self.processed)


class Provenance(BaseModel):
    """The four policies of an update: behaviour (rollout engine), old, current and reference."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    behavior: LogProbSource | None = None
    old: LogProbSource | None = None
    current: LogProbSource | None = None
    reference: LogProbSource | None = None

    def check(self) -> Provenance:
        """Ratios only compare log-probs of one convention: current/old (update ratio), old/behaviour (engine
        ratio), current/reference (KL). Raise naming both sides when they differ."""
        pairs = (
            ("current", "old", "update ratio"),
            ("old", "behavior", "engine ratio"),
            ("current", "reference", "KL to the reference"),
        )
        for a, b, what in pairs:
            sa, sb = getattr(self, a), getattr(self, b)
            if sa is not None and sb is not None and sa.convention() != sb.convention():
                raise LossplugError(
                    f"Provenance: the {what} compares {a} and {b} log-probs computed under different conventions "
                    f"({a}: temperature={sa.temperature}, top_p={sa.top_p}, top_k={sa.top_k}, processed={sa.processed}; "
                    f"{b}: temperature={sb.temperature}, top_p={sb.top_p}, top_k={sb.top_k}, processed={sb.processed})"
                )
        return self
