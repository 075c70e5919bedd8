"""MkDocs hook (``hooks:`` in mkdocs.yml): the pages that are generated from the code on every build, so they cannot
drift from it, and links from the docs to files of the repository outside ``docs/``.

* ``catalogue.md`` — every built-in plugin, from the registry (:func:`lossplug.cli.describe.catalogue_markdown`); a
  built-in without a formula, a parameter description or a citation is a warning, which ``--strict`` turns into a
  failed build (``tests/docs/test_catalogue.py`` checks the same without building).
* ``cli.md`` — the ``lossplug`` command line, from the Typer app (Typer's own Markdown renderer).
* ``api/lossplug.md`` — mkdocstrings directives for every name of ``lossplug.__all__``, grouped by defining module.
* ``<!-- generated: trl_equivalent -->`` in a page becomes the table of what
  :func:`lossplug.adapters.trl.trl_equivalent` returns for each TRL ``loss_type`` and each loss option (TRL's
  ``GRPOConfig`` defaults otherwise).
* ``<!-- generated: batch_fields -->`` becomes a table of every field of ``PolicyBatch`` and ``PackedTransitions``
  (shape, kind, log-prob source, rules, description), from each field's one declaration (its ``TensorField``,
  ``SPECS``) and the contract's rule table (``field_rules``) — the same source as ``lossplug schema``.
* ``<!-- generated: trl_unfed -->`` becomes the table of what TRL cannot feed a recipe, from the rows the TRL
  adapter's refusals quote (:func:`lossplug.adapters.trl.refusals.unfed_markdown`).
* mkdocstrings reads the sources statically (griffe), which cannot follow the ``package-dir`` mapping of
  pyproject.toml (``lossplug`` = ``core/``, ``lossplug.contracts`` = ``contracts/``…): :func:`on_config` lays the
  package out as it is installed — a temporary folder of symbolic links — and puts it first on the handler's paths.
* Sphinx roles in docstrings (``:class:`~lossplug.Normalizer```), which mkdocstrings leaves as text before the code
  span, are dropped from the rendered pages (:func:`on_page_content`).
* A relative link to a repository file outside ``docs/`` (``../core/hookspecs.py``) must name an existing file (else
  a warning, so ``--strict`` fails); it points to ``repo_url``'s ``blob/main/`` when mkdocs.yml sets ``repo_url``, and
  becomes its plain text otherwise.

Written for mkdocs ≥ 1.6 (``File.generated``): one file and no plugin dependency, rather than mkdocs-gen-files.

A figure that committed Markdown states — the README's test count, its benchmark figures — cannot wait for a build,
since the README is read where it lies: it is written ``<!-- figure: NAME -->VALUE<!-- /figure -->`` and checked by
``figures.py`` beside this file (the standard library only, so that ``tests/conftest.py`` can load it without mkdocs).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import re
import shutil
import tempfile
import types
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.generated")


def catalogue_page() -> str:
    from lossplug.cli.describe import catalogue_markdown, catalogue_problems

    for problem in catalogue_problems():
        log.warning("plugin catalogue: %s", problem)
    return catalogue_markdown()


def cli_page() -> str:
    import click
    import typer
    from typer.cli import get_docs_for_click

    from lossplug.cli import app

    command = typer.main.get_command(app)
    text = get_docs_for_click(
        obj=command, ctx=click.Context(command, info_name="lossplug"), name="lossplug", title="Command line"
    )
    intro = (
        "Generated from the Typer app (`lossplug.cli`) when the documentation is built: the same text as "
        "`lossplug COMMAND --help`.\n\n"
    )
    head, _, rest = text.partition("\n\n")
    return f"{head}\n\n{intro}{rest}"


def api_page() -> str:
    import lossplug

    modules: dict[str, list[str]] = {}
    prose = []
    for name in lossplug.__all__:
        obj = getattr(lossplug, name)
        module = getattr(obj, "__module__", "") or ""
        if module.startswith("lossplug") and getattr(obj, "__name__", None) == name:
            modules.setdefault(module, []).append(name)
        else:
            prose.append(name)
    out = [
        "# `lossplug`",
        "",
        "Generated from `lossplug.__all__` when the documentation is built: every public name of the package, "
        "documented where it is defined. `import lossplug` resolves them lazily (PEP 562), so importing the "
        "package stays cheap.",
        "",
    ]
    if "hookimpl" in prose:
        out += [
            "`lossplug.hookimpl` — the pluggy marker of hook implementations: "
            "`@lossplug.hookimpl def lossplug_register_gates(register): ...` (see [Plugin hooks](../plugin-hooks.md)).",
            "",
        ]
        prose.remove("hookimpl")
    for name in prose:
        out += [f"`lossplug.{name}`", ""]
    for module in sorted(modules):
        members = "".join(f"\n        - {n}" for n in sorted(modules[module]))
        out += [
            f"## `{module}`",
            "",
            f"::: {module}",
            "    options:",
            "      show_root_heading: false",
            "      heading_level: 3",
            f"      members:{members}",
            "",
        ]
    return "\n".join(out)


def trl_equivalent_table() -> str:
    from trl import GRPOConfig

    from lossplug.adapters.trl import trl_equivalent

    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.default is not dataclasses.MISSING}
    cispo = {"epsilon_high": 5.0}  # TRL's recommended value for cispo (its default would cap at 0.2)
    cases: list[tuple[str, dict[str, object]]] = [
        (f"`loss_type={t}`", {"loss_type": t}) for t in ("grpo", "bnpo", "dr_grpo", "dapo", "sapo", "luspo", "vespo")
    ]
    cases[4:4] = [("`loss_type=cispo` (`epsilon_high=5.0`)", {"loss_type": "cispo", **cispo})]
    cases += [
        ("`importance_sampling_level=sequence` (grpo)", {"importance_sampling_level": "sequence"}),
        ("… with `delta=1.5`", {"importance_sampling_level": "sequence", "delta": 1.5}),
        ("`cispo`, sequence level", {"loss_type": "cispo", "importance_sampling_level": "sequence", **cispo}),
        ("`sapo`, sequence level", {"loss_type": "sapo", "importance_sampling_level": "sequence"}),
        ("`off_policy_mask_threshold=0.5`", {"off_policy_mask_threshold": 0.5}),
        ("`top_entropy_quantile=0.2`", {"top_entropy_quantile": 0.2}),
        ("`multi_objective_aggregation=normalize_then_sum`", {"multi_objective_aggregation": "normalize_then_sum"}),
        ("`use_vllm` (TRL's IS default: `sequence_mask`)", {"use_vllm": True}),
        (
            "`use_vllm`, `token_truncate`, `clip_min=0.5`",
            {
                "use_vllm": True,
                "vllm_importance_sampling_mode": "token_truncate",
                "vllm_importance_sampling_clip_min": 0.5,
            },
        ),
        ("`beta=0.04` (`use_bias_correction_kl`: TRL's default)", {"beta": 0.04}),
        ("`beta=0.04`, `use_bias_correction_kl=False`", {"beta": 0.04, "use_bias_correction_kl": False}),
        ("`entropy_coef=0.01`", {"entropy_coef": 0.01}),
        ("`use_adaptive_entropy`", {"use_adaptive_entropy": True}),
    ]
    rows = ["| `GRPOConfig` | advantage | gates | regularizers | reduction | population |", "|---|---|---|---|---|---|"]

    def stage(s):
        params = ", ".join(f"{k}={v}" for k, v in s.items() if k != "name" and v is not None)
        return f"`{s['name']}`" + (f" ({params})" if params else "")

    for label, overrides in cases:
        recipe, population = trl_equivalent(types.SimpleNamespace(**{**defaults, **overrides}))
        data = recipe.to_dict()
        regularizers = "; ".join(stage(r) for r in data.get("regularizers", [])) or "—"
        rows.append(
            f"| {label} | {stage(data['advantage'])} | {'; '.join(stage(g) for g in data['gates'])} | "
            f"{regularizers} | {stage(data['reduction'])} | `{population}` |"
        )
    return "\n".join(rows)


def _cell(text: str) -> str:
    """``text`` as the content of a Markdown table cell: pipes, emphasis characters and ``<`` escaped."""
    for char in ("\\", "|", "*", "_", "`"):
        text = text.replace(char, "\\" + char)
    return text.replace("<", "&lt;")


def batch_fields_table() -> str:
    """One table per batch contract, a row per field, built from the contract's declaration: ``SPECS`` (each field's
    :class:`~lossplug.contracts.batch.TensorField`), ``model_fields`` (required or not) and ``field_rules`` (the rule
    table's words)."""
    from lossplug.contracts import PackedTransitions, PolicyBatch

    out = []
    for contract in (PolicyBatch, PackedTransitions):
        out += [
            f"**`{contract.__name__}`**",
            "",
            "| field | shape | kind | log-prob source | rules | description |",
            "|---|---|---|---|---|---|",
        ]
        for name, spec in contract.SPECS.items():
            required = " (required)" if contract.model_fields[name].is_required() else ""
            rules = "; ".join(_cell(rule) for rule in contract.field_rules(name)) or "—"
            out.append(
                f"| `{name}`{required} | `{spec.shape_text}` | {spec.kind} | {spec.source or '—'} | {rules} | "
                f"{_cell(spec.description or spec.summary)} |"
            )
        out.append("")
    return "\n".join(out).rstrip("\n")


def installed_layout(root: Path) -> Path:
    """A temporary folder holding ``lossplug/`` as it is installed: symbolic links to the files of ``core/`` and to
    the folders that pyproject.toml's ``[tool.setuptools.package-dir]`` maps to subpackages."""
    section = (root / "pyproject.toml").read_text().split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    mapping = dict(re.findall(r'^"([\w.]+)"\s*=\s*"([^"]+)"', section, flags=re.M))
    top = [name for name in mapping if "." not in name]
    tmp = Path(tempfile.mkdtemp(prefix="lossplug-docs-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    for package in top:
        target = tmp / package
        target.mkdir()
        for entry in (root / mapping[package]).iterdir():
            if entry.name != "__pycache__":
                (target / entry.name).symlink_to(entry)
    for package, folder in mapping.items():
        if "." in package:
            (tmp / package.replace(".", "/")).symlink_to(root / folder)
    return tmp


@event_priority(100)  # before mkdocstrings' own on_config, which already creates the handler
def on_config(config):
    root = Path(config.config_file_path).resolve().parent
    python = config.plugins["mkdocstrings"].config.handlers.setdefault("python", {})
    python["paths"] = [str(installed_layout(root)), *python.get("paths", [])]
    return config


def trl_unfed_table() -> str:
    from lossplug.adapters.trl.refusals import unfed_markdown

    return unfed_markdown()


GENERATED_PAGES = {"catalogue.md": catalogue_page, "cli.md": cli_page, "api/lossplug.md": api_page}
PLACEHOLDERS = {
    "trl_equivalent": trl_equivalent_table,
    "batch_fields": batch_fields_table,
    "trl_unfed": trl_unfed_table,
}


def on_files(files, config):
    for path, render in GENERATED_PAGES.items():
        if files.get_file_from_path(path) is not None:
            log.warning("docs/%s is generated by docs/hooks/generated.py; delete the committed copy", path)
            files.remove(files.get_file_from_path(path))
        files.append(File.generated(config, path, content=render()))
    return files


_LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)\)")
_PLACEHOLDER = re.compile(r"<!-- generated: (\w+) -->")


def on_page_markdown(markdown, page, config, files):
    def placeholder(m):
        render = PLACEHOLDERS.get(m.group(1))
        if render is None:
            log.warning("%s: unknown generated block %r", page.file.src_uri, m.group(1))
            return m.group(0)
        return render()

    markdown = _PLACEHOLDER.sub(placeholder, markdown)
    docs_dir = Path(config.docs_dir).resolve()
    root = docs_dir.parent
    page_dir = (docs_dir / page.file.src_uri).parent

    def link(m):
        bang, text, target = m.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):
            return m.group(0)
        path, _, anchor = target.partition("#")
        resolved = (page_dir / path).resolve()
        if resolved == docs_dir or docs_dir in resolved.parents:
            return m.group(0)  # a page of the site: mkdocs validates it
        if root not in resolved.parents or not resolved.exists():
            log.warning("%s: link to %r, which is not a file of the repository", page.file.src_uri, target)
            return m.group(0)
        rel = resolved.relative_to(root).as_posix()
        if config.repo_url:
            kind = "tree" if resolved.is_dir() else "blob"
            return f"{bang}[{text}]({config.repo_url.rstrip('/')}/{kind}/main/{rel}{'#' + anchor if anchor else ''})"
        return text

    return _LINK.sub(link, markdown)


_ROLE_HTML = re.compile(r":(?:class|func|meth|mod|data|attr|obj|exc):<code>~?")


def on_page_content(html, page, config, files):
    return _ROLE_HTML.sub("<code>", html)
