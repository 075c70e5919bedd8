"""``lossplug verl``: check a verl PPO config on a CPU box before a cluster job, and print the Hydra overrides that
switch verl to a recipe. The work is :mod:`lossplug.adapters.verl.check`'s, imported when a command runs (it imports
verl and Hydra); this module is wiring and presentation. Exit codes as every command's: 0 — clean; 1 — problems found;
2 — the config, an override or the recipe could not be read, or verl is not installed."""

from __future__ import annotations

import shlex
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, NoReturn

import typer

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

verl_app = typer.Typer(
    help="Check a verl PPO config (and a recipe) before launching, and print the overrides that select lossplug.",
    no_args_is_help=True,
    rich_markup_mode=None,
)

RECIPE_HELP = "A preset name or a recipe YAML/JSON file."


def _console(stderr: bool = False) -> Console:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def _text(s: str, style: str = "") -> Text:
    from rich.text import Text

    return Text(s, style=style)  # config values and messages: never parsed as markup


def _fail(message: str, code: int = 2) -> NoReturn:
    _console(stderr=True).print(_text(f"error: {message}", "bold red"))
    raise typer.Exit(code)


def _check_module() -> ModuleType:
    """:mod:`lossplug.adapters.verl.check`, or one line naming the extra to install."""
    try:
        from lossplug.adapters.verl import check
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] in ("verl", "hydra", "omegaconf"):
            _fail(f"lossplug verl needs verl ({err.name} is not installed): pip install 'lossplug[verl]'")
        raise
    return check


def _lines(overrides: list[str], shell: bool) -> str:
    """One override per line, verbatim (an .overrides file, ``mapfile``), or one shell-quoted command line."""
    if not shell:
        return "\n".join(overrides)
    return " \\\n    ".join(shlex.quote(line) for line in overrides)


@verl_app.command("check")
def check_cmd(
    config: str = typer.Argument(
        ..., metavar="CONFIG", help="A verl config YAML (with or without a defaults list), or a verl config name."
    ),
    overrides: list[str] | None = typer.Argument(  # noqa: B008 (typer's documented style, as in app.py)
        None, metavar="[KEY=VALUE]...", help="Hydra overrides, as on verl's command line (+key=value adds a key)."
    ),
    recipe: str | None = typer.Option(
        None, "--recipe", "-r", metavar="PRESET|FILE", help=f"Switch the config to this recipe. {RECIPE_HELP}"
    ),
    shell: bool = typer.Option(False, "--shell", help="Print the recipe's overrides as one shell-quoted command line."),
) -> None:
    """Compose a verl PPO config as verl's main_ppo does (verl's ppo_trainer defaults, your YAML, the overrides) and
    report unknown or misspelt keys, a KL counted twice, what lossplug's adapter would refuse and recipe fields verl
    will not provide; with --recipe, the config switched to it and the overrides that do so.

    Exit codes: 0 — no problem; 1 — problems found; 2 — the config, an override or the recipe could not be read.
    """
    check = _check_module()
    try:
        report = check.check_config(config, overrides or [], recipe)
    except check.LossplugError as err:
        _fail(str(err))
    console = _console()
    if report.overrides:
        console.print(_text(f"overrides that switch verl to {recipe}", "bold"))
        console.print(_text(_lines(report.overrides, shell)))
        for key, before, after in report.changes:
            console.print(_text(f"  {key}: {before!r} → {after!r}", "dim"))
        console.print()
    for note in report.notes:
        console.print(_text(f"note: {note}", "yellow"))
    if report.ok:
        console.print(_text(f"✓ {config}: no problem found", "bold green"))
        return
    count = len(report.problems)
    console.print(_text(f"✗ {count} problem{'s' if count != 1 else ''} in {config}", "bold red"))
    for problem in report.problems:
        line = _text(f"  {problem.kind}: ", "bold red")
        line.append(problem.where, "bold")
        line.append(f" — {problem.message}")
        console.print(line)
    raise typer.Exit(1)


@verl_app.command("overrides")
def overrides_cmd(
    recipe: str = typer.Argument(..., metavar="PRESET|FILE", help=RECIPE_HELP),
    shell: bool = typer.Option(False, "--shell", help="One shell-quoted command line instead of one per line."),
) -> None:
    """The Hydra overrides that switch verl's default PPO config to the recipe, alone on stdout (one per line, as an
    .overrides file holds them); problems and notes go to stderr. Exit 1 when the recipe cannot run under verl as it
    is, 2 when it cannot be read."""
    check = _check_module()
    source = str(Path(recipe)) if Path(recipe).is_file() else recipe
    try:
        report = check.check_config(check.DEFAULT_CONFIG, recipe=source, verl_actor=False)
    except check.LossplugError as err:
        _fail(str(err))
    typer.echo(_lines(report.overrides, shell))
    errors = _console(stderr=True)
    for note in report.notes:
        if "does not select lossplug" not in note:
            errors.print(_text(f"note: {note}", "yellow"))
    for problem in report.problems:
        errors.print(_text(f"problem: {problem.where}: {problem.message}", "bold red"))
    if not report.ok:
        raise typer.Exit(1)
