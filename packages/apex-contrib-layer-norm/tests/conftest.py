"""The layer-norm tests run the op's path off CUDA unless a test says otherwise."""

from __future__ import annotations

import pytest

from apex.contrib.layer_norm import layer_norm as layer_norm_module


@pytest.fixture(autouse=True)
def _op_off_cuda(monkeypatch):
    """Off CUDA FastLayerNorm and FastLayerNormFN.apply take torch's layer norm by default; these tests run
    apex-normalization's op there (test_off_cuda_the_module_is_torchs checks the default)."""
    monkeypatch.setattr(layer_norm_module, "_TORCH_OFF_CUDA", False)
