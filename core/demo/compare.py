"""Several recipes on the same seeds (``lossplug demo --compare``): every recipe is checked and a trainer built for
each before the first one trains, then one run folder per recipe and ``compare.png`` / ``compare.json`` beside
them."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lossplug.extras import requires_extra

from .display import LiveDisplay
from .figures import plot_compare
from .record import RunResult, default_out_dir, recipe_label
from .settings import DEFAULT, DemoSettings
from .training import build_trainer, quiet_libraries, run_demo

if TYPE_CHECKING:
    from rich.console import Console


def preflight(recipes: Sequence[tuple[str, Any]], settings: DemoSettings) -> None:
    """Build (not train) a trainer for every ``(label, recipe)``, so that one TRL refuses fails before any run
    starts; raises :class:`lossplug.LossplugError` naming the recipe."""
    import tempfile

    from rich.console import Console

    from lossplug import LossplugError

    with tempfile.TemporaryDirectory(prefix="lossplug-demo-") as tmp, open(os.devnull, "w") as null:
        for label, recipe in recipes:
            display = LiveDisplay(label, settings, True, Console(file=null))
            try:
                build_trainer(
                    recipe, settings.replace(heldout_prompts=10, train_prompts=16), Path(tmp) / label, display
                )
            except LossplugError as err:
                raise LossplugError(f"recipe {label!r}: {err}") from None


@requires_extra("demo", "lossplug.demo.run_compare")
def run_compare(
    recipes: Sequence[Any],
    settings: DemoSettings = DEFAULT,
    out_dir: str | Path | None = None,
    *,
    quiet: bool = False,
    console: Console | None = None,
    on_result: Callable[[RunResult], None] | None = None,
) -> tuple[Path, dict[str, RunResult]]:
    """Train each recipe on the same seeds (same initial model, prompts and sampling seed); one folder per recipe
    under ``out_dir`` and ``compare.png`` with their curves side by side. Returns ``(compare.png, results)``."""
    from lossplug import Recipe, compile_recipe

    labels = [recipe_label(r) for r in recipes]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--compare: recipes must have different names, got {labels}")
    for r in recipes:  # every recipe is checked (and a trainer built) before the first one trains
        compile_recipe(Recipe.load(r))
    with quiet_libraries():
        preflight(list(zip(labels, recipes)), settings)
    out = Path(out_dir) if out_dir is not None else default_out_dir("compare-" + "-".join(labels))
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, RunResult] = {}
    for label, recipe in zip(labels, recipes):
        results[label] = run_demo(recipe, settings, out / label, quiet=quiet, console=console, label=label)
        if on_result is not None:
            on_result(results[label])
    path = plot_compare(
        {k: v.rows for k, v in results.items()},
        out / "compare.png",
        title=f"lossplug demo · task successor · seed {settings.seed} · {settings.steps} steps",
        gates={k: v.summary["gates"] for k, v in results.items()},
    )
    (out / "compare.json").write_text(json.dumps({k: v.summary for k, v in results.items()}, indent=2) + "\n")
    return path, results
