from __future__ import annotations

import pytest
import torch

from apex.core import flatten, unflatten


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_flatten_round_trip_shares_storage(device, dtype):
    tensors = [torch.randn(shape, device=device).to(dtype) for shape in [(3, 4), (1,), (0,), (2, 3, 5)]]
    flat = flatten(tensors)
    assert flat.shape == (12 + 1 + 0 + 30,) and flat.dtype == dtype
    views = unflatten(flat, tensors)
    for view, original in zip(views, tensors):
        assert view.shape == original.shape and torch.equal(view, original)
    views[0].fill_(7)
    assert torch.all(flat[:12] == 7)


def test_flatten_errors():
    with pytest.raises(ValueError, match="flatten: tensors is empty"):
        flatten([])
    with pytest.raises(TypeError, match="flatten: tensors mix dtypes"):
        flatten([torch.ones(2), torch.ones(2, dtype=torch.float16)])
    with pytest.raises(ValueError, match=r"unflatten: flat has shape \(5,\), expected \(4,\)"):
        unflatten(torch.ones(5), [torch.ones(2), torch.ones(2)])
