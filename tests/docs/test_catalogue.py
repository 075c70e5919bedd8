"""The plugin catalogue page of the docs site is generated from the registry (``lossplug.cli.describe.catalogue_markdown``,
called by ``docs/hooks/generated.py`` on every build): every built-in must be fully documented — a formula (its
docstring), a description for every parameter, a citation — and appear on the page with its parameters."""

import re
from types import SimpleNamespace

import pytest
from pydantic import Field

import lossplug
from lossplug.cli.describe import catalogue_markdown, catalogue_problems, citations, formula, parameters
from lossplug.plugin_registry import BUILTIN_SOURCE


def builtins():
    reg = lossplug.registry()
    return [
        (kind, name, plugin)
        for kind, plugins in reg.plugins.items()
        for name, plugin in plugins.items()
        if reg.origin(kind, name) == BUILTIN_SOURCE
    ]


def section(markdown: str, name: str) -> str:
    return markdown.split(f"### `{name}`\n", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]


def test_there_are_builtins_of_every_kind():
    assert {kind for kind, _, _ in builtins()} == {"shaper", "filter", "advantage", "gate", "reduction", "regularizer"}


def test_every_builtin_has_a_formula_parameter_descriptions_and_a_citation():
    assert catalogue_problems() == []


@pytest.mark.parametrize("kind,name,plugin", builtins(), ids=lambda x: x if isinstance(x, str) else "")
def test_the_page_shows_each_builtin_with_formula_parameters_fields_and_citation(kind, name, plugin):
    page = catalogue_markdown()
    text = section(page, name)
    assert formula(plugin).splitlines()[0].split(":")[0] in text
    for row in parameters(plugin):
        assert f"| `{row['name']}` |" in text and row["description"].split("``")[0] in text
    needs = "none: it reads the gates' objective" if kind == "reduction" else "`logp`, `action_mask`"
    if kind in ("shaper", "filter"):  # the reward they rewrite or filter by
        needs += ", `reward`"
    if kind == "reduction" and plugin.requires:  # a reduction over prompts reads the batch's group_id
        needs = ", ".join(f"`{f}`" for f in plugin.requires)
    assert f"**Batch fields** — {needs}" in text
    assert citations(plugin) and all(f"**{c.split(':')[0]}** —" in text for c in citations(plugin))


def test_the_page_lists_every_preset_with_its_source():
    page = catalogue_markdown()
    for name, preset in lossplug.registry().presets.items():
        if preset.origin == BUILTIN_SOURCE:
            assert f"| `{name}` |" in page and preset.source.split("arXiv")[0] in page
            assert all(f"(https://arxiv.org/abs/{id})" in page for id in re.findall(r"arXiv:([\d.]+\d)", preset.source))


class _Undescribed(lossplug.Params):
    knee: float = Field(0.5, gt=0)


@lossplug.gate("undocumented_pg", params=_Undescribed)
def _undocumented(inp: lossplug.GateInput, p: _Undescribed) -> lossplug.GateOutput:
    """knee · A · logp"""
    return lossplug.GateOutput(objective=p.knee * inp.advantage * inp.logp)


@lossplug.gate("cited_pg")
def _cited(inp: lossplug.GateInput, p: lossplug.NoParams) -> lossplug.GateOutput:
    """A · logp

    Paper: Williams, 1992.
    """
    return lossplug.GateOutput(objective=inp.advantage * inp.logp)


def test_a_missing_citation_or_parameter_description_is_reported():
    reg = SimpleNamespace(
        plugins={"gate": {"undocumented_pg": _undocumented, "cited_pg": _cited}},
        origin=lambda kind, name: "in-process plugin 'test'",
        presets={},
    )
    assert catalogue_problems(reg) == []  # only built-ins are held to it by default
    problems = catalogue_problems(reg, builtin_only=False)
    assert any("'undocumented_pg': parameter 'knee' has no description" in p for p in problems)
    assert any("'undocumented_pg': no citation" in p for p in problems)
    assert not any("cited_pg" in p for p in problems)


def test_citations_come_from_the_docstring_and_stay_out_of_the_formula():
    assert citations(_cited) == ["Paper: Williams, 1992."]
    assert formula(_cited) == "A · logp"
    ppo = lossplug.registry().plugins["gate"]["ppo_clip"]  # its citations live in its module's docstring
    assert any("arXiv:1707.06347" in c for c in citations(ppo))
