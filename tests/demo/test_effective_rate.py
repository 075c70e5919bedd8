"""Issue 30: a gate that never declares ``active`` silently mis-plotted the effective sample rate — the pipeline counts
its cuts as kept, and the demo drew that rate as if it were measured. The figure and the live table now say which
gate the rate does not see."""

from __future__ import annotations

import pytest

import lossplug
from lossplug.demo.gate_metrics import gates_without_active
from lossplug.testing import batches


@lossplug.gate("cap_without_active", requires=("old_logp",))
def cap_without_active(inp, p):
    """A·min(r, 1.1): no gradient above 1.1, declaring no `active`."""
    ratio = inp.update_log_ratio().clamp(-20, 20).exp()
    cut = inp.mask & (ratio > 1.1)
    return lossplug.GateOutput(
        objective=inp.advantage * ratio.clamp(max=1.1), metrics={"cap_frac": lambda: inp.token_fraction(cut)}
    )


@lossplug.gate("cap_with_active", requires=("old_logp",))
def cap_with_active(inp, p):
    """A·min(r, 1.1): no gradient above 1.1, declaring what it keeps."""
    ratio = inp.update_log_ratio().clamp(-20, 20).exp()
    cut = inp.mask & (ratio > 1.1)
    return lossplug.GateOutput(
        objective=inp.advantage * ratio.clamp(max=1.1),
        metrics={"cap_frac": lambda: inp.token_fraction(cut)},
        active=lambda: inp.mask & ~cut,
    )


def logged_rows(gate, register_gates) -> list[dict]:
    """What the TRL adapter logs at metrics='full' for a recipe of ``gate`` alone: lossplug/<metric> per step."""
    register_gates(gate, name=f"test-{gate.name}")
    recipe = lossplug.Recipe.model_validate({"gates": [gate.name], "reduction": "token"})
    fields = batches.policy_fields(log_ratio_scale=0.4)
    metrics = lossplug.policy_loss(lossplug.PolicyBatch(**fields), recipe, metrics="full").metric_tensors
    row = {f"lossplug/{k}": float(v) for k, v in metrics.items()}
    return [{"step": s, **row} for s in (1, 2)]


def test_without_active_the_pipeline_counts_the_cut_tokens_as_kept_and_the_gate_is_named(register_gates):
    rows = logged_rows(cap_without_active, register_gates)
    assert rows[0]["lossplug/cap_without_active/cap_frac"] > 0.1  # the gate cut tokens…
    assert rows[0]["lossplug/effective/token_frac"] == 1.0  # …which the effective rate counts as kept
    assert gates_without_active(rows[0], ["cap_without_active"]) == ["cap_without_active"]

    rows = logged_rows(cap_with_active, register_gates)
    cut = rows[0]["lossplug/cap_with_active/cap_frac"]
    assert rows[0]["lossplug/effective/token_frac"] == pytest.approx(1 - cut)
    assert gates_without_active(rows[0], ["cap_with_active"]) == []


def test_the_figure_labels_an_effective_rate_that_does_not_see_a_gate(register_gates):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from lossplug.demo.figures import run_figure

    for gate, note in ((cap_without_active, True), (cap_with_active, False)):
        fig = run_figure(logged_rows(gate, register_gates), gates=[gate.name])
        try:
            (panel,) = [ax for ax in fig.axes if ax.get_title().startswith("Gate activity")]
            legend = [t.get_text() for t in panel.get_legend().get_texts()]
            rate = next(label for label in legend if label.startswith("effective sample rate (tokens"))
            if note:
                assert (
                    rate == "effective sample rate (tokens; cap_without_active declares no `active`: counted as kept)"
                )
            else:
                assert rate == "effective sample rate (tokens)"
        finally:
            plt.close(fig)


def test_the_live_table_says_which_gate_the_effective_rate_does_not_see(register_gates):
    pytest.importorskip("rich")
    import io

    from rich.console import Console

    from lossplug.demo import FAST
    from lossplug.demo.display import LiveDisplay

    for gate, note in ((cap_without_active, True), (cap_with_active, False)):
        out = io.StringIO()
        console = Console(file=out, width=160, color_system=None)
        display = LiveDisplay("mine", FAST, quiet=True, console=console, gates=[gate.name])
        for row in logged_rows(gate, register_gates):
            display.update({**row, "reward": 0.5})
        console.print(display._render())
        text = " ".join(out.getvalue().replace("│", " ").split())  # the panel wraps the row's last column
        assert "effective rate 1.000" in text or not note
        assert ("(cap_without_active declares no `active`: counted as kept)" in text) is note, text
