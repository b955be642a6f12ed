"""Defining a package's dispatcher ops once: schema, reference, fake; the kernel comes later.

Each op gets
- its schema in the package's namespace (``torch.ops.<lib.name>.<op>``);
- the PyTorch reference as the ``CompositeExplicitAutograd`` kernel: the CPU path, and the
  CUDA path until (or unless) the package's compiled library registers a ``CUDA`` kernel,
  which the dispatcher then prefers;
- a fake (meta) implementation for ``torch.compile`` and ``opcheck``.

The first CUDA call that reaches the reference asks the loader for the compiled library;
when it loads, the call is re-dispatched to the kernel it registered.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch

from apex.core import loader
from apex.core.descriptors import KernelLibrary

_libraries: dict[str, torch.library.Library] = {}
_redispatching = threading.local()
_missing_kernels: set[str] = set()


def _first_tensor(args) -> torch.Tensor | None:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg
        if isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, torch.Tensor):
                    return item
    return None


def _library(lib: KernelLibrary) -> torch.library.Library:
    if lib.name not in _libraries:
        _libraries[lib.name] = torch.library.Library(lib.name, "DEF")
    return _libraries[lib.name]


def define(lib: KernelLibrary, schema: str, reference: Callable, fake: Callable):
    """Define ``schema`` in ``lib``'s namespace with its reference and fake; return the op."""
    name = schema.split("(", 1)[0].strip()
    qualname = f"{lib.name}::{name}"
    library = _library(lib)
    library.define(schema)

    def reference_or_kernel(*args, **kwargs):
        first = _first_tensor(args)
        if (
            first is not None
            and first.is_cuda
            and qualname not in _missing_kernels
            and not getattr(_redispatching, "active", False)
            and loader.kernels_for_cuda(lib)
        ):
            _redispatching.active = True
            try:
                return op(*args, **kwargs)
            finally:
                _redispatching.active = False
        if first is not None and first.is_cuda and getattr(_redispatching, "active", False):
            _missing_kernels.add(qualname)
            warnings.warn(
                f"apex: {lib.name} is loaded but registers no CUDA kernel for {qualname}; using the PyTorch reference",
                loader.ReferenceFallbackWarning,
                stacklevel=2,
            )
        return reference(*args, **kwargs)

    library.impl(name, reference_or_kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake, lib=library)
    op = getattr(getattr(torch.ops, lib.name), name).default
    return op
