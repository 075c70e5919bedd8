"""The typo hint: the choice fewest typing edits away, a swap of neighbouring letters counting one — a transposed
name finds its plugin even when another name shares more letters in order ('gpro' → 'grpo', not 'igpo')."""

from __future__ import annotations

import pytest

from lossplug.contracts.errors import did_you_mean


@pytest.mark.parametrize(
    "word, choices, hint",
    [
        ("gpro", ["gigpo", "grpo", "igpo"], "grpo"),  # one swap, where igpo is two edits
        ("ppo_clp", ["cispo", "ppo_clip"], "ppo_clip"),  # one deletion
        ("rlooo", ["grpo", "rloo"], "rloo"),
        ("low_var_kll", ["k3", "low_var_kl", "mse"], "low_var_kl"),
    ],
)
def test_the_closest_name_by_typing_edits_is_suggested(word, choices, hint):
    assert did_you_mean(word, choices) == f" (did you mean '{hint}'?)"


def test_nothing_close_gives_no_hint():
    assert did_you_mean("zzz", ["grpo", "rloo"]) == ""
    assert did_you_mean("grpo", []) == ""
