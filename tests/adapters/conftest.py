"""Fixtures of the tests that train real tiny TRL trainers many times in one module."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(scope="module")
def frozen_gc():
    """accelerate runs a full ``gc.collect()`` at the start of every ``train()`` (≈ 0.3 s in a pytest process, ×
    dozens of runs in a module): freeze what exists already so that each collection only walks the objects made
    since."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model saved to a folder (TRL rebuilds the reference model from it when ``beta > 0``)."""
    from lossplug.testing import tiny

    path = tmp_path_factory.mktemp("tiny_trl") / "model"
    tiny.tiny_model_and_tokenizer(path)
    return path
