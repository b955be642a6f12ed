"""Upstream Apex's ``apex_C`` extension module: flatten a list of dense tensors into one buffer and back.

PyTorch's ``flatten_dense_tensors`` / ``unflatten_dense_tensors``, which upstream's module bound:
``flatten`` of one tensor may return a view of it; ``unflatten`` returns views into ``flat``.
``apex.core.flatten`` / ``unflatten`` are the checked versions (always a copy, named errors).
"""

from __future__ import annotations

import torch


def flatten(tensors):
    """One 1-D tensor holding ``tensors`` (one dtype and device) back to back."""
    return torch._utils._flatten_dense_tensors(list(tensors))


def unflatten(flat, tensors):
    """Views into ``flat`` shaped like each of ``tensors``, in order."""
    return list(torch._utils._unflatten_dense_tensors(flat, list(tensors)))
