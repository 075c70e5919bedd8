"""The live display of a demo run: a rich panel redrawn at every logging step on a terminal — reward and held-out
sparklines, every gate's cut fractions, effective sample rates, update-ratio quantiles, throughput — and one plain
line per held-out evaluation elsewhere (CI logs, pipes) or with ``quiet``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import groupby
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.live import Live

from .gate_metrics import effective_rate_note, gate_fractions
from .record import mean
from .settings import DemoSettings

_SPARK = "▁▂▃▄▅▆▇█"


def _sparkline(history: Sequence[float | None], width: int = 40, lo: float = 0.0, hi: float = 1.0) -> str:
    """The whole history in at most ``width`` characters (bucket means when longer)."""
    values = [v for v in history if v is not None]
    if len(values) > width:
        edges = [round(i * len(values) / width) for i in range(width + 1)]
        values = [mean(values[a:b]) for a, b in zip(edges, edges[1:])]
    out = []
    for v in values:
        x = (min(max(v, lo), hi) - lo) / (hi - lo) if hi > lo else 0.0
        out.append(_SPARK[min(int(x * len(_SPARK)), len(_SPARK) - 1)])
    return "".join(out)


class LiveDisplay:
    """A rich Live panel on a terminal; elsewhere (CI logs, pipes) or with ``quiet``, one plain line per held-out
    evaluation — and, unless ``quiet``, the final panel once at the end.

    ``gates``: the recipe's gate names, whose fraction metrics get a row each (see :mod:`lossplug.demo.gate_metrics`);
    None takes every gate found in the logs."""

    def __init__(
        self,
        label: str,
        settings: DemoSettings,
        quiet: bool,
        console: Console | None = None,
        gates: Sequence[str] | None = None,
    ) -> None:
        from rich.console import Console

        self.label, self.settings, self.quiet, self.gates = label, settings, quiet, gates
        self.console = console or Console(highlight=False)
        self.animate = not quiet and self.console.is_terminal
        self.live: Live | None = None
        self.stopped = False
        self.t0 = time.perf_counter()
        self.rows: list[dict[str, Any]] = []
        self.heldout: list[tuple[int, float]] = []

    def start(self) -> None:
        self.t0 = time.perf_counter()
        if self.animate:
            from rich.live import Live

            self.live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
            self.live.start()

    def update(self, row: dict[str, Any]) -> None:
        if "reward" in row:
            self.rows.append(row)
        if "heldout/score" in row:
            self.heldout.append((row["step"], row["heldout/score"]))
            if not self.animate:
                self._plain(row)
        if self.live is not None:
            self.live.update(self._render())

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        if self.live is not None:
            self.live.update(self._render())
            self.live.stop()
            self.live = None
        elif not self.quiet:
            self.console.print(self._render())

    def _plain(self, row: dict[str, Any]) -> None:
        last = self.rows[-1] if self.rows else {}
        reward = last.get("reward")
        tps = last.get("demo/tokens_per_s")
        self.console.print(
            f"[{self.label}] step {row['step']:>4}/{self.settings.steps}  "
            f"reward {'—' if reward is None else f'{reward:.3f}'}  "
            f"held-out {row['heldout/score']:.3f}  "
            f"{'' if tps is None else f'{tps:,.0f} tok/s  '}{time.perf_counter() - self.t0:.0f}s",
            markup=False,
            soft_wrap=True,
        )

    def _render(self) -> RenderableType:
        from rich.console import Group
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        s = self.settings
        last = self.rows[-1] if self.rows else {}
        step = last.get("step", 0)
        elapsed = time.perf_counter() - self.t0
        head = Table.grid(expand=True)
        head.add_column(ratio=1)
        head.add_column(justify="right")
        head.add_row(
            Text(f"lossplug demo · recipe {self.label} · task successor · seed {s.seed}", style="bold"),
            Text(f"step {step}/{s.steps} · {elapsed:.0f}s", style="cyan"),
        )
        bar = Table.grid(expand=True)  # a ProgressBar on its own in a Group ends no line: the next row is lost
        bar.add_column(ratio=1)
        bar.add_row(ProgressBar(total=s.steps, completed=step, width=None))

        def fmt(key: str, spec: str = ".3f") -> str:
            v = last.get(key)
            return "—" if v is None else format(v, spec)

        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column(justify="right")
        table.add_column()
        rewards = [r.get("reward") for r in self.rows]
        first = mean(rewards[:3]) if rewards else None
        table.add_row(
            "reward",
            fmt("reward"),
            Text(_sparkline(rewards, width=20), style="green")
            + Text("" if first is None else f"  from {first:.2f}", style="dim"),
        )
        if self.heldout:
            h0, hn = self.heldout[0], self.heldout[-1]
            table.add_row(
                "held-out",
                f"{hn[1]:.3f}",
                Text(_sparkline([h[1] for h in self.heldout], width=20), style="magenta")
                + Text(f"  from {h0[1]:.2f}", style="dim"),
            )
        cut = [f for f in gate_fractions(last, self.gates) if not f.kept]
        for (gate, _), same in groupby(cut, key=lambda f: (f.gate, f.stem)):
            group = list(same)
            sides = [f.side for f in group if f.side]
            table.add_row(
                group[0].label,
                " ".join(fmt(f.key) for f in group),
                Text(f"{gate}: {' · '.join(sides)}" if sides else gate, style="dim"),
            )
        if "lossplug/effective/token_frac" in last:
            note = effective_rate_note(last, self.gates)  # gates whose cuts it counts as kept
            table.add_row(
                "effective rate",
                f"{fmt('lossplug/effective/token_frac')} {fmt('lossplug/effective/seq_frac')}",
                Text("token · sequence" + (f" ({note})" if note else ""), style="yellow" if note else "dim"),
            )
        if "lossplug/ratio/update/p50" in last:
            table.add_row(
                "update ratio",
                " ".join(fmt(f"lossplug/ratio/update/{q}") for q in ("p05", "p50", "p95")),
                Text(f"p05 · p50 · p95, max {fmt('lossplug/ratio/update/max')}", style="dim"),
            )
        if "demo/tokens_per_s" in last:
            table.add_row(
                "tokens/s",
                f"{last['demo/tokens_per_s']:,.0f}",
                Text(f"rollout {fmt('demo/rollout_tokens_per_s', ',.0f')} generated/s", style="dim"),
            )
        if "entropy" in last:
            table.add_row(
                "entropy", fmt("entropy"), Text(f"mean length {fmt('completions/mean_length', '.2f')}", style="dim")
            )
        return Panel(Group(head, bar, table), border_style="blue", width=min(self.console.width, 88))
