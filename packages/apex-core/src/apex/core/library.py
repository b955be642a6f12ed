"""Defining a package's dispatcher ops once: schema, reference, fake; the kernel comes later.

Each op gets
- its schema in the package's namespace (``torch.ops.<lib.name>.<op>``);
- the PyTorch reference as the ``CompositeExplicitAutograd`` kernel: the CPU path, and the
  CUDA path until (or unless) the package's compiled library registers a ``CUDA`` kernel,
  which the dispatcher then prefers;
- a fake (meta) implementation for ``torch.compile`` and ``opcheck``.

The first CUDA call that reaches the reference asks the loader for the compiled library;
when it loads, the call is re-dispatched to the kernel it registered.

``register_autograd`` gives an op its backward and returns the caller that a package's Python
API uses for it (see there why not the op itself).
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


# Dispatches below the autograd keys, as torch.library's own autograd wrapper does (a private
# PyTorch guard; without it the op's registered autograd runs, which only costs time).
_BelowAutograd = getattr(torch._C, "_AutoDispatchBelowAutograd", None)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def _call_below_autograd(op, args):
    if _BelowAutograd is None:
        return op(*args)
    with _BelowAutograd():
        return op(*args)


def _requires_grad(args) -> bool:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            if arg.requires_grad:
                return True
        elif isinstance(arg, (list, tuple)) and _requires_grad(arg):
            return True
    return False


def register_autograd(op, backward: Callable, setup_context: Callable) -> Callable:
    """Register ``backward`` and ``setup_context`` as ``op``'s autograd; return a caller of ``op``.

    The op itself (``torch.ops``, ``opcheck``, ``torch.compile``) is differentiable through
    ``torch.library.register_autograd``, whose wrapper costs host time on every eager call (about
    45 us of a 60 us forward call on the CI machine's CPU). The caller runs the same
    ``setup_context`` and ``backward`` in a plain ``torch.autograd.Function`` when a gradient is
    wanted and calls the op below autograd when not; while compiling and under ``torch.func``
    transforms it calls the op. Where a compiled library registers the op's autograd in C++ for
    the input's device (an ``AutogradCUDA`` kernel, which the dispatcher prefers to this Python
    registration there), the caller calls the op: that costs the least host time. Pass it every
    argument of the schema, positionally, as ``setup_context`` receives them as the op's inputs.
    """
    torch.library.register_autograd(op, backward, setup_context=setup_context)

    def forward(ctx, *args):
        output = _call_below_autograd(op, args)
        setup_context(ctx, args, output)
        return output

    def function_backward(ctx, *grads):
        return backward(ctx, *grads)

    # Named after the op: its tensors' grad_fn reads "<op name>Backward".
    Function = type(
        op._opname,
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(function_backward)},
    )

    native = set()  # device types whose autograd kernel for the op is compiled code

    def call(*args):
        if torch.compiler.is_compiling() or _functorch_active():
            return op(*args)
        if torch.is_grad_enabled() and _requires_grad(args):
            device = args[0].device.type
            if device in native or _has_native_autograd(op, device, native):
                return op(*args)
            return Function.apply(*args)
        return _call_below_autograd(op, args)

    return call


_AUTOGRAD_KEYS = {"cuda": "AutogradCUDA", "cpu": "AutogradCPU"}


def _has_native_autograd(op, device: str, native: set) -> bool:
    """Whether ``op`` has a kernel registered for the autograd key of ``device`` itself (not the
    Autograd alias that torch.library.register_autograd fills); remembered once true. Checked on
    every call until then, as a compiled library may be loaded after the first call."""
    key = _AUTOGRAD_KEYS.get(device)
    if key is None or not torch._C._dispatch_has_kernel_for_dispatch_key(op._schema.name, key):
        return False
    native.add(device)
    return True
