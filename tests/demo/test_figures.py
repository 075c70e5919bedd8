"""The demo's figures show every gate's fraction metrics — a third-party gate's too — on a y-axis fitted to them."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from lossplug.demo.figures import FRACTION_AXIS_FLOOR, compare_figure, fraction_axis_limits, plot_run, run_figure


def synthetic_rows(steps: int = 20) -> list[dict]:
    """A run of a recipe whose gates are ppo_clip and a third-party ``soft_cut``: small fractions, rates near 1 (both
    declare ``active``: their kept fractions are logged)."""
    rows = [{"step": 0, "heldout/score": 0.0}]
    for s in range(2, 2 * steps + 1, 2):
        rows.append(
            {
                "step": s,
                "reward": s / (2 * steps),
                "demo/tokens_per_s": 9000.0 + s,
                "lossplug/ppo_clip/clip_frac_low": 0.001 * (s % 7),
                "lossplug/ppo_clip/clip_frac_high": 0.03 * s / (2 * steps),
                "lossplug/soft_cut/soft_cut_frac": 0.02,
                "lossplug/ppo_clip/active_token_frac": 0.99,
                "lossplug/soft_cut/active_token_frac": 0.98,
                "lossplug/effective/token_frac": 0.97,
                "lossplug/effective/seq_frac": 0.99,
                "lossplug/reward/unscorable_frac": 0.5,
            }
        )
    rows.append({"step": 2 * steps, "heldout/score": 0.8})
    return rows


def axis_titled(fig, start: str):
    (ax,) = [ax for ax in fig.axes if ax.get_title().startswith(start)]
    return ax


def line_labels(ax) -> list[str]:
    return [line.get_label() for line in ax.get_lines()]


def test_the_gate_panel_plots_a_third_party_gates_fraction_on_a_fitted_axis():
    import matplotlib.pyplot as plt

    fig = run_figure(synthetic_rows())
    try:
        ax = axis_titled(fig, "Gate activity")
        assert line_labels(ax) == ["ppo_clip/clip_frac_high", "ppo_clip/clip_frac_low", "soft_cut/soft_cut_frac"]
        largest = max(max(line.get_ydata()) for line in ax.get_lines())
        assert largest == pytest.approx(0.03)
        bottom, top = ax.get_ylim()
        assert largest < top and -0.01 < bottom <= 0
        assert largest / (top - bottom) > 0.5  # fitted to the data (the rest is the legend's room), not a 0–1 axis
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "soft_cut/soft_cut_frac" in legend and "effective sample rate (tokens)" in legend
        # the shares kept, near 1, are on the panel's second axis, which stays 0–1
        (rates,) = [other for other in fig.axes if other is not ax and other.bbox.bounds == ax.bbox.bounds]
        assert line_labels(rates) == [
            "effective sample rate (tokens)",
            "effective sample rate (sequences)",
            "ppo_clip/active_token_frac",  # with two gates, each one's kept fraction tells them apart
            "soft_cut/active_token_frac",
        ]
        assert rates.get_ylim()[1] > 1
        assert "unscorable" not in " ".join(legend)  # lossplug's own reward metric is no gate's
    finally:
        plt.close(fig)


def test_only_the_recipes_gates_are_plotted_when_named(tmp_path):
    import matplotlib.pyplot as plt

    fig = run_figure(synthetic_rows(), gates=["soft_cut"])
    try:
        assert line_labels(axis_titled(fig, "Gate activity")) == ["soft_cut/soft_cut_frac"]
    finally:
        plt.close(fig)
    assert plot_run(synthetic_rows(), tmp_path / "curves.png").stat().st_size > 20_000


def test_the_comparison_plots_every_gates_fractions_per_recipe():
    import matplotlib.pyplot as plt

    rows = synthetic_rows()
    only_ppo = [{k: v for k, v in r.items() if "soft_cut" not in k} for r in rows]
    fig = compare_figure({"mine": rows, "dapo": only_ppo}, gates={"dapo": ["ppo_clip"]})
    try:
        ax = axis_titled(fig, "Gate cut fractions")
        assert "mine: soft_cut/soft_cut_frac" in line_labels(ax)
        assert "dapo: ppo_clip/clip_frac_high" in line_labels(ax)
        assert 0.03 < ax.get_ylim()[1] < 0.05
    finally:
        plt.close(fig)


def test_fraction_axis_limits_have_a_floor_and_a_margin():
    assert (
        fraction_axis_limits([])
        == fraction_axis_limits([0.0, 0.0])
        == (-0.03 * FRACTION_AXIS_FLOOR, FRACTION_AXIS_FLOOR)
    )
    bottom, top = fraction_axis_limits([0.0, 0.2, None])
    assert top == pytest.approx(0.23) and bottom < 0
    assert fraction_axis_limits([1.0])[1] == 1.05
