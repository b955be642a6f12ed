"""apex: the namespace every apex package installs into (this file is apex-core's, and only its).

``import apex`` imports nothing else, torch included. As with upstream Apex, its subpackages are
attributes: ``apex.optimizers.FusedAdam`` imports ``apex.optimizers`` on first access, for every
installed apex package; an attribute that names no installed package raises AttributeError
(so ``hasattr(apex, "optimizers")`` says whether apex-optimizers is installed).

The packages live in several folders when installed from source or in editable mode:
``pkgutil.extend_path`` makes them one package, as a PEP 420 namespace would, which cannot carry
the attribute access above.

Upstream's helpers for contrib modules are here too, as upstream has them: ``DeprecatedFeatureWarning``,
``deprecated_warning`` and ``check_cudnn_version_and_warn`` (torch is imported when they are called).
"""

from __future__ import annotations

import importlib
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)


class DeprecatedFeatureWarning(FutureWarning):
    """Warns of an apex feature that upstream Apex deprecated."""


def deprecated_warning(msg: str) -> None:
    """Warn ``msg`` as a :class:`DeprecatedFeatureWarning`, once per job: on rank 0 of an initialized
    ``torch.distributed`` job, or always without one (upstream meant this; its check never saw the
    distributed state)."""
    import warnings

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        warnings.warn(msg, DeprecatedFeatureWarning, stacklevel=2)


def check_cudnn_version_and_warn(global_option: str, required_cudnn_version: int) -> bool:
    """Whether cuDNN is available at version ``required_cudnn_version`` (e.g. 8400) or later; if not,
    warn that ``global_option`` needs it and return False."""
    import warnings

    import torch

    if not torch.backends.cudnn.is_available():
        warnings.warn(f"{global_option} requires cuDNN, which is not available", stacklevel=2)
        return False
    version = torch.backends.cudnn.version()
    if version < required_cudnn_version:
        warnings.warn(
            f"{global_option} requires cuDNN {required_cudnn_version} or later, found {version}", stacklevel=2
        )
        return False
    return True


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":  # the package exists but something it imports does not
            raise
        message = f"module 'apex' has no attribute {name!r} (no installed apex package provides it)"
        raise AttributeError(message) from None
