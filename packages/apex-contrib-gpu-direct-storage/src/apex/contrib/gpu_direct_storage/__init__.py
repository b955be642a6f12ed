"""apex.contrib.gpu_direct_storage: tensors to and from files, through NVIDIA GPUDirect Storage (cuFile) or plain
file I/O. Deprecated, as upstream deprecated it (May 2025, then removed it): use PyTorch's ``torch.cuda.gds``,
which this package is built on.

Usage (as upstream)::

    from apex.contrib.gpu_direct_storage import GDSFile

    with GDSFile("weights.bin", "w") as f:  # "r"/"w": GPUDirect Storage; "rn"/"wn": without it
        f.save_data(cuda_tensor)
    with GDSFile("weights.bin", "r") as f:
        f.load_data(cuda_tensor_of_the_same_size)

Every read and write starts at offset 0 of the file. ``GDSFile`` emits upstream's kind of deprecation warning:
a ``DeprecatedFeatureWarning`` (a FutureWarning; ``apex.DeprecatedFeatureWarning`` where apex-core defines it),
on rank 0 only. The file object is ``_GDSFile`` (also upstream's ``_apex_gpu_direct_storage._GDSFile``): see its
docstring for the modes and where it differs from upstream.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from apex.contrib.gpu_direct_storage._file import _GDSFile

__all__ = ["GDSFile"]


def _deprecated(message: str) -> None:
    """Upstream's ``apex.deprecated_warning``: a DeprecatedFeatureWarning (a FutureWarning) on rank 0 only."""
    import apex

    category = getattr(apex, "DeprecatedFeatureWarning", FutureWarning)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    warnings.warn(message, category, stacklevel=4)


@contextmanager
def GDSFile(filename: str, mode: str) -> Iterator[_GDSFile]:
    """Open ``filename`` in ``mode`` (``"r"``, ``"w"``, ``"rn"``, ``"wn"``) for the ``with`` block; the file is
    closed when the block ends, also on an exception."""
    if not isinstance(filename, (str, os.PathLike)):
        raise TypeError(f"GDSFile: filename must be a str, got {type(filename).__name__}")
    if not isinstance(mode, str):
        raise TypeError(f"GDSFile: mode must be a str, got {type(mode).__name__}")
    _deprecated(
        "apex.contrib.gpu_direct_storage.GDSFile is deprecated (upstream Apex removed it): use PyTorch's "
        "torch.cuda.gds (GdsFile, gds_register_buffer), documented at "
        "https://docs.pytorch.org/docs/stable/cuda.html#gpudirect-storage-prototype"
    )
    handle = _GDSFile(filename, mode)
    try:
        yield handle
    finally:
        handle.close()
