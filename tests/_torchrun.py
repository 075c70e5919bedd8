"""Two data-parallel processes for a test: a script run by ``torchrun --standalone --nproc_per_node 2`` (gloo on
the CPU), each rank writing its results under the folder given as its first argument."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def run_on_two_processes(script: Path, *args: str, env: dict[str, str] | None = None, timeout: int = 300) -> None:
    """Run ``script`` on two processes with ``args``; skip when torchrun is missing, fail with its stderr's tail."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found")
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", str(script), *args],
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
