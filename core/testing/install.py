"""Install a plugin distribution into a throw-away directory, for tests that need a real entry point.

``pip install --target`` with ``--no-deps --no-build-isolation --no-index`` needs no network and leaves the current
environment untouched; the returned environment puts the target first on ``PYTHONPATH``, so a subprocess started
with it sees the distribution's metadata and therefore its ``lossplug`` entry points, exactly as after a real
``pip install``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Union

PathLike = Union[str, "os.PathLike[str]"]


def install_isolated(
    project: PathLike, target: PathLike, *, env: Mapping[str, str] | None = None, timeout: float = 300
) -> dict[str, str]:
    """``pip install`` the project at ``project`` into ``target``; return an environment for subprocesses.

    The project is copied first (setuptools builds in the source tree; the copy keeps ``build/`` and
    ``*.egg-info`` out of your checkout). Needs setuptools in the running interpreter (no build isolation).
    Raises ``RuntimeError`` with pip's output when the install fails.
    """
    project, target = Path(project), Path(target)
    source = target.parent / f"{target.name}-src"
    shutil.copytree(
        project,
        source,
        ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"),
        dirs_exist_ok=True,
    )
    base = dict(os.environ if env is None else env)
    base.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--target",
        str(target),
        str(source),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=base, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(
            f"pip install of {project} into {target} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), base.get("PYTHONPATH", "")) if p)
    return base
