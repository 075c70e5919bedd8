"""The ``lossplug`` command line (typer + rich). Heavy imports happen inside the commands."""

from __future__ import annotations

from typing import Optional

import typer

app = typer.Typer(help="lossplug — a pluggable, validated loss layer for LLM RL in TRL and verl.",
                  no_args_is_help=True, add_completion=False)


def _console():
    from rich.console import Console

    return Console()


@app.command("list")
def list_cmd(kind: Optional[str] = typer.Option(None, help="only this kind: advantage, gate, reduction, preset")):
    """Plugins by kind, with parameters, defaults and source distribution."""
    from rich.table import Table

    import lossplug
    from lossplug.plugin_registry import registry

    rows = lossplug.list_plugins()
    console = _console()
    kinds = [kind] if kind else ["advantage", "gate", "reduction", "preset"]
    for k in kinds:
        table = Table(title=f"{k}s", title_justify="left", show_lines=False)
        table.add_column("name", style="bold cyan")
        table.add_column("parameters (defaults)")
        table.add_column("source")
        table.add_column("summary")
        for row in rows:
            if row["kind"] != k:
                continue
            params = ", ".join(f"{n}={p['default']!r}" if not p["required"] else f"{n} (required)"
                               for n, p in row["params"].items())
            extra = f" [{row['role']}, {row['level']}]" if row["role"] else ""
            table.add_row(row["name"], params or "—", row["source"], row["summary"] + extra)
        console.print(table)
    broken = registry().broken
    if broken:
        console.print("[bold red]plugins that failed to load:[/]")
        for b in broken:
            console.print(f"  [red]{b}[/]")


@app.command("show")
def show_cmd(name: str = typer.Argument(..., help="plugin or preset name"),
             kind: Optional[str] = typer.Option(None, help="advantage, gate or reduction, if the name is ambiguous")):
    """The formula (docstring), the parameter schema and what the batch must contain."""
    import json

    from lossplug.plugin_registry import KINDS, registry

    reg = registry()
    console = _console()
    found = [(k, reg.plugins[k][name]) for k in KINDS if name in reg.plugins[k] and (kind in (None, k))]
    if not found and name in reg.presets:
        console.print(f"[bold]preset {name}[/] — {reg.presets[name].source}")
        import lossplug

        console.print(lossplug.Recipe.preset(name).to_yaml())
        return
    if not found:
        console.print(f"[red]no plugin or preset named '{name}'[/]")
        raise typer.Exit(1)
    for k, plugin in found:
        console.rule(f"{k} {name}  ({reg.origin(k, name)})")
        import inspect, sys

        module_doc = inspect.getdoc(sys.modules.get(plugin.fn.__module__)) or ""
        console.print(module_doc or plugin.doc)
        if getattr(plugin, "requires", None):
            console.print(f"\n[bold]needs batch fields:[/] {', '.join(plugin.requires)}")
        if getattr(plugin, "role", None):
            console.print(f"[bold]role:[/] {plugin.role}  [bold]level:[/] {plugin.level}")
        console.print("\n[bold]parameters (JSON schema):[/]")
        console.print_json(json.dumps(plugin.params.model_json_schema()))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
