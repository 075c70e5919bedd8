"""The demo's figures: ``curves.png`` for one run (:func:`plot_run`) and ``compare.png`` for several
(:func:`plot_compare`), drawn from the metric rows of ``metrics.jsonl`` (matplotlib, imported when first drawn).

The gate-activity panels show every gate's fraction metrics (see :mod:`lossplug.demo.gate_metrics`), on a y-axis
fitted to them: a clip fraction of 0.02 would be a flat line on a 0–1 axis. Shares close to 1 — effective sample
rates, SAPO's mean gate weight, the gates' kept fractions — go on a second, fixed 0–1 axis of the same panel.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import ModuleType

    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

from lossplug.extras import requires_extra

from .gate_metrics import GateFraction, effective_rate_note, gate_fractions

#: the smallest top of a gate-fraction axis: all-zero fractions still get a readable scale
FRACTION_AXIS_FLOOR = 0.01
#: room above the largest fraction, as a share of it
FRACTION_AXIS_MARGIN = 0.15
#: the top share of the gate panel kept free of lines for its legend (the shares kept, near 1, would run under it)
LEGEND_ROOM = 0.3
_SIDE_STYLES = {"high": "-", "low": "--"}
_OTHER_SIDE_STYLE = "-."
_UNSIDED_STYLE = "-"
# orange and black mark the effective sample rates on the second axis
_CUT_COLORS = (
    "tab:red",
    "tab:blue",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:olive",
    "tab:cyan",
    "tab:green",
    "tab:gray",
)


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if v is not None:
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def _smooth(ys: list[float], window: int = 5) -> list[float]:
    out = []
    for i in range(len(ys)):
        part = ys[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fraction_axis_limits(values: Sequence[float]) -> tuple[float, float]:
    """y-limits that fit gate fractions: from just below 0 to :data:`FRACTION_AXIS_MARGIN` above the largest
    value, at least up to :data:`FRACTION_AXIS_FLOOR` and at most a little above 1."""
    top = max([v for v in values if v is not None] + [0.0]) * (1 + FRACTION_AXIS_MARGIN)
    top = min(max(top, FRACTION_AXIS_FLOOR), 1.05)
    return -0.03 * top, top


def _line_style(fraction: GateFraction) -> str:
    if fraction.side is None:
        return _UNSIDED_STYLE
    return _SIDE_STYLES.get(fraction.side, _OTHER_SIDE_STYLE)


def _gate_panel(ax: Axes, rows: list[dict[str, Any]], gates: Sequence[str] | None, legend_size: int) -> None:
    """Cut fractions on ``ax`` (y-axis fitted to them), shares kept on a twin axis (0–1), one legend for both in
    the room left free above the lines."""
    fractions = gate_fractions({k for r in rows for k in r}, gates)
    cut = [f for f in fractions if not f.kept]
    kept = [f for f in fractions if f.kept]
    plotted: list[float] = []
    for i, f in enumerate(cut):
        gx, gy = _series(rows, f.key)
        ax.plot(
            gx, gy, color=_CUT_COLORS[i % len(_CUT_COLORS)], ls=_line_style(f), lw=1.6, label=f"{f.gate}/{f.metric}"
        )
        plotted += gy
    bottom, top = fraction_axis_limits(plotted)
    ax.set_ylim(bottom, bottom + (top - bottom) / (1 - LEGEND_ROOM))
    ax.set_ylabel("fraction of action tokens cut")

    rates = ax.twinx()
    # a gate that declares no `active` has its cuts counted as kept: the label says so instead of a silent 1.0
    note = effective_rate_note({k for r in rows for k in r}, gates)
    for key, color, what in (
        ("lossplug/effective/token_frac", "black", "tokens"),
        ("lossplug/effective/seq_frac", "tab:orange", "sequences"),
    ):
        gx, gy = _series(rows, key)
        if gy:
            label = f"effective sample rate ({what}; {note})" if note else f"effective sample rate ({what})"
            rates.plot(gx, gy, color=color, lw=1.2, ls="--", label=label)
    gate_means = sorted({k for r in rows for k in r if k.startswith("lossplug/") and k.endswith("/gate_mean")})
    for key in gate_means:  # smooth gates (SAPO): the mean gate weight, a share kept rather than a fraction cut
        gx, gy = _series(rows, key)
        rates.plot(gx, gy, color="0.4", lw=1.4, ls="-.", label=key.removeprefix("lossplug/") + " (mean gate weight)")
    # with one gate its kept fraction is the effective sample rate already drawn; with several it tells them apart
    if len({f.gate for f in kept}) > 1:
        for f in kept:
            gx, gy = _series(rows, f.key)
            rates.plot(gx, gy, lw=1.0, ls=":", label=f"{f.gate}/{f.metric}")
    rates.set_ylim(-0.02, -0.02 + 1.07 / (1 - LEGEND_ROOM))
    rates.set_yticks([0.0, 0.25, 0.5, 0.75, 1.0])
    rates.set_ylabel("share kept (effective rate, gate weight)")

    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = rates.get_legend_handles_labels()
    if handles or more_handles:
        # the twin axis is drawn above ``ax``; raising ``ax`` keeps the legend above the lines of both
        ax.set_zorder(rates.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.legend(handles + more_handles, labels + more_labels, fontsize=legend_size, loc="upper center", ncol=2)


@requires_extra("plot", "lossplug.demo.run_figure")
def run_figure(rows: list[dict[str, Any]], title: str = "lossplug demo", gates: Sequence[str] | None = None) -> Figure:
    """The figure of ``curves.png``: learning signal, gate activity, throughput and held-out score, each on its own
    panel. ``gates``: the recipe's gate names (None: every gate in the rows). The caller closes it."""
    plt = _pyplot()
    fig: Figure
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    (ax_r, ax_g), (ax_t, ax_h) = axes

    xs, ys = _series(rows, "reward")
    ax_r.plot(xs, ys, color="tab:green", alpha=0.35, lw=1, label="reward (per rollout batch)")
    ax_r.plot(xs, _smooth(ys), color="tab:green", lw=2.2, label="reward (running mean of 5)")
    sx, sy = _series(rows, "frac_reward_zero_std")
    if sy:
        ax_r.plot(
            sx,
            [1.0 - y for y in sy],
            color="0.45",
            lw=1,
            ls=":",
            label="groups with a learning signal (reward std > 0)",
        )
    ax_r.set_title("Learning signal: training reward (sampled, temperature 1)")
    ax_r.set_ylim(-0.02, 1.02)
    ax_r.set_ylabel("reward")

    _gate_panel(ax_g, rows, gates, legend_size=8)
    ax_g.set_title("Gate activity: fractions cut by each gate, effective sample rates")

    tx, ty = _series(rows, "demo/tokens_per_s")
    ax_t.plot(tx, ty, color="tab:blue", lw=1.5, label="training loop (prompt + completion tokens / s)")
    rx, ry = _series(rows, "demo/rollout_tokens_per_s")
    if ry:
        ax_t.plot(rx, ry, color="tab:cyan", lw=1.2, ls="--", label="rollout (completion tokens / s of generation)")
    ax_t.set_title("Sampling throughput")
    ax_t.set_ylabel("tokens / s")
    ax_t.set_ylim(bottom=0)

    hx, hy = _series(rows, "heldout/score")
    ax_h.plot(hx, hy, color="tab:purple", marker="o", lw=2, label="greedy answers correct")
    ax_h.set_title("Held-out ability: prompts with unseen filler letters")
    ax_h.set_ylim(-0.02, 1.02)
    ax_h.set_ylabel("score")

    _finish(fig, axes.flat, title, legend_size=8, top=0.96)
    return fig


@requires_extra("plot", "lossplug.demo.plot_run")
def plot_run(
    rows: list[dict[str, Any]], path: str | Path, title: str = "lossplug demo", gates: Sequence[str] | None = None
) -> Path:
    """Write ``curves.png`` (:func:`run_figure`) to ``path``."""
    return _write(run_figure(rows, title, gates), path)


@requires_extra("plot", "lossplug.demo.compare_figure")
def compare_figure(
    runs: dict[str, list[dict[str, Any]]],
    title: str = "lossplug demo · recipes compared",
    gates: Mapping[str, Sequence[str]] | None = None,
) -> Figure:
    """The figure of ``compare.png``: one colour per recipe on each panel — reward, held-out score, gate cut
    fractions, throughput. ``gates``: each recipe's gate names by label (missing: every gate in its rows)."""
    plt = _pyplot()
    fig: Figure
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.8))
    ax_r, ax_h, ax_g, ax_t = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    plotted: list[float] = []
    for i, (label, rows) in enumerate(runs.items()):
        color = colors[i % len(colors)]
        xs, ys = _series(rows, "reward")
        ax_r.plot(xs, ys, color=color, alpha=0.25, lw=1)
        ax_r.plot(xs, _smooth(ys), color=color, lw=2, label=label)
        hx, hy = _series(rows, "heldout/score")
        ax_h.plot(hx, hy, color=color, marker="o", ms=3, lw=1.6, label=label)
        for f in gate_fractions({k for r in rows for k in r}, (gates or {}).get(label)):
            if f.kept:
                continue
            gx, gy = _series(rows, f.key)
            smoothed = _smooth(gy, 3)
            ax_g.plot(gx, smoothed, color=color, ls=_line_style(f), lw=1.4, label=f"{label}: {f.gate}/{f.metric}")
            plotted += smoothed
        tx, ty = _series(rows, "demo/tokens_per_s")
        ax_t.plot(tx, ty, color=color, lw=1.3, label=label)
    ax_r.set_title("Learning signal: training reward (running mean)")
    ax_h.set_title("Held-out score (greedy, unseen fillers)")
    ax_g.set_title("Gate cut fractions (solid high or one-sided / dashed low)")
    for ax in (ax_r, ax_h):
        ax.set_ylim(-0.02, 1.02)
    ax_g.set_ylim(*fraction_axis_limits(plotted))
    ax_t.set_ylim(bottom=0)
    _finish(fig, axes, title, legend_size=7, top=0.93)
    return fig


@requires_extra("plot", "lossplug.demo.plot_compare")
def plot_compare(
    runs: dict[str, list[dict[str, Any]]],
    path: str | Path,
    title: str = "lossplug demo · recipes compared",
    gates: Mapping[str, Sequence[str]] | None = None,
) -> Path:
    """Write ``compare.png`` (:func:`compare_figure`) to ``path``."""
    return _write(compare_figure(runs, title, gates), path)


def _finish(fig: Figure, axes: Iterable[Axes], title: str, *, legend_size: int, top: float) -> None:
    """The finish every demo figure shares: step axes, grids, legends where there is something to label (and none
    yet), title."""
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        if ax.get_legend() is None and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=legend_size, loc="best")
    fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, top))


def _write(fig: Figure, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
