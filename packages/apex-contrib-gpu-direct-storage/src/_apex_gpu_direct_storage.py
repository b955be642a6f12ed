"""Upstream Apex's ``_apex_gpu_direct_storage`` extension module, on PyTorch's ``torch.cuda.gds``.

- ``_GDSFile()`` / ``_GDSFile(filename, mode)`` with ``open(filename, mode)``, ``close()``, ``load_data(tensor)``,
  ``save_data(tensor)`` (modes ``"r"``/``"w"``, GPUDirect Storage) and ``load_data_no_gds(tensor)``,
  ``save_data_no_gds(tensor)`` (modes ``"rn"``/``"wn"``, plain file I/O, CPU or CUDA tensors).

Where it differs from upstream: ``apex.contrib.gpu_direct_storage._file._GDSFile``'s docstring. Deprecated
upstream: use ``torch.cuda.gds``.
"""

from __future__ import annotations

from apex.contrib.gpu_direct_storage._file import _GDSFile
from apex.core import __version__

__all__ = ["_GDSFile", "__version__"]
