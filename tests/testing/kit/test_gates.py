"""The gates' own checks (lossplug.testing.kit.gates): a false ``zero_off_actions`` promise is named as such, with
what to do, instead of a hint about averaging over T positions."""

import lossplug
from lossplug.testing import check_plugin


def only_failure(report, check):
    assert [r.check for r in report.failures] == [check], str(report)
    return report.failures[0]


@lossplug.gate("promised_bonus", requires=("old_logp",))
def promised_bonus(inp, p):
    """A·r + 0.01·r, promising an objective that is +0 off the actions (the bonus is 0.01 there)."""
    ratio = inp.update_log_ratio().clamp(-20, 20).exp()
    return lossplug.GateOutput(objective=inp.advantage * ratio + 0.01 * ratio, zero_off_actions=True, active=inp.mask)


@lossplug.gate("promised_column", requires=("old_logp",))
def promised_column(inp, p):
    """A·r with the advantage as a [B, 1] column (not zero off the actions for a [B] advantage), promising +0 there."""
    ratio = inp.update_log_ratio().clamp(-20, 20).exp()
    return lossplug.GateOutput(objective=inp.broadcast_advantage() * ratio, zero_off_actions=True, active=inp.mask)


@lossplug.gate("kept_promise", requires=("old_logp",))
def kept_promise(inp, p):
    """A·r, +0 off the actions: the cleaned [B, T] advantage is a factor."""
    ratio = inp.update_log_ratio().clamp(-20, 20).exp()
    return lossplug.GateOutput(objective=inp.advantage * ratio, zero_off_actions=True, active=inp.mask)


def test_a_false_zero_off_actions_promise_fails_the_output_contract_naming_the_promise_and_the_fix():
    for gate, layout in ((promised_bonus, "sequence-level"), (promised_column, "sequence-level")):
        report = check_plugin(gate)
        message = only_failure(report, "output_contract").message
        assert "zero_off_actions=True" in message and f"{layout} advantages" in message, message
        assert "inp.on_actions(" in message and "drop zero_off_actions" in message
        assert "average over all T positions" not in str(report)  # the old, wrong hint of masked_layout
        assert len(report.blocked) == 9  # a loss without the pipeline's zero-off: nothing downstream can be trusted


def test_a_kept_zero_off_actions_promise_passes():
    report = check_plugin(kept_promise)
    assert report.ok, str(report)


# ---------------------------------------------------------------------------------------------------------------------
# A gate that never declares `active`: it conforms, with a warning (issue 30: the effective sample rate was silently
# wrong)


@lossplug.gate("cut_without_active", requires=("old_logp",))
def cut_without_active(inp, p):
    """A·r with the ratio capped at 1.3 (no gradient above), declaring no `active`."""
    ratio = inp.update_log_ratio().clamp(-20, 20).exp()
    cut = inp.mask & (ratio > 1.3)
    return lossplug.GateOutput(objective=inp.advantage * ratio.clamp(max=1.3), metrics={"cut_frac": lambda: cut.sum()})


def test_a_gate_that_declares_no_active_conforms_with_a_warning_that_names_it_and_what_to_declare():
    import pytest

    from lossplug.testing import ConformanceWarning, run_as_test

    report = check_plugin(cut_without_active)
    assert report.ok and not report.failures, str(report)
    ((check, text),) = report.warnings
    assert check == "output_contract"
    assert "the gate declares no `active`" in text and "effective/token_frac" in text
    assert "GateOutput(active=" in text and "lambda: inp.mask" in text
    lines = str(report).splitlines()
    assert lines[0].endswith("passes all 12 conformance checks, with 1 warning:")
    assert lines[1].startswith("  ⚠ output_contract: the gate declares no `active`")
    # as a pytest item: a Python warning (pytest's warnings summary), the item passes
    with pytest.warns(ConformanceWarning, match="gate 'cut_without_active' .*, output_contract: the gate declares no"):
        run_as_test(cut_without_active, "output_contract")
    with pytest.warns(ConformanceWarning, match="declares no `active`"):
        lossplug.testing.assert_conforms(cut_without_active, checks=["output_contract"])


def test_every_builtin_gate_declares_active():
    reg = lossplug.registry()
    for name in sorted(reg.plugins["gate"]):
        report = check_plugin(name, kind="gate", checks=["output_contract"])
        assert report.ok and not report.warnings, str(report)
