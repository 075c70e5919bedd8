"""Which logged metrics describe the gates' activity — shared by the live display and the figures.

The TRL adapter logs a gate's own metrics as ``lossplug/<gate>/<metric>``. A gate's *fraction* metrics are those
whose name ends in ``_frac`` or contains ``_frac_``: ppo_clip's ``clip_frac_low`` / ``clip_frac_high``, dis's
``drop_frac_*``, icepop's ``reject_frac_*``, tis's ``trunc_frac``, sapo's ``soft_frac``, or a third-party gate's
``soft_cut_frac``. They fall in two kinds:

* **cut** fractions — what the gate reports itself: the share of action tokens it clipped, dropped, truncated or
  damped (usually a few percent);
* **kept** fractions — ``<gate>/active_token_frac`` / ``active_seq_frac``, which the pipeline adds under
  ``metrics="full"``: the share of tokens or responses the gate left active (usually close to 1).

Names under lossplug's own namespaces (``update/``, ``ratio/``, ``effective/``, ``reward/`` …) are never a gate's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: the namespaces under ``lossplug/`` that the pipeline and the adapters use for their own metrics
LOSSPLUG_NAMESPACES = frozenset({"update", "ratio", "effective", "objective", "reward", "advantage", "behavior_logp"})
PREFIX = "lossplug/"
_FRACTION = re.compile(r"^(?P<stem>[A-Za-z0-9_]*?_frac)(?:_(?P<side>[A-Za-z0-9_]+))?$")
_SIDE_ORDER = {"high": 0, "low": 1}


@dataclass(frozen=True)
class GateFraction:
    """One fraction metric of one gate: ``key`` = ``lossplug/<gate>/<metric>``, ``metric`` = ``<stem>[_<side>]``."""

    key: str
    gate: str
    metric: str
    stem: str
    side: str | None

    @property
    def kept(self) -> bool:
        """A share the gate left active (the pipeline's ``active_*_frac``), not one it cut."""
        return self.stem.startswith("active_")

    @property
    def label(self) -> str:
        """The stem in words: ``clip_frac`` → ``clip fraction``."""
        return self.stem.removesuffix("_frac").replace("_", " ") + " fraction"


def parse(key: str) -> GateFraction | None:
    """The :class:`GateFraction` that ``key`` names, or None when it is not a gate's fraction metric."""
    if not key.startswith(PREFIX):
        return None
    parts = key[len(PREFIX) :].split("/")
    if len(parts) != 2 or parts[0] in LOSSPLUG_NAMESPACES:
        return None
    gate, metric = parts
    match = _FRACTION.match(metric)
    if match is None:
        return None
    return GateFraction(key=key, gate=gate, metric=metric, stem=match["stem"], side=match["side"])


def gate_fractions(keys: Iterable[str], gates: Sequence[str] | None = None) -> list[GateFraction]:
    """Every gate fraction metric among ``keys``, in display order: by gate (``gates``' order when given, else by
    name), then by stem, ``high`` before ``low`` before other sides.

    ``gates``: the recipe's gate names — only their metrics are taken; without it any ``lossplug/<name>/…`` outside
    lossplug's own namespaces counts as a gate's (right for every metric the adapters log, but a third-party
    ``lossplug_extra_metrics`` hook could name one like a gate). A total such as cispo's ``clip_frac`` is left out
    when its sides (``clip_frac_low`` / ``clip_frac_high``) are there: it is their sum.
    """
    found = {f.key: f for f in map(parse, keys) if f is not None and (gates is None or f.gate in gates)}
    sided = {(f.gate, f.stem) for f in found.values() if f.side is not None}
    chosen = [f for f in found.values() if f.side is not None or (f.gate, f.stem) not in sided]
    gate_rank = {g: i for i, g in enumerate(gates)} if gates is not None else {}
    return sorted(
        chosen,
        key=lambda f: (
            gate_rank.get(f.gate, len(gate_rank)),
            f.gate,
            f.kept,
            f.stem,
            _SIDE_ORDER.get(f.side or "", 2),
            f.side or "",
        ),
    )


def gates_without_active(keys: Iterable[str], gates: Sequence[str] | None = None) -> list[str]:
    """The gates whose cuts the effective sample rate (``effective/token_frac``, ``seq_frac``) does not see: among
    ``keys`` (one logged row), a cut fraction of theirs but no kept fraction. The pipeline logs a gate's kept fraction
    (``active_token_frac`` / ``active_seq_frac``) beside the effective rate exactly when the gate declares
    ``GateOutput.active``; one that does not counts every token as kept, so the rate overstates what trains.
    Empty when the row has no effective rate (``metrics`` below ``"full"``)."""
    keys = list(keys)
    if PREFIX + "effective/token_frac" not in keys:
        return []
    fractions = gate_fractions(keys, gates)
    kept = {f.gate for f in fractions if f.kept}
    return sorted({f.gate for f in fractions if not f.kept} - kept)


def effective_rate_note(keys: Iterable[str], gates: Sequence[str] | None = None) -> str:
    """What a plot or a table of the effective sample rate adds to its label: the gates it does not see, or ''."""
    unseen = gates_without_active(keys, gates)
    if not unseen:
        return ""
    verb = "declares" if len(unseen) == 1 else "declare"
    return f"{', '.join(unseen)} {verb} no `active`: counted as kept"
