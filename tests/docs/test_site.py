"""The docs site's configuration holds together without building it (CI builds it with ``mkdocs build --strict``):
every page in the nav exists or is generated, and the generated pages render."""

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")


def hook():
    spec = importlib.util.spec_from_file_location("docs_hook_generated", ROOT / "docs" / "hooks" / "generated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nav_pages(nav):
    for item in nav:
        for value in item.values() if isinstance(item, dict) else [item]:
            yield from (nav_pages(value) if isinstance(value, list) else [value])


def test_every_nav_page_exists_or_is_generated():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs" and config["strict"] is True
    generated = set(hook().GENERATED_PAGES)
    pages = list(nav_pages(config["nav"]))
    assert {"catalogue.md", "cli.md", "plugin-hooks.md", "verl.md", "design.md"} <= set(pages)
    for page in pages:
        assert page in generated or (ROOT / "docs" / page).is_file(), page
        assert not (page in generated and (ROOT / "docs" / page).exists()), f"{page} is generated: do not commit it"


def test_generated_cli_and_api_pages_cover_every_command_and_public_name():
    import lossplug

    module = hook()
    cli = module.cli_page()
    for command in ("list", "show", "validate", "check", "demo", "recipe explain", "plot gates"):
        assert f"## `lossplug {command}`" in cli
    api = module.api_page()
    documented = set(re.findall(r"^        - (\w+)$", api, flags=re.M))
    assert documented | {"hookimpl"} == set(lossplug.__all__)


def test_the_tutorial_includes_the_example_plugin_files_that_exist():
    text = (ROOT / "docs" / "write-a-gate.md").read_text()
    included = re.findall(r'^--8<-- "([^"]+)"$', text, flags=re.M)
    assert "examples/lossplug-example-plugin/lossplug_example_plugin/__init__.py" in included
    assert all((ROOT / path).is_file() for path in included)


def test_the_readme_and_getting_started_give_the_same_two_commands_and_the_readme_links_resolve():
    readme = (ROOT / "README.md").read_text()
    commands = [
        line
        for line in readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
        if line.startswith("python3 -m venv")
    ]
    assert len(commands) == 2 and '".[all,dev,docs]"' in commands[1]
    index = (ROOT / "docs" / "index.md").read_text()
    assert all(command in index for command in commands)
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not re.match(r"^[a-z]+:", link)]
    assert "docs/index.md" in local and "docs/performance.md" in local
    assert [link for link in local if not (ROOT / link).exists()] == []
