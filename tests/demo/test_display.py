"""The live display lists every gate's cut fractions, a third-party gate's included."""

from __future__ import annotations

import io

import pytest

pytest.importorskip("rich")

from rich.console import Console

from lossplug.demo import FAST
from lossplug.demo.display import LiveDisplay


def final_panel(gates=None) -> str:
    out = io.StringIO()
    display = LiveDisplay(
        "mine", FAST, quiet=False, console=Console(file=out, width=100, color_system=None), gates=gates
    )
    display.start()
    display.update({"step": 0, "heldout/score": 0.0})
    display.update(
        {
            "step": 2,
            "reward": 0.25,
            "lossplug/ppo_clip/clip_frac_low": 0.004,
            "lossplug/ppo_clip/clip_frac_high": 0.012,
            "lossplug/soft_cut/soft_cut_frac": 0.021,
            "lossplug/ppo_clip/active_token_frac": 0.98,
            "lossplug/reward/unscorable_frac": 0.5,
            "lossplug/effective/token_frac": 0.98,
            "lossplug/effective/seq_frac": 1.0,
        }
    )
    display.stop()
    return out.getvalue()


def test_the_panel_has_a_row_for_each_gates_fractions():
    text = final_panel()
    assert "clip fraction" in text and "0.012 0.004" in text and "ppo_clip: high · low" in text
    (row,) = [line for line in text.splitlines() if "soft cut fraction" in line]
    assert "0.021" in row and "soft_cut" in row
    assert "unscorable" not in text and "active token" not in text
    assert "effective rate" in text


def test_named_gates_limit_the_rows():
    text = final_panel(gates=["ppo_clip"])
    assert "clip fraction" in text and "soft cut" not in text
