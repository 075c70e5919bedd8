"""The README's two commands are what CI runs, and the lock they install from is complete and in force."""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "constraints" / "cpu-lock.txt"


def _readme_commands() -> list[str]:
    out = subprocess.run([sys.executable, str(ROOT / ".ci" / "readme_commands.py"), "1"], capture_output=True,
                         text=True, check=True).stdout.strip()  # fmt: skip
    two = subprocess.run([sys.executable, str(ROOT / ".ci" / "readme_commands.py"), "2"], capture_output=True,
                         text=True, check=True).stdout.strip()  # fmt: skip
    return [out, two]


def _pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_the_readme_opens_with_the_demo_and_the_tests_both_from_the_lock():
    demo, tests = _readme_commands()
    assert demo.endswith("lossplug demo") and tests.endswith("python -m pytest -q")
    for command in (demo, tests):
        assert "-c constraints/cpu-lock.txt" in command, command
        assert " -q " not in command.split("pytest")[0], f"an install that can take minutes says nothing: {command}"
        assert re.search(r"python3 -m venv (\S+) && \. \1/bin/activate", command), command
    assert '".[demo]"' in demo  # TRL without verl: the main job's environment breaks no part of lossplug


def test_ci_runs_the_readme_commands_before_anything_else():
    script = (ROOT / ".ci" / "run").read_text()
    body = [line.strip() for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    calls = [i for i, line in enumerate(body) if re.match(r"\(?readme_command [12]\b", line)]
    assert [body[i].strip("()").split(";")[0] for i in calls] == ["readme_command 1", "readme_command 2"]
    before = body[: calls[0]]
    assert not any(re.search(r"\b(pip|pytest|python -m|mkdocs|ruff)\b", line) for line in before if
                   not line.startswith(("export", "PIP_CACHE_DIR", "trap", "readme_command()", "local ", "echo",
                                        "while", "started", "eval", "done", "}", "set ", "cd ")))  # fmt: skip
    assert "PIP_CACHE_DIR=$(mktemp -d)" in script  # the resolution on an empty cache, as on a fresh machine


def test_the_lock_pins_every_package_the_test_install_needs_and_it_is_what_is_installed():
    pins = _pins()
    missing, different = [], []
    todo = [(Requirement("lossplug[all,dev,docs]"), ())]
    seen: set[str] = set()
    while todo:
        req, _ = todo.pop()
        name = canonicalize_name(req.name)
        extras = tuple(sorted(req.extras))
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        dist = md.distribution(req.name)
        if name != "lossplug":
            if name not in pins:
                missing.append(name)
            elif dist.version.split("+")[0] != pins[name]:
                different.append(f"{name} {dist.version} (lock {pins[name]})")
        for text in dist.requires or []:
            sub = Requirement(text)
            env_extras = extras or ("",)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in env_extras):
                todo.append((sub, ()))
    assert not missing, f"constraints/cpu-lock.txt lacks {missing}: rerun `python constraints/lock.py`"
    assert not different, f"installed versions differ from the lock: {different}"
