"""The run record: where a run folder goes (:func:`default_out_dir`), what a recipe is called there
(:func:`recipe_label`), what ``summary.json`` holds (:func:`summarise`) and what a run returns (:class:`RunResult`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lossplug import Recipe

from .settings import LEARNED_MARGIN, DemoSettings
from .task import SuccessorTask

#: what a run folder holds when the run finished
RUN_FILES = ("recipe.yaml", "provenance.json", "versions.json", "metrics.jsonl", "summary.json", "curves.png")


def default_out_dir(label: str, root: str | Path = "runs") -> Path:
    """``runs/<timestamp>-<label>/`` (the label made file-name safe)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-") or "run"
    return Path(root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{safe}"


def recipe_label(recipe: Recipe | Mapping[str, Any] | str | Path) -> str:
    """A short name for a recipe argument: the preset name, the file stem, or the recipe's own name."""
    from lossplug import Recipe

    if isinstance(recipe, (str, Path)) and str(recipe).endswith((".yaml", ".yml", ".json")):
        return Path(recipe).stem
    if isinstance(recipe, str) and "\n" not in recipe and ":" not in recipe:
        return recipe
    return Recipe.load(recipe).name or "recipe"


def finite_or_none(value: Any) -> Any:
    """``value``, except NaN and ±inf become None (JSON has no spelling for them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def mean(xs: Sequence[float | None]) -> float:
    """The mean of the values that are not None (NaN when there are none)."""
    values = [x for x in xs if x is not None]
    return sum(values) / len(values) if values else float("nan")


@dataclass
class RunResult:
    """What :func:`lossplug.demo.run_demo` returns: the folder, the summary (also in ``summary.json``) and the metric
    rows (also in ``metrics.jsonl``)."""

    out_dir: Path
    summary: dict[str, Any]
    rows: list[dict[str, Any]]

    @property
    def learned(self) -> bool:
        return bool(self.summary["learned"])


def summarise(
    label: str,
    recipe: Recipe,
    settings: DemoSettings,
    task: SuccessorTask,
    rows: list[dict[str, Any]],
    wall: float,
    cpu: float,
    threads: int,
) -> dict[str, Any]:
    """``summary.json``: reward start/end, held-out before/after, whether the run learned, time, settings."""
    rewards = [r["reward"] for r in rows if r.get("reward") is not None]
    k = max(1, min(3, len(rewards) // 5))
    heldout = [r for r in rows if r.get("heldout/score") is not None]
    tps = [r["demo/tokens_per_s"] for r in rows if r.get("demo/tokens_per_s") is not None]
    start, end = (mean(rewards[:k]), mean(rewards[-k:])) if rewards else (None, None)
    before, after = heldout[0], heldout[-1]
    # (start and end are set when there are rewards)
    learned = bool(
        rewards
        and end - start > LEARNED_MARGIN  # type: ignore[operator]
        and after["heldout/score"] > before["heldout/score"]
    )
    return {
        "recipe": label,
        "recipe_name": recipe.name,
        "task": task.name,
        "task_description": task.description,
        "learned": learned,
        "reward": {
            "start": start,
            "end": end,
            "first": rewards[0] if rewards else None,
            "last": rewards[-1] if rewards else None,
            "max": max(rewards) if rewards else None,
            "averaged_over_logs": k,
        },
        "heldout": {
            "before": before["heldout/score"],
            "after": after["heldout/score"],
            "prompts": settings.heldout_prompts,
            "what": "greedy decoding, fraction answered correctly",
        },
        "provenance": "behaviour = old (TRL samples with the training model via transformers generate); no "
        "reference policy (beta = 0, no KL term): see provenance.json",
        "gates": [gate.name for gate in recipe.gates],
        "steps": settings.steps,
        "wall_s": wall,
        "cpu_s": cpu,
        "torch_threads": threads,
        "tokens_per_s_mean": mean(tps) if tps else None,
        "settings": dataclasses.asdict(settings),
        "files": list(RUN_FILES),
    }
