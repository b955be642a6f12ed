"""apex: the namespace every apex package installs into (this file is apex-core's, and only its).

``import apex`` imports nothing else, torch included. As with upstream Apex, its subpackages are
attributes: ``apex.optimizers.FusedAdam`` imports ``apex.optimizers`` on first access, for every
installed apex package; an attribute that names no installed package raises AttributeError
(so ``hasattr(apex, "optimizers")`` says whether apex-optimizers is installed).

The packages live in several folders when installed from source or in editable mode:
``pkgutil.extend_path`` makes them one package, as a PEP 420 namespace would, which cannot carry
the attribute access above.
"""

from __future__ import annotations

import importlib
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)


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
