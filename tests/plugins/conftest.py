"""The origins' wheels for the origin oracles (``tests/_origins.py``): one download per session, on first use."""

from __future__ import annotations

from pathlib import Path

import pytest

from .._origins import Origins


@pytest.fixture(scope="session")
def origins(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Origins:
    """SkyRL's, AReaL's and OpenRLHF's published code, read from their wheels in pytest's cache (a temporary folder
    where the cache is off): ``origins.module(dotted_name, stubs)``, ``origins.package(dist)``."""
    cache = getattr(request.config, "cache", None)
    folder = Path(cache.mkdir("origin-wheels")) if cache is not None else tmp_path_factory.mktemp("origin-wheels")
    return Origins(folder)
