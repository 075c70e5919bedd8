"""Every docstring example of the built-in plugins and of the public API runs, as a doctest (issue 30: the
``soft_cut`` example of lossplug.testing.tiny failed the conformance kit it advertises).

The modules: every module under ``lossplug.plugins`` (the entry points of lossplug's ``lossplug`` group among them),
``lossplug`` itself, the module that defines each name of ``lossplug.__all__``, and ``lossplug.testing`` with its
modules. An example is written as a doctest (``>>>``): a code block after ``::`` is not run, so in the built-ins'
docstrings such a block holds formulas only, never code.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.metadata
import inspect
import pkgutil
import re

import pytest

import lossplug
import lossplug.plugins
import lossplug.testing


def builtin_plugin_modules() -> list[str]:
    names = {m.name for m in pkgutil.walk_packages(lossplug.plugins.__path__, "lossplug.plugins.")}
    own = [ep for ep in importlib.metadata.entry_points(group="lossplug") if ep.value.startswith("lossplug.")]
    assert own, "lossplug's own entry points are not installed (pip install -e .)"
    return sorted(names | {ep.module for ep in own})


def public_api_modules() -> list[str]:
    defining = set()
    for name in lossplug.__all__:
        module = inspect.getmodule(getattr(lossplug, name))
        if module is not None and module.__name__.startswith("lossplug"):
            defining.add(module.__name__)
    testing = {m.name for m in pkgutil.walk_packages(lossplug.testing.__path__, "lossplug.testing.")}
    testing -= {"lossplug.testing.pytest_plugin"}  # imports pytest's internals; it has no examples
    return sorted(defining | testing | {"lossplug", "lossplug.testing"})


MODULES = sorted(set(builtin_plugin_modules()) | set(public_api_modules()))
FINDER = doctest.DocTestFinder(exclude_empty=True)
EXAMPLES = {
    test.name: test
    for module in MODULES
    for test in FINDER.find(importlib.import_module(module))
    if test.examples and test.name.startswith(module)  # each docstring once, under the module that defines it
}


def test_the_examples_are_found():
    # the examples issue 30 is about: without them this file would test nothing
    assert {"lossplug.testing.tiny", "lossplug.plugins.gates._rollout_weights"} <= set(EXAMPLES), sorted(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_docstring_example_runs(name):
    test = EXAMPLES[name]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)


def literal_blocks(doc: str) -> list[str]:
    """The blocks of a docstring that follow a line ending in ``::`` and are indented past it (reST literal blocks),
    each up to the first line indented less than its own first line."""
    lines, blocks = inspect.cleandoc(doc).splitlines(), []
    for i, line in enumerate(lines):
        if not line.rstrip().endswith("::"):
            continue
        body = lines[i + 1 :]
        first = next((b for b in body if b.strip()), "")
        indent = len(first) - len(first.lstrip())  # the block's own indent: it ends at the first line indented less
        if indent <= len(line) - len(line.lstrip()):
            continue
        block = []
        for later in body:
            if later.strip() and len(later) - len(later.lstrip()) < indent:
                break
            block.append(later)
        blocks.append("\n".join(block))
    return blocks


@pytest.mark.parametrize("module", builtin_plugin_modules())
def test_a_builtin_plugins_docstring_holds_no_code_that_doctest_would_not_run(module):
    mod = importlib.import_module(module)
    docs = [mod.__doc__ or ""] + [
        obj.__doc__ or ""
        for _, obj in inspect.getmembers(mod, lambda o: inspect.isfunction(o) or inspect.isclass(o))
        if getattr(obj, "__module__", None) == module
    ]
    for doc in docs:
        for block in literal_blocks(doc):
            assert "lossplug." not in block and not re.search(r"^\s*(import|from) \w", block, re.M), (
                f"{module}: a code example after `::` is never run — write it as a doctest (>>>):\n{block}"
            )
