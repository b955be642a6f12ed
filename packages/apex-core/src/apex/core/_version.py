"""apex-core's version (a leaf module: imports nothing of apex)."""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("apex-core")
except _metadata.PackageNotFoundError:  # a source-tree run without an install
    __version__ = "0+source"
