"""Flatten a list of dense tensors into one buffer and view it back (upstream's ``apex_C``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D tensor holding ``tensors`` back to back (all of one dtype and device)."""
    if len(tensors) == 0:
        raise ValueError("flatten: tensors is empty")
    dtypes = {t.dtype for t in tensors}
    devices = {t.device for t in tensors}
    if len(dtypes) > 1:
        raise TypeError(f"flatten: tensors mix dtypes {sorted(str(d) for d in dtypes)}")
    if len(devices) > 1:
        raise ValueError(f"flatten: tensors are on several devices {sorted(str(d) for d in devices)}")
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views into ``flat`` shaped like each of ``tensors``, in order (the inverse of :func:`flatten`)."""
    total = sum(t.numel() for t in tensors)
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"unflatten: flat has shape {tuple(flat.shape)}, expected ({total},) for these tensors")
    views, offset = [], 0
    for t in tensors:
        views.append(flat.narrow(0, offset, t.numel()).view_as(t))
        offset += t.numel()
    return views
