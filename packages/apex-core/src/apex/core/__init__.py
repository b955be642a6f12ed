"""apex-core: the kernel loader, build helpers, plugin registry and shared CUDA headers of apex.

Importing this package is cheap: torch and the compiled kernels are imported only when an
attribute that needs them is used.
"""

from __future__ import annotations

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("apex-core")
except _metadata.PackageNotFoundError:  # a source-tree run without an install
    __version__ = "0+source"

__all__ = ["__version__", "flatten", "get_include", "plugins", "report", "unflatten"]


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
