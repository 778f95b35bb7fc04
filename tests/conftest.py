"""Shared fixtures: the device list and the Hypothesis profiles.

``HYPOTHESIS_PROFILE=thorough`` runs many more examples; the default is fast for CI.
"""

import gc
import os
from collections.abc import Iterator

import hypothesis
import pytest
import torch
from helpers import assert_no_global_state

hypothesis.settings.register_profile(
    "default", max_examples=25, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow]
)
hypothesis.settings.register_profile(
    "thorough", max_examples=500, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow]
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

torch.set_num_threads(1)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Every numeric test runs on CPU and, where present, CUDA."""
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Every test starts and ends with no run entered and no global module hook anywhere."""
    assert_no_global_state()
    yield
    assert_no_global_state()


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """For the tests that call `gc.collect()` to see a value die: what was alive before the
    test is frozen (`gc.freeze`) while it runs, so each collection walks only what the test
    made, not the whole suite's heap (about a second per collection late in the suite, on two
    cores). A frozen object is never freed, so a check that a value dies can only get stricter;
    after the test everything goes back to the collector."""
    gc.freeze()
    yield
    gc.unfreeze()
