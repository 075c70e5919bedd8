"""The kit's runner (lossplug.testing.kit.runner): checks run after the checks they need, so one mistake fails one
check and the checks that rely on it are skipped as blocked by it; nothing a plugin does makes the kit raise; the
``requires=`` hint appears only for a missing declaration."""

import pytest
import torch

import lossplug
from lossplug.testing import CHECKS, ConformanceError, check_plugin, run_as_test
from lossplug.testing.kit import Check, KitError, runner


def only_failure(report, check):
    """The report's one failure, which must be ``check`` (and not a kit error)."""
    assert [r.check for r in report.failures] == [check], str(report)
    assert not [r for r in report.results if r.kit_error], str(report)
    return next(r for r in report.failures)


def blocked_by(report, check):
    return [r.check for r in report.results if r.blocked_by == (check,)]


# ---------------------------------------------------------------------------------------------------------------------
# The two cases from issue 23


@lossplug.gate("grad_weight", requires=("behavior_logp",), role="correction")
def grad_weight(inp, p):
    """min(π_θ/π_behaviour, 2), but computed from logp without detaching it."""
    return lossplug.GateOutput(weight=(inp.logp - inp.behavior_logp).clamp(-20, 20).exp().clamp(max=2.0))


@lossplug.gate("objective_correction", requires=("old_logp", "behavior_logp"), role="correction")
def objective_correction(inp, p):
    """A truncated engine ratio, returned as an objective instead of a weight."""
    return lossplug.GateOutput(objective=inp.engine_log_ratio().clamp(-20, 20).exp().clamp(max=2.0) * inp.logp)


def test_an_undetached_correction_weight_fails_detached_alone_and_blocks_what_runs_the_pipeline():
    report = check_plugin(grad_weight)
    failure = only_failure(report, "detached")
    assert "weight carries gradient" in failure.message and ".detach()" in failure.message
    dependents = blocked_by(report, "detached")
    assert {"requires_declared", "metric_levels", "masked_poison", "zero_advantage", "ratio_one"} <= set(dependents)
    assert len(dependents) == 8  # every check after output_contract
    for r in report.blocked:
        assert r.status == "skipped" and not r.ok and r.message.startswith("blocked by detached")
    assert {r.check for r in report.results if r.status == "passed"} == {
        "docstring",
        "params_schema",
        "output_contract",
    }
    text = str(report)  # the unrelated hint of issue 23 is gone
    assert "requires=" not in text and "declare every optional" not in text
    assert "failed 1 of 12 conformance checks; 8 more did not run, blocked by a failure:" in text
    assert "  – blocked by detached: metric_levels, requires_declared, masked_poison" in text


def test_each_blocked_row_is_one_line_that_names_its_root_without_repeating_its_message():
    """Issue 30: every blocked row of a report (`lossplug check`'s table) repeated the root failure's text; the root's
    row says it once, each blocked row one line that points to it."""
    report = check_plugin(grad_weight)
    root = only_failure(report, "detached").message
    for r in report.blocked:
        assert "\n" not in r.message and r.message == "blocked by detached, which failed (its row is above)"
        assert root.split(":")[0] not in r.message
    # run alone, the root is not in the report: the blocked row carries the reason
    (alone,) = check_plugin(grad_weight, checks=["masked_poison"]).results
    assert "weight carries gradient" in alone.message


def test_a_correction_returning_an_objective_fails_the_output_contract_naming_the_rule_and_the_kit_does_not_raise():
    report = check_plugin(objective_correction)
    failure = only_failure(report, "output_contract")
    assert "a token-level correction must set weight [6, 10], got None" in failure.message
    assert "a correction sets weight, not objective" in failure.message
    assert len(blocked_by(report, "output_contract")) == 9
    assert "NoneType" not in str(report)


# ---------------------------------------------------------------------------------------------------------------------
# Other typical mistakes: one root failure each


@lossplug.gate("keepdim_weight", requires=("old_logp", "behavior_logp"), role="correction", level="sequence")
def keepdim_weight(inp, p):
    """A sequence-level engine ratio summed with keepdim=True: a [B, 1] weight."""
    log_ratio = inp.engine_log_ratio().sum(-1, keepdim=True)
    return lossplug.GateOutput(weight=log_ratio.clamp(-20, 20).exp().clamp(max=2.0))


@lossplug.gate("raw_batch_mean", requires=("old_logp",), level="sequence")
def raw_batch_mean(inp, p):
    """A sequence ratio from the raw (detached) batch, masked by multiplication: NaN off the actions leaks."""
    log_ratio = ((inp.logp - inp.batch.old_logp.detach()) * inp.mask).sum(-1) / inp.lengths
    return lossplug.GateOutput(objective=log_ratio.clamp(-20, 20).exp().unsqueeze(-1) * inp.advantage)


@lossplug.gate("raw_batch_ratio", requires=("old_logp",))
def raw_batch_ratio(inp, p):
    """r·A with the old log-probs read from the raw batch (not detached, not cleaned)."""
    ratio = torch.where(inp.mask, inp.logp - inp.batch.old_logp, 0).clamp(-20, 20).exp()
    return lossplug.GateOutput(objective=ratio * inp.advantage)


@lossplug.advantage("column_advantage", requires=("reward",))
def column_advantage(batch, p):
    """Centred sequence rewards, returned as a [B, 1] column."""
    reward = batch.reward if batch.reward.ndim == 1 else torch.where(batch.action_mask, batch.reward, 0).sum(-1)
    return (reward - reward.mean()).unsqueeze(-1)


@lossplug.advantage("value_baseline", requires=("reward", "value"))
def value_baseline(batch, p):
    """Reward minus the response's summed value, masked by multiplication (the raw batch's NaN off actions leaks)."""
    reward = batch.reward if batch.reward.ndim == 1 else torch.where(batch.action_mask, batch.reward, 0).sum(-1)
    return reward - (batch.value * batch.action_mask).sum(-1)


@lossplug.reduction("every_position_mean")
def every_position_mean(objective, mask, lengths, population, p):
    """Mean over every position of the micro-batch, masked ones included."""
    return objective.mean()


@pytest.mark.parametrize(
    "plugin,root,phrase,n_blocked",
    [
        (
            keepdim_weight,
            "output_contract",
            "a sequence-level correction must set weight [6], got torch.float64 [6, 1]",
            9,
        ),
        (raw_batch_mean, "masked_poison", "reads the raw batch (inp.batch.*) or masks by multiplication", 5),
        (raw_batch_ratio, "detached", "gradient reached old_logp", 8),
        (column_advantage, "output_contract", "have shape [6, 1], expected one of [[6], [6, 10]]", 4),
        (value_baseline, "masked_poison", "the advantages are not finite", 1),
        (every_position_mean, "masked_layout", "average over all T positions instead of the action tokens", 1),
    ],
    ids=lambda v: getattr(v, "name", None),
)
def test_a_typical_mistake_fails_one_check_and_blocks_its_dependents(plugin, root, phrase, n_blocked):
    report = check_plugin(plugin)
    assert phrase in only_failure(report, root).message
    assert len(report.blocked) == n_blocked and all(r.blocked_by == (root,) for r in report.blocked), str(report)


def test_a_finding_that_leaves_the_loss_computable_blocks_nothing():
    """Metrics that carry gradient fail detached, but the checks that need it run (and here pass)."""

    @lossplug.gate("graph_metric_only")
    def graph_metric_only(inp, p):
        """A·logp, with a metric that keeps the graph."""
        objective = inp.advantage * inp.logp
        return lossplug.GateOutput(objective=objective, metrics={"objective_mean": inp.masked_mean(objective)})

    report = check_plugin(graph_metric_only)
    assert "objective_mean carry gradient" in only_failure(report, "detached").message
    assert not report.blocked
    assert all(r.status == "passed" for r in report.results if r.check != "detached")


def test_parameters_that_do_not_build_block_everything_a_missing_description_blocks_nothing():
    class Eps(lossplug.Params):
        eps: float  # neither a default nor a description

    @lossplug.gate("needs_eps", params=Eps)
    def needs_eps(inp, p):
        """A·logp·eps."""
        return lossplug.GateOutput(objective=inp.advantage * inp.logp * p.eps)

    without = check_plugin(needs_eps)
    assert "do not validate" in only_failure(without, "params_schema").message
    assert len(blocked_by(without, "params_schema")) == 10
    with_eps = check_plugin(needs_eps, params={"eps": 1.0})
    assert "eps have no default" in only_failure(with_eps, "params_schema").message
    assert not with_eps.blocked


# ---------------------------------------------------------------------------------------------------------------------
# Nothing a plugin does makes the kit raise


def _gate(name, body, **kw):
    return lossplug.gate(name, **kw)(body)


B, T = 6, 10
WEIRD = [
    ("returns_none", lambda inp, p: None, {}, "must return lossplug.GateOutput, got NoneType"),
    ("returns_tensor", lambda inp, p: inp.logp, {}, "must return lossplug.GateOutput, got Tensor"),
    ("raises", lambda inp, p: 1 / 0, {}, "raised ZeroDivisionError"),
    ("row_objective", lambda inp, p: lossplug.GateOutput(objective=inp.logp.sum(-1)), {}, "objective [B, T]"),
    (
        "int_weight",
        lambda inp, p: lossplug.GateOutput(weight=torch.ones(B, T, dtype=torch.int64)),
        {"role": "correction"},
        "weight must be a float tensor",
    ),
    (
        "list_metrics",
        lambda inp, p: lossplug.GateOutput(objective=inp.advantage * inp.logp, metrics=[1.0]),
        {},
        "metrics must be a mapping",
    ),
    (
        "negative_weight",
        lambda inp, p: lossplug.GateOutput(weight=-torch.ones(B, T, dtype=torch.float64)),
        {"role": "correction"},
        "finite and ≥ 0 on action tokens",
    ),
]


@pytest.mark.parametrize("name,body,kw,phrase", WEIRD, ids=[w[0] for w in WEIRD])
def test_a_malformed_output_is_one_output_contract_failure_never_a_kit_exception(name, body, kw, phrase):
    body.__doc__ = "A malformed gate."
    report = check_plugin(_gate(name, body, **kw))  # returns: never raises
    assert phrase in only_failure(report, "output_contract").message
    assert all(r.blocked_by == ("output_contract",) for r in report.results if r.status == "skipped")
    assert {r.check for r in report.results if r.status == "passed"} == {"docstring", "params_schema"}


def test_an_output_that_changes_with_the_inputs_is_checked_at_every_call():
    """Right on the kit's ordinary batch, wrong at ratio 1: ratio_one reports the rule instead of crashing on it."""

    @lossplug.gate("objective_on_policy", requires=("old_logp", "behavior_logp"), role="correction")
    def objective_on_policy(inp, p):
        """A truncated engine ratio, but an objective when every ratio is 1."""
        log_ratio = inp.engine_log_ratio()
        if not bool(log_ratio.any()):
            return lossplug.GateOutput(objective=inp.logp)
        return lossplug.GateOutput(weight=log_ratio.clamp(-20, 20).exp().clamp(max=2.0))

    failure = only_failure(check_plugin(objective_on_policy), "ratio_one")
    assert failure.message.startswith("with old_logp = behavior_logp = logp: a token-level correction must set weight")


def test_an_exception_from_the_kit_itself_is_reported_as_a_kit_error(monkeypatch):
    from lossplug.testing.kit import _common

    def broken_check(subject):
        _common.first_diff(torch.zeros(2), torch.zeros(3))  # raises inside the kit's own code

    monkeypatch.setitem(CHECKS, "docstring", Check("docstring", CHECKS["docstring"].kinds, "a summary", broken_check))
    (result,) = check_plugin("reinforce", kind="gate", checks=["docstring"]).results
    assert result.status == "failed" and result.kit_error
    assert "the conformance kit itself raised RuntimeError" in result.message
    assert "a bug in lossplug.testing, not a verdict on the plugin" in result.message

    def setup_error(subject):
        raise KitError("the kit's batch is wrong")

    monkeypatch.setitem(CHECKS, "docstring", Check("docstring", CHECKS["docstring"].kinds, "a summary", setup_error))
    report = check_plugin("reinforce", kind="gate", checks=["docstring"])
    assert report.results[0].kit_error and "  ! docstring — a summary" in str(report)


# ---------------------------------------------------------------------------------------------------------------------
# The requires= hint: only for a missing declaration


def test_the_requires_hint_names_the_field_it_reads():
    @lossplug.gate("reads_ref", requires=("old_logp",))
    def reads_ref(inp, p):
        """r·A, with a metric that reads ref_logp without declaring it."""
        ratio = inp.update_log_ratio().clamp(-20, 20).exp()
        return lossplug.GateOutput(
            objective=ratio * inp.advantage, metrics={"ref_gap": lambda: inp.masked_mean(inp.old_logp - inp.ref_logp)}
        )

    message = only_failure(check_plugin(reads_ref, kind="gate"), "requires_declared").message
    assert "it runs once ref_logp is added, so it reads ref_logp without declaring it: add it to requires=" in message


def test_a_failure_that_is_not_about_requires_gets_no_requires_hint():
    @lossplug.gate("always_raises")
    def always_raises(inp, p):
        """Raises, whatever the batch holds."""
        raise RuntimeError("not implemented yet")

    # with what requires_declared needs skipped by the caller, it runs on a plugin that fails with every field too
    needed = {c: "run requires_declared alone" for c in ("output_contract", "detached", "metric_levels")}
    (result,) = check_plugin(always_raises, checks=["requires_declared"], skip=needed).results
    assert result.status == "failed"
    assert (
        "with every field present it raises too" in result.message and "not about undeclared fields" in result.message
    )
    assert "add it to requires" not in result.message


# ---------------------------------------------------------------------------------------------------------------------
# The order, declared once; a check run alone runs what it needs


def test_each_check_needs_only_checks_listed_before_it():
    seen = set()
    for name, c in CHECKS.items():
        assert set(c.needs) <= seen, name
        seen.add(name)
    broken = {"a": Check("a", ("gate",), "", lambda s: None, needs=("b",)), "b": Check("b", ("gate",), "", print)}
    with pytest.raises(RuntimeError, match="needs \\['b'\\], which are not listed before it"):
        runner._check_order(broken)


def test_a_needed_check_of_another_kind_stands_in_for_what_it_needs():
    # masked_poison needs detached and metric_levels (gates and regularizers): for a reduction, their own need
    assert runner.needs_for("masked_poison", "reduction") == ("output_contract",)
    assert runner.needs_for("masked_poison", "gate") == ("output_contract", "detached", "metric_levels")


def test_a_check_run_alone_is_blocked_when_what_it_needs_fails():
    report = check_plugin(grad_weight, checks=["masked_poison"])
    (result,) = report.results
    assert result.status == "skipped" and result.blocked_by == ("detached",) and not report.ok
    assert result.message.startswith("blocked by detached, which fails: the correction's weight carries gradient")
    assert str(report).splitlines()[1].startswith("  – masked_poison: blocked by detached, which fails:")
    with pytest.raises(ConformanceError, match="did not run, blocked by a failing check"):
        report.raise_for_failures()
    # as a pytest item (conformance_tests, the marker, --lossplug-conformance): skipped with the reason
    with pytest.raises(pytest.skip.Exception, match="blocked by detached"):
        run_as_test(grad_weight, "masked_poison")


def test_a_check_skipped_by_the_caller_blocks_nothing():
    report = check_plugin(grad_weight, skip={"detached": "the weight is differentiated on purpose"})
    skipped = next(r for r in report.results if r.check == "detached")
    assert (skipped.status, skipped.blocked_by) == ("skipped", ())
    # its dependents run: the first of them meets the pipeline's refusal, reported as its own failure
    assert not blocked_by(report, "detached")
    assert "must be detached" in only_failure(report, "metric_levels").message


@pytest.mark.filterwarnings("ignore:.*declares no `active`")  # grad_weight's other finding, beside the point here
def test_the_items_of_a_blocked_plugin_fail_once_and_skip_the_rest():
    """One pytest item per check (what conformance_tests makes): one fails, the ones that need it are skipped."""
    outcomes = {}
    for check in runner.checks_for(grad_weight):
        try:
            run_as_test(grad_weight, check)
            outcomes[check] = "passed"
        except pytest.skip.Exception:
            outcomes[check] = "skipped"
        except ConformanceError:
            outcomes[check] = "failed"
    assert [c for c, o in outcomes.items() if o == "failed"] == ["detached"]
    assert sum(o == "skipped" for o in outcomes.values()) == 8


def test_the_pytest_plugin_fails_the_root_item_and_skips_the_blocked_ones(register_gates, tmp_path):
    class Outcomes:
        def __init__(self):
            self.by_item = {}

        def pytest_runtest_logreport(self, report):
            if report.when == "call" or report.skipped:
                self.by_item[report.nodeid.rpartition(":")[2].rstrip("]")] = (report.outcome, report.longrepr)

    register_gates(grad_weight, name="pytest-blocked")
    outcomes = Outcomes()
    args = ["-q", "-p", "no:randomly", "-p", "no:cacheprovider", "--lossplug-conformance", "grad_weight", str(tmp_path)]
    assert pytest.main(args, plugins=[outcomes]) == pytest.ExitCode.TESTS_FAILED
    by_outcome = {}
    for check, (outcome, _) in outcomes.by_item.items():
        by_outcome.setdefault(outcome, []).append(check)
    assert by_outcome["failed"] == ["detached"]
    assert len(by_outcome["skipped"]) == 8 and sorted(by_outcome["passed"]) == [
        "docstring",
        "output_contract",
        "params_schema",
    ]
    reason = outcomes.by_item["masked_poison"][1][2]  # a skip's longrepr: (path, line, reason)
    assert reason.startswith("Skipped: blocked by detached, which fails: the correction's weight carries gradient")


def _closure(names):
    out = set()
    for n in names:
        out |= {n} | _closure(CHECKS[n].needs)
    return out


def test_the_tutorial_lists_what_each_check_needs():
    """docs/write-a-gate.md's table of the check order gives each check's direct needs (those not implied by another)."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[3] / "docs" / "write-a-gate.md").read_text()
    block = text.split("check                                      needs", 1)[1].split("```", 1)[0]
    rows = []  # [names, needs]
    for line in block.strip("\n").splitlines()[1:]:
        if line.startswith("  "):  # more names of the row above
            rows[-1][0] += " " + line.strip()
        else:
            rows.append(re.split(r"\s{2,}", line.strip(), maxsplit=1))
    documented = {}
    for names, needs in rows:
        for name in re.split(r",\s*", names.strip(", ")):
            documented[name] = {n for n in needs.split(" (", 1)[0].split(", ") if n != "—"}
    direct = {
        name: {n for n in c.needs if not any(n in _closure([m]) for m in c.needs if m != n)}
        for name, c in CHECKS.items()
    }
    assert documented == direct
