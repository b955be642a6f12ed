"""Shared test configuration: gpu/multigpu tests skip (not deselect) without the hardware.

A test taking a ``device`` argument runs once on the CPU and once on CUDA (marked ``gpu``).
"""

from __future__ import annotations

import pytest
import torch


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize(
            "device", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)], scope="function"
        )


def pytest_collection_modifyitems(config, items):
    count = _gpu_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason=f"needs two CUDA GPUs, found {count}")
    for item in items:
        if "multigpu" in item.keywords and count < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and count < 1:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _undo_amp_patches():
    """``amp.init`` (and ``amp.initialize`` at O1) patch torch's functions for the process: undo
    them after each test, so that a test of another package never runs under O1's casts."""
    yield
    import sys

    amp = sys.modules.get("apex.amp")
    handle = getattr(getattr(amp, "_amp_state", None), "handle", None)
    if handle is not None:
        deactivate = getattr(handle, "_deactivate", None)
        if deactivate is not None:
            deactivate()
        amp._amp_state.handle = None
