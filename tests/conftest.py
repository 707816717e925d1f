"""Fixtures and hooks of the kvcopy test suite; what tests share otherwise is in the helpers package.

Without a CUDA device the "triton" method runs under Triton's interpreter on
CPU tensors, which needs TRITON_INTERPRET=1 before triton is first imported:
it is set here, before kvcopy (which imports triton lazily) is imported.
"""

from __future__ import annotations

import os
import warnings

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# "auto" must follow its documented defaults here, whatever a developer's own calibration left in ~/.cache.
os.environ["KVCOPY_PROFILE"] = "none"

import pytest

import kvcopy
import kvcopy.profile

from helpers import COLLECTED_TESTS


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Records every collected test before -m or -k deselects any (tests/test_architecture.py reads them)."""
    config.stash[COLLECTED_TESTS] = [(item.nodeid, item.get_closest_marker("slow") is not None) for item in items]


@pytest.fixture
def gen() -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(1234)
    return g


@pytest.fixture
def engines():
    """Engines made by a test (helpers.engines.Engines), all closed when it ends."""
    from helpers.engines import Engines

    made = Engines()
    yield made
    made.close_all()


@pytest.fixture
def restore_default_profile():
    """set_default_profile changes module state (kvcopy.profile): put it back whatever the test does."""
    saved = dict(kvcopy.profile._default)
    try:
        yield
    finally:
        kvcopy.set_default_profile(None)
        kvcopy.profile._default.clear()
        kvcopy.profile._default.update(saved)


@pytest.fixture(scope="session")
def cpu_calibration() -> kvcopy.Profile:
    """A quick calibration of this machine's CPU (``kvcopy.calibrate("cpu", quick=True)``), measured once for the
    whole run (about 20 s on the 2-core CI machine) and shared: read it, never change it."""
    try:
        return kvcopy.calibrate("cpu", quick=True, progress=False)
    except ValueError as err:
        # Seen once on a loaded 2-core machine: three prefill shapes timed three times each, one slowed by
        # another process, and the prefill fit found no growth. Retry once, loudly.
        warnings.warn(f"kvcopy.calibrate failed once ({err}); retrying", stacklevel=1)
        return kvcopy.calibrate("cpu", quick=True, progress=False)
