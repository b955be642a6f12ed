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


def test_flatten_copies_a_lone_tensor_and_reads_non_contiguous_ones(device):
    lone = torch.randn(3, 4, device=device)
    before = lone.clone()
    flat = flatten([lone])
    assert torch.equal(flat, before.reshape(-1))
    flat.fill_(7)  # a copy: the source is untouched
    assert torch.equal(lone, before)
    transposed = torch.randn(4, 3, device=device).t()
    tensors = [transposed, torch.randn(2, device=device)]
    flat = flatten(tensors)
    assert torch.equal(flat[:12], transposed.reshape(-1))


def test_unflatten_keeps_the_shape_of_empty_tensors(device):
    tensors = [torch.randn(2, device=device), torch.empty(0, 5, device=device), torch.randn(3, device=device)]
    views = unflatten(flatten(tensors), tensors)
    assert [tuple(v.shape) for v in views] == [(2,), (0, 5), (3,)]
    torch._foreach_copy_(tensors, views)  # shapes match, as DistributedDataParallel's write-back needs
