"""The optional extras: which of lossplug's extras installs which package, and the check that a helper needs one.

``pip install lossplug`` runs the core (recipes, the pipeline, the CLI's ``list``, ``show``, ``validate``…); the
trainers and the plots come with an extra (``[project.optional-dependencies]`` in pyproject.toml). A helper that
needs one calls :func:`require` first, or is decorated with :func:`requires_extra`: where a package is missing it
raises one :class:`~lossplug.MissingExtra` — ``lossplug.demo.run_demo needs trl, which is not installed: pip
install 'lossplug[demo]'`` — instead of a ModuleNotFoundError from deep inside the helper, and before any work is
done (the demo used to train for minutes and then fail on matplotlib). The ``lossplug`` command prints the same
line, with exit code 2 and no traceback.

The check looks packages up (``importlib.util.find_spec``) without importing them: it costs microseconds and imports
neither trainer.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar

if TYPE_CHECKING:
    from lossplug.contracts import MissingExtra

#: each extra → the top-level modules lossplug's code imports from it (tests/core/test_extras.py checks that the
#: extra installs them); ``demo`` is ``trl`` and ``plot`` together
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "trl": ("trl", "transformers", "datasets", "tokenizers", "accelerate"),
    "verl": ("verl", "tensordict", "omegaconf", "hydra"),
    "plot": ("matplotlib",),
    "demo": ("trl", "transformers", "datasets", "tokenizers", "accelerate", "matplotlib"),
}

#: a module → the smallest extra that installs it
EXTRA_OF: dict[str, str] = {
    module: extra for extra in ("demo", "plot", "verl", "trl") for module in EXTRA_MODULES[extra]
}

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that fails to import; a module whose __spec__ is None
        return False


def missing_extra(package: str, extra: str, needed_by: str) -> MissingExtra:
    """The error saying that ``needed_by`` needs ``package``, which ``pip install 'lossplug[extra]'`` installs."""
    from lossplug.contracts import MissingExtra  # (lossplug.contracts imports torch: only when something is missing)

    return MissingExtra(package, extra, needed_by)


def require(extra: str, needed_by: str) -> None:
    """Raise :class:`~lossplug.MissingExtra` naming the first package of ``extra`` (a key of :data:`EXTRA_MODULES`)
    that is not installed; ``needed_by`` is what needs it, as the user called it (``lossplug demo``)."""
    for module in EXTRA_MODULES[extra]:
        if not _installed(module):
            raise missing_extra(module, extra, needed_by)


def requires_extra(extra: str, name: str | None = None) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Decorate a helper that needs ``extra``: it raises :class:`~lossplug.MissingExtra` before it runs when a package
    of the extra is missing, and in place of a ModuleNotFoundError for one of them met while it runs (a package
    installed without a dependency of its own). The traceback is short: the caller's line, and this check.
    ``name``: the helper as users import it (``lossplug.demo.run_demo``), when not where it is defined."""

    def decorate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        needed_by = name or f"{fn.__module__}.{fn.__qualname__}"

        @functools.wraps(fn)
        def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            require(extra, needed_by)
            try:
                return fn(*args, **kwargs)
            except ModuleNotFoundError as err:
                package = (err.name or "").partition(".")[0]
                if package not in EXTRA_MODULES[extra] or isinstance(err, _missing_extra_type()):
                    raise
                raise missing_extra(package, extra, needed_by) from None

        return checked

    return decorate


def _missing_extra_type() -> type[MissingExtra]:
    from lossplug.contracts import MissingExtra

    return MissingExtra
