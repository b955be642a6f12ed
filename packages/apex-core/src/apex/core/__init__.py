"""apex-core: the kernel loader, build helpers, plugin registry and shared CUDA headers of apex.

Importing it registers apex-core's ops (``torch.ops.apex_core.*``) with their references and
fakes; no kernel is loaded or compiled until a CUDA tensor first reaches one.
"""

from __future__ import annotations

import warnings as _warnings

import torch as _torch

# The oldest PyTorch the whole CPU test suite passes on (2.6.0; also 2.9.1 and 2.13.0; the GPU tests
# ran on 2.11). On 2.4, amp's state-dict hooks and compiled in-place list ops fail.
MIN_TORCH = (2, 6)
# major.minor only: NVIDIA's containers ship pre-releases such as 2.6.0a0+<hash>.nv25.01
if tuple(int(part) for part in _torch.__version__.split(".")[:2]) < MIN_TORCH:
    _warnings.warn(
        f"apex is tested with PyTorch >= {'.'.join(map(str, MIN_TORCH))}; this is {_torch.__version__}, "
        "on which parts of it fail",
        RuntimeWarning,
        stacklevel=2,
    )

from apex.core import _ops  # noqa: E402, F401  (registers torch.ops.apex_core.*)
from apex.core._version import __version__  # noqa: E402

__all__ = ["__version__", "flatten", "get_include", "plugins", "report", "status", "unflatten"]


def status(name: str):
    """How the installed apex package ``name`` ("core", "optimizers", ...) runs on CUDA tensors.

    A ``LibraryStatus`` with ``tier`` ("aot", "jit", "reference", or "unavailable" when a strict
    ``APEX_OPS`` tier can't be had), ``reason``, ``path``, ``build_info`` and ``loaded`` (whether
    its kernels were loaded in this process; before that, what loading will do); None for a
    pure-Python package. Compiles and loads nothing. KeyError if ``name`` is not installed.
    CPU tensors always run the PyTorch reference.
    """
    from apex.core import plugins as _plugins

    return _plugins.kernel_status(_plugins.get(name))


def get_include() -> str:
    """Folder of apex-core's shared CUDA headers, for ``include_dirs`` (like ``numpy.get_include()``)."""
    from apex.core.build import get_include as _get_include

    return _get_include()


def __getattr__(name: str):
    if name in ("flatten", "unflatten"):
        from apex.core import tensor_lists

        return getattr(tensor_lists, name)
    if name == "report":
        from apex.core.cli import report

        return report
    if name == "plugins":
        import importlib

        return importlib.import_module("apex.core.plugins")
    raise AttributeError(f"module 'apex.core' has no attribute {name!r}")
