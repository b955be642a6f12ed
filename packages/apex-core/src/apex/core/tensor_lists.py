"""Flatten a list of dense tensors into one buffer and view it back (upstream's ``apex_C``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D tensor holding ``tensors`` back to back (all of one dtype and device).

    The copy is one call into PyTorch's C++ ``flatten_dense_tensors``: a reshape per tensor from
    Python cost about 5 us each of host time, which a data-parallel step pays per gradient.
    """
    if len(tensors) == 0:
        raise ValueError("flatten: tensors is empty")
    first = tensors[0]
    dtype, device = first.dtype, first.device
    if any(t.dtype != dtype or t.device != device for t in tensors):
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:
            raise TypeError(f"flatten: tensors mix dtypes {sorted(str(d) for d in dtypes)}")
        devices = {t.device for t in tensors}
        raise ValueError(f"flatten: tensors are on several devices {sorted(str(d) for d in devices)}")
    if len(tensors) == 1:  # PyTorch's returns a view of a lone contiguous tensor; this is always a copy
        return first.reshape(-1).clone()
    return torch._utils._flatten_dense_tensors(tensors)


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views into ``flat`` shaped like each of ``tensors``, in order (the inverse of :func:`flatten`).

    One call into PyTorch's C++ ``unflatten_dense_tensors`` (see :func:`flatten`)."""
    sizes = [t.numel() for t in tensors]
    total = sum(sizes)
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"unflatten: flat has shape {tuple(flat.shape)}, expected ({total},) for these tensors")
    views = list(torch._utils._unflatten_dense_tensors(flat, tensors))
    if 0 in sizes:  # PyTorch's gives empty tensors a fresh 1-D (0,) buffer: keep views of their shape
        views = [flat.narrow(0, 0, 0).view(t.shape) if n == 0 else v for t, v, n in zip(tensors, views, sizes)]
    return views
