"""lossplug.testing — the conformance kit for plugin authors.

Run lossplug's invariant suite against any registered plugin (or a plugin object you have not registered yet):

* identical log-probs give ratio 1 (an update gate reduces to the policy gradient ``A``, a correction to weight 1);
* masked positions never influence the loss or the gradient (they are poisoned with NaN, ±inf and 1e30), and
  adding masked columns (a prompt, padding) changes nothing;
* gradient flows only through ``logp``: corrections' weights, metrics and ``active`` are detached, and nothing
  reaches ``old_logp``, ``behavior_logp``, ``ref_logp`` or the advantage;
* zero advantage gives exactly zero gradient;
* log-ratios of ±50…±1000 keep the loss, the gradient and the metrics finite, in fp32 and bf16;
* metrics ``"off"``, ``"basic"`` and ``"full"`` give the same loss and gradient, and ``"basic"``'s metrics are a
  subset of ``"full"``'s with the same values;
* the loss and the gradient are invariant to how the batch is split into micro-batches under a Normalizer;
* parameters are a :class:`lossplug.Params` model with a JSON schema, defaults and descriptions;
* the plugin has a docstring, returns what its kind promises, and runs with only the fields it ``requires``;
* reductions weigh every action token positively; advantages ignore masked positions and follow row shuffles.

Each check runs after the checks it needs; when one of those fails, it does not run and is reported as skipped,
blocked by that failure — one mistake, one failing check.

Three ways to run it::

    # 1. in your test suite (one test per check):
    from lossplug.testing import conformance_tests
    test_my_gate = conformance_tests("my_gate")

    # 2. from pytest, without writing a test (the pytest plugin ships with lossplug; opt-in by this option):
    #    pytest --lossplug-conformance my_gate

    # 3. from Python or the shell:
    lossplug.testing.assert_conforms("my_gate", params={"eps": 0.1})      # raises ConformanceError
    #    lossplug check my_gate

To run your plugin inside a real TRL ``GRPOTrainer`` — offline, on a CPU, in seconds — build one on a tiny local
model with :mod:`lossplug.testing.tiny` (``tiny_grpo_trainer(recipe, tmp_path).train()``).

A check that does not hold for your plugin *by design* (e.g. a gate that deliberately changes the on-policy
gradient) is skipped with a reason: ``conformance_tests("my_gate", skip={"ratio_one": "why"})``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names are resolved lazily (_LAZY)
    from lossplug.kinds import AnyPlugin

    from . import batches, reference, tiny
    from .install import install_isolated
    from .kit import (
        CHECKS,
        CheckResult,
        ConformanceError,
        ConformanceReport,
        ConformanceWarning,
        assert_conforms,
        check_plugin,
        checks_for,
        run_check,
    )

_LAZY = {  # imported on first use, so that loading the pytest plugin costs nothing
    "CHECKS": "kit",
    "CheckResult": "kit",
    "ConformanceError": "kit",
    "ConformanceReport": "kit",
    "ConformanceWarning": "kit",
    "assert_conforms": "kit",
    "check_plugin": "kit",
    "checks_for": "kit",
    "run_check": "kit",
    "install_isolated": "install",
    "batches": None,
    "reference": None,
    "tiny": None,
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'lossplug.testing' has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_LAZY[name] or name}")
    value = module if _LAZY[name] is None else getattr(module, name)
    globals()[name] = value
    return value


def conformance_tests(
    plugin: str | AnyPlugin,
    *,
    kind: str | None = None,
    params: Mapping[str, Any] | None = None,
    skip: Iterable[str] | Mapping[str, str] = (),
) -> Callable[..., None]:
    """A pytest test function, parametrized over every check that applies to ``plugin`` (one test item per check).

    Bind it to a module-level name starting with ``test``::

        test_my_gate = conformance_tests("my_gate")

    If the plugin is not registered (e.g. its distribution is not installed) the returned test fails with the
    reason instead of breaking collection.
    """
    import pytest

    from .kit import checks_for

    reasons = dict(skip) if isinstance(skip, Mapping) else {n: "skipped by the caller" for n in skip}
    try:
        names = checks_for(plugin, kind=kind)
    except (LookupError, TypeError) as err:
        message = str(err)

        def test_lossplug_conformance_unavailable() -> None:
            pytest.fail(message, pytrace=False)

        return test_lossplug_conformance_unavailable

    @pytest.mark.parametrize("check", names)
    def test_lossplug_conformance(check: str) -> None:
        run_as_test(plugin, check, kind=kind, params=params, skip_reason=reasons.get(check))

    return test_lossplug_conformance


def run_as_test(
    plugin: str | AnyPlugin,
    check: str,
    *,
    kind: str | None = None,
    params: Mapping[str, Any] | None = None,
    skip_reason: str | None = None,
) -> CheckResult:
    """Run one check as the body of a pytest test: skipped with a reason, or raising
    :class:`ConformanceError` with the whole report when it fails; its warnings are emitted as
    :class:`ConformanceWarning` (pytest's warnings summary). Returns the :class:`CheckResult`."""
    import pytest

    from .kit import ConformanceError, check_plugin

    if skip_reason:
        pytest.skip(skip_reason)
    report = check_plugin(plugin, kind=kind, params=params, checks=[check])
    result = report.results[0]
    if result.status == "skipped":
        pytest.skip(result.message)
    if result.status == "failed":
        raise ConformanceError(report)
    report.emit_warnings()
    return result


__all__ = [
    "CHECKS",
    "batches",
    "CheckResult",
    "ConformanceError",
    "ConformanceReport",
    "ConformanceWarning",
    "assert_conforms",
    "check_plugin",
    "checks_for",
    "conformance_tests",
    "install_isolated",
    "reference",
    "run_as_test",
    "run_check",
    "tiny",
]
