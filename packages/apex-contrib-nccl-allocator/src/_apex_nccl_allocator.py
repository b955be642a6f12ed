"""Upstream Apex's ``_apex_nccl_allocator`` extension module, on PyTorch's own NCCL allocator.

- ``get_nccl_allocator()``: the allocator for ``torch.cuda.MemPool`` whose memory comes from ``ncclMemAlloc``
  and goes back through ``ncclMemFree``.

Differs from upstream on purpose: upstream compiles a ``CUDAPluggableAllocator`` over ``ncclMemAlloc``; this
returns ProcessGroupNCCL's ``mem_allocator`` of the default process group on the current device, so it needs
``torch.distributed`` initialized with NCCL (RuntimeError otherwise, and on a PyTorch without CUDA or NCCL).
"""

from __future__ import annotations

from apex.contrib.nccl_allocator import _nccl_allocator
from apex.core import __version__

__all__ = ["__version__", "get_nccl_allocator"]


def get_nccl_allocator():
    return _nccl_allocator("get_nccl_allocator")
