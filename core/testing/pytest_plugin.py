"""lossplug's pytest plugin (entry point ``pytest11: lossplug``): the conformance kit inside pytest.

It does nothing unless asked:

* ``pytest --lossplug-conformance NAME[,NAME…]`` adds one test item per (plugin, check) to the session — no test
  file needed. ``all`` selects every registered plugin, ``third-party`` every plugin that is not built in.
* ``@pytest.mark.lossplug_conformance("my_gate", params={...}, skip=[...])`` on a test that takes a
  ``lossplug_check`` argument parametrizes it over the checks; calling ``lossplug_check()`` runs one.

Each item runs one check, after the checks it needs: when one of those fails, the item is skipped as "blocked by
<check>" (that check's own item fails), so one mistake fails one item.

Nothing from lossplug's plugin machinery is imported or built until one of them is used. Disable the plugin
entirely with ``-p no:lossplug``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from _pytest._code.code import TerminalRepr, TracebackStyle

    from lossplug.kinds import AnyPlugin
    from lossplug.testing.kit import CheckResult

OPTION = "--lossplug-conformance"
MARKER = "lossplug_conformance"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lossplug", "lossplug plugin conformance kit")
    group.addoption(
        OPTION,
        action="append",
        default=[],
        metavar="NAME[,NAME...]",
        help="run lossplug's conformance checks against these registered plugins "
        "('all': every registered plugin, 'third-party': every plugin that is not built in); "
        "a name may be written kind:name when it is ambiguous",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(plugin, kind=None, params=None, skip=()): parametrize a test "
        "taking `lossplug_check` over lossplug's conformance checks for `plugin`",
    )


def _selected(config: pytest.Config) -> list[tuple[str, str]]:
    raw = [n.strip() for value in config.getoption(OPTION) or [] for n in value.split(",") if n.strip()]
    if not raw:
        return []
    import lossplug
    from lossplug.kinds import KINDS
    from lossplug.plugin_registry import BUILTIN_SOURCE

    reg = lossplug.registry()
    out: list[tuple[str, str]] = []
    for item in raw:
        if item in ("all", "third-party"):
            for kind in KINDS:
                for name in sorted(reg.plugins[kind]):
                    if item == "all" or reg.origin(kind, name) != BUILTIN_SOURCE:
                        out.append((kind, name))
            continue
        kind, _, name = item.rpartition(":")
        if kind:
            out.append((kind, name))
        else:
            kinds = [k for k in KINDS if name in reg.plugins[k]]
            out.extend((k, name) for k in (kinds or [""]))
    return list(dict.fromkeys(out))


class ConformanceItem(pytest.Item):
    """One conformance check against one plugin."""

    def __init__(self, *, plugin: str, kind: str, check: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.plugin, self.kind, self.check = plugin, kind, check

    def runtest(self) -> None:
        from lossplug.testing import ConformanceError, check_plugin

        report = check_plugin(self.plugin, kind=self.kind or None, checks=[self.check])
        result = report.results[0]
        if result.status == "skipped":
            pytest.skip(result.message)
        if result.status == "failed":
            raise ConformanceError(report)
        report.emit_warnings()

    def repr_failure(
        self, excinfo: pytest.ExceptionInfo[BaseException], style: TracebackStyle | None = None
    ) -> str | TerminalRepr:
        from lossplug.testing import ConformanceError

        if isinstance(excinfo.value, (ConformanceError, LookupError)):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "lossplug-conformance", None, f"{self.kind} {self.plugin}: {self.check}"


class _Missing(pytest.Item):
    def __init__(self, *, message: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.message = message

    def runtest(self) -> None:
        raise LookupError(self.message)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: TracebackStyle | None = None) -> str:
        return self.message

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "lossplug-conformance", None, self.name


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselection, so those filter our items too
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    selected = _selected(config)
    if not selected:
        return
    from lossplug.testing import checks_for

    for kind, name in selected:
        try:
            checks = checks_for(name, kind=kind or None)
        except (LookupError, TypeError) as err:
            items.append(_Missing.from_parent(session, name=f"lossplug-conformance[{name}]", message=str(err)))
            continue
        for check in checks:
            items.append(
                ConformanceItem.from_parent(
                    session, name=f"lossplug-conformance[{kind}:{name}:{check}]", plugin=name, kind=kind, check=check
                )
            )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker(MARKER)
    if marker is None or "lossplug_check" not in metafunc.fixturenames:
        return
    from lossplug.testing import checks_for

    plugin = marker.args[0] if marker.args else marker.kwargs["plugin"]
    kind = marker.kwargs.get("kind")
    params = marker.kwargs.get("params")
    skip = marker.kwargs.get("skip", ())
    reasons = dict(skip) if isinstance(skip, dict) else {n: "skipped by the marker" for n in skip}
    names = checks_for(plugin, kind=kind)
    metafunc.parametrize("lossplug_check", [_Runner(plugin, kind, params, n, reasons.get(n)) for n in names], ids=names)


class _Runner:
    """The ``lossplug_check`` argument: call it to run one check (fails the test with the kit's message)."""

    def __init__(
        self,
        plugin: str | AnyPlugin,
        kind: str | None,
        params: Mapping[str, Any] | None,
        check: str,
        skip_reason: str | None,
    ) -> None:
        self.plugin, self.kind, self.params, self.check, self.skip_reason = plugin, kind, params, check, skip_reason

    def __call__(self) -> CheckResult:
        from lossplug.testing import run_as_test

        return run_as_test(self.plugin, self.check, kind=self.kind, params=self.params, skip_reason=self.skip_reason)

    def __repr__(self) -> str:
        return f"lossplug_check({self.check!r})"
