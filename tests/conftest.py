import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# CI runs on 2 cores within a 15-minute budget: property tests get a modest example count there.
settings.register_profile("ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# One intra-op thread per process: the CI box has 2 cores, several tests spawn 2-process groups, and torch's
# spinning worker threads make a busy machine an order of magnitude slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture
def fresh_registry():
    """Rebuild the plugin registry before and after a test that changes entry points or environment variables."""
    import lossplug.plugin_registry as reg

    reg.reset()
    yield reg
    reg.reset()
