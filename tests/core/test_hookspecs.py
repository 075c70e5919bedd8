"""Every hook spec is documented: when it is called and what it must return."""

import inspect

from lossplug import hookspecs


def test_every_hookspec_says_when_it_is_called_and_what_it_returns():
    specs = [f for name, f in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("lossplug_")]
    assert len(specs) >= 6
    for spec in specs:
        doc = inspect.getdoc(spec) or ""
        assert "Called" in doc, f"{spec.__name__}: docstring must say when it is called"
        assert "Return" in doc, f"{spec.__name__}: docstring must say what it returns"
