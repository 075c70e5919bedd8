"""The conformance checks and the machinery that runs them — a package per plugin kind.

* :mod:`._common` — what every check shares: the results (:class:`CheckResult`, :class:`ConformanceReport` …), the
  :class:`Subject` under test, the :class:`Check` record and the helpers that build batches and run the pipeline;
* :mod:`.every_kind` — the checks every kind goes through (docstring, parameters, output contract, declared fields,
  masked positions);
* :mod:`.loss_checks` — the checks run through :func:`lossplug.policy_loss` (zero advantage, detached inputs, metric
  levels, extreme log-ratios, micro-batch splits);
* :mod:`.advantages`, :mod:`.gates`, :mod:`.reductions`, :mod:`.regularizers` — each kind's own checks;
* :mod:`.runner` — :data:`CHECKS` (every check, in the order they run) and :func:`check_plugin` and friends.

Each check declares the checks it ``needs`` (next to it, in ``@check(..., needs=...)``); the runner runs them first
and reports a check whose needed check failed as skipped, blocked by that root failure — so one mistake fails one
check. Every output a plugin returns is checked against its kind's contract before the kit reads it; an exception
from the kit's own code is reported as a kit error, never raised.

The modules import one way (``_common`` ← the kinds ← ``every_kind`` / ``loss_checks`` ← ``runner``) and share only
public names. :mod:`lossplug.testing` re-exports what plugin authors use.
"""

from ._common import (
    ATOL,
    BUDGET,
    KINDS,
    RTOL,
    TOKEN_FIELDS,
    Check,
    CheckFailed,
    CheckResult,
    CheckSkipped,
    ConformanceError,
    ConformanceReport,
    ConformanceWarning,
    KitError,
    Run,
    Subject,
    check,
    reference_update_gate,
)
from .runner import CHECKS, assert_conforms, check_plugin, checks_for, needs_for, run_check

__all__ = [
    "ATOL",
    "BUDGET",
    "CHECKS",
    "KINDS",
    "RTOL",
    "TOKEN_FIELDS",
    "Check",
    "CheckFailed",
    "CheckResult",
    "CheckSkipped",
    "ConformanceError",
    "ConformanceReport",
    "ConformanceWarning",
    "KitError",
    "Run",
    "Subject",
    "assert_conforms",
    "check",
    "check_plugin",
    "checks_for",
    "needs_for",
    "reference_update_gate",
    "run_check",
]
