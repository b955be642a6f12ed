"""apex.contrib.nccl_allocator: tensors in NCCL-allocated memory (``ncclMemAlloc``), registered with a process
group's NCCL communicator for zero-copy / NVLS collectives.

Upstream Apex compiles an extension (``_apex_nccl_allocator``) wrapping ``ncclMemAlloc``/``ncclMemFree`` in a
``CUDAPluggableAllocator``. This package compiles nothing: PyTorch's NCCL process-group backend exposes the same
kind of allocator (``ProcessGroupNCCL.mem_allocator``) and registers whole memory pools with its communicators
(``register_mem_pool`` / ``deregister_mem_pool``); we build ``torch.cuda.MemPool`` on that allocator.

Usage (as upstream)::

    import apex.contrib.nccl_allocator as nccl_allocator

    nccl_allocator.init()  # before init_process_group: sets NCCL's environment
    torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    pool = nccl_allocator.create_nccl_mem_pool()
    with nccl_allocator.nccl_mem(pool):
        buffer = torch.empty(n, device="cuda")  # ncclMemAlloc'd, registered on exit
    torch.distributed.all_reduce(buffer)

Differences from upstream, on purpose:

- ``create_nccl_mem_pool`` needs an initialized default process group whose CUDA backend is NCCL (the allocator
  comes from it); upstream's compiled allocator needs none. Without one it raises RuntimeError.
- ``symmetric``: passed to ``torch.cuda.MemPool`` where it takes ``symmetric`` (or NVIDIA's ``symm_mem``), as
  upstream; where PyTorch moved the knob to ``register_mem_pool(pool, symm=...)`` we remember it on the pool and
  ``nccl_mem`` registers with it; where neither exists, ValueError naming ``symmetric`` (as upstream).
- ``nccl_mem`` also takes a ``torch.device``; a non-CUDA device raises ValueError (upstream asserts); a failed
  registration on exit warns (upstream ignores it silently); allocations go to ``device``'s pool.
- On a PyTorch without CUDA, distributed or NCCL support, every function raises RuntimeError saying what is
  missing; importing never fails. Where PyTorch's NCCL backend offers no ``mem_allocator`` on this machine (it
  refuses unless NCCL has ``ncclMemAlloc`` and, by its own check, the device supports CUDA multicast),
  ``create_nccl_mem_pool`` and ``get_nccl_allocator`` raise RuntimeError saying so (upstream would allocate with
  ``ncclMemAlloc`` anyway).
"""

from __future__ import annotations

import inspect
import os
import warnings
from contextlib import nullcontext

import torch

__all__ = ["create_nccl_mem_pool", "init", "nccl_mem"]

# Set on a pool whose symmetric registration happens in register_mem_pool(pool, symm=...) (newer PyTorch).
_SYMMETRIC_ATTRIBUTE = "_apex_nccl_symmetric"


def _missing(need_device: bool) -> str | None:
    """What this PyTorch (or machine) lacks for the NCCL allocator, or None."""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:  # ROCm: RCCL is "nccl"
        return f"a PyTorch built with CUDA (this is torch {torch.__version__}, built without CUDA)"
    if not torch.distributed.is_available():
        return "a PyTorch built with torch.distributed (this build has none)"
    if not torch.distributed.is_nccl_available():
        return "a PyTorch built with NCCL (torch.distributed.is_nccl_available() is False)"
    if not hasattr(torch.cuda, "MemPool") or not hasattr(torch.cuda, "use_mem_pool"):
        return f"torch.cuda.MemPool and torch.cuda.use_mem_pool (torch {torch.__version__} lacks them)"
    if need_device and not torch.cuda.is_available():
        return "a CUDA device (torch.cuda.is_available() is False)"
    return None


def _require(function: str, need_device: bool = True) -> None:
    missing = _missing(need_device)
    if missing is not None:
        raise RuntimeError(f"{function}: apex.contrib.nccl_allocator needs {missing}")


def _deprecated(message: str) -> None:
    """Upstream's ``apex.deprecated_warning``: a DeprecatedFeatureWarning (a FutureWarning) on rank 0 only."""
    import apex

    category = getattr(apex, "DeprecatedFeatureWarning", FutureWarning)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    warnings.warn(message, category, stacklevel=3)


def _cuda_device(function: str, device) -> torch.device:
    """``device`` (None: the current one; an int; a str or torch.device of type cuda) as an indexed CUDA device."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise TypeError(f"{function}: device must be None, an int, a str or a torch.device, got {device!r}")
    resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if resolved.type != "cuda":
        raise ValueError(f"{function}: device must be a CUDA device, got {device!r}")
    if resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _default_group(function: str):
    dist = torch.distributed
    if not dist.is_initialized():
        raise RuntimeError(
            f"{function}: needs torch.distributed initialized with the NCCL backend (call init_process_group "
            "first, or pass group=...)"
        )
    return dist.distributed_c10d._get_default_group()


def _nccl_backend(function: str, group, device: torch.device):
    """The process group's backend for ``device``; RuntimeError unless it is NCCL's."""
    if not hasattr(group, "_get_backend"):
        raise TypeError(f"{function}: group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    try:
        backend = group._get_backend(device)
    except RuntimeError as error:
        raise RuntimeError(f"{function}: the process group has no backend for {device}: {error}") from error
    nccl = getattr(torch.distributed, "ProcessGroupNCCL", None)
    if nccl is None or not isinstance(backend, nccl):
        raise RuntimeError(
            f"{function}: the process group's backend for {device} is {type(backend).__name__}, not ProcessGroupNCCL"
        )
    return backend


def _nccl_allocator(function: str, group=None, device=None):
    """ProcessGroupNCCL's ncclMemAlloc-backed allocator, for ``torch.cuda.MemPool``."""
    _require(function)
    device = _cuda_device(function, device)
    backend = _nccl_backend(function, _default_group(function) if group is None else group, device)
    try:
        allocator = backend.mem_allocator
    except AttributeError as error:
        raise RuntimeError(
            f"{function}: ProcessGroupNCCL of torch {torch.__version__} has no NCCL memory allocator (mem_allocator)"
        ) from error
    except RuntimeError as error:
        # PyTorch refuses where NCCL lacks ncclMemAlloc or (its own check) the device lacks CUDA multicast
        # support, whatever its message says; supports_tensor_alloc tells which, where it exists.
        raise RuntimeError(
            f"{function}: PyTorch's NCCL backend offers no ncclMemAlloc allocator on {device} "
            f"(ProcessGroupNCCL.mem_allocator raised: {error}){_tensor_alloc_note(backend, device)}; "
            "this machine cannot use NCCL-allocated pools"
        ) from error
    if callable(allocator):  # some builds expose a method rather than a property
        allocator = allocator()
    if allocator is None:
        raise RuntimeError(f"{function}: ProcessGroupNCCL of torch {torch.__version__} returned no mem_allocator")
    return allocator


def _tensor_alloc_note(backend, device: torch.device) -> str:
    """What ``ProcessGroupNCCL.supports_tensor_alloc(device)`` says, for an error message ('' where unknown)."""
    check = getattr(backend, "supports_tensor_alloc", None)
    if check is None:
        return ""
    try:
        supported = bool(check(device))
    except (RuntimeError, TypeError):
        return ""
    return f"; supports_tensor_alloc({device}) is {supported}"


def _parameters(function) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return ()


def _register_takes_symm() -> bool:
    """Whether ``ProcessGroupNCCL.register_mem_pool`` takes ``symm`` (PyTorch moved the knob there from MemPool)."""
    register = getattr(getattr(torch.distributed, "ProcessGroupNCCL", None), "register_mem_pool", None)
    if register is None:
        return False
    return "symm" in _parameters(register) or "symm" in (getattr(register, "__doc__", "") or "")


def create_nccl_mem_pool(symmetric: bool | None = None) -> torch.cuda.MemPool:
    """A ``torch.cuda.MemPool`` whose memory comes from ``ncclMemAlloc`` (ProcessGroupNCCL's allocator of the
    default process group, on the current device).

    Args:
        symmetric: None (default) for a plain pool; True/False asks for NCCL symmetric-memory registration, through
            ``torch.cuda.MemPool(symmetric=...)`` (or ``symm_mem=...``) or, on newer PyTorch, through the
            registration ``nccl_mem`` does. ValueError where this PyTorch offers neither.

    Emits upstream's deprecation warning (PyTorch's own symmetric memory / MemPool API replaces this module).
    """
    _require("create_nccl_mem_pool")
    if symmetric is not None and not isinstance(symmetric, bool):
        raise TypeError(f"create_nccl_mem_pool: symmetric must be None or a bool, got {symmetric!r}")
    _deprecated(
        "apex.contrib.nccl_allocator is deprecated (upstream removes it in February 2027): use PyTorch's symmetric "
        "memory (torch.distributed._symmetric_memory) or torch.cuda.MemPool with ProcessGroupNCCL.mem_allocator"
    )
    allocator = _nccl_allocator("create_nccl_mem_pool")
    if symmetric is None:
        return torch.cuda.MemPool(allocator)
    accepted = _parameters(torch.cuda.MemPool)
    if "symmetric" in accepted:
        return torch.cuda.MemPool(allocator, symmetric=symmetric)
    if "symm_mem" in accepted:  # NVIDIA's PyTorch builds name it so
        return torch.cuda.MemPool(allocator, symm_mem=symmetric)
    if _register_takes_symm():
        pool = torch.cuda.MemPool(allocator)
        setattr(pool, _SYMMETRIC_ATTRIBUTE, symmetric)
        return pool
    raise ValueError(
        f"create_nccl_mem_pool: symmetric={symmetric} needs torch.cuda.MemPool(symmetric=...) or "
        f"ProcessGroupNCCL.register_mem_pool(symm=...), which torch {torch.__version__} lacks; pass symmetric=None"
    )


def init() -> None:
    """Set NCCL's environment for user-buffer registration, before the process group starts (as upstream):
    ``NCCL_NVLS_ENABLE=1`` and ``TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=0`` (registration is per pool, by
    ``nccl_mem``, not per allocation of PyTorch's caching allocator). Needs no GPU; RuntimeError on a PyTorch
    without CUDA or NCCL."""
    _require("init", need_device=False)
    os.environ["NCCL_NVLS_ENABLE"] = "1"
    os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] = "0"


class nccl_mem:
    """Context manager: CUDA allocations on ``device`` inside it come from ``pool``; on entry the pool is
    deregistered from the group's NCCL communicator (registration is per pool, so a pool already holding buffers
    is registered again whole), on exit registered again, with the new buffers.

    Args:
        pool: a ``torch.cuda.MemPool``, normally from ``create_nccl_mem_pool``.
        enabled: False makes it do nothing (as upstream).
        device: None (the current CUDA device), an int, a str or a torch.device naming a CUDA device.
        group: the process group to register with; None for the default one.
    """

    def __init__(self, pool, enabled=True, device=None, group=None):
        self.pool = pool
        self.device = None
        self.group = None
        self.backend = None
        if not enabled:
            self.mem_context = nullcontext()
            return
        _require("nccl_mem")
        if not isinstance(pool, torch.cuda.MemPool):
            raise TypeError(f"nccl_mem: pool must be a torch.cuda.MemPool, got {type(pool).__name__}")
        self.device = _cuda_device("nccl_mem", device)
        self.group = _default_group("nccl_mem") if group is None else group
        self.backend = _nccl_backend("nccl_mem", self.group, self.device)
        for method in ("register_mem_pool", "deregister_mem_pool"):
            if not hasattr(self.backend, method):
                raise RuntimeError(f"nccl_mem: ProcessGroupNCCL of torch {torch.__version__} has no {method}")
        self.mem_context = torch.cuda.use_mem_pool(pool, device=self.device)

    def __enter__(self):
        self.mem_context.__enter__()
        if self.backend is not None:
            try:
                self.backend.deregister_mem_pool(self.pool)
            except RuntimeError:
                pass  # not registered yet (a new pool): nothing to undo
        return self

    def __exit__(self, *exc):
        try:
            if self.backend is not None:
                symmetric = getattr(self.pool, _SYMMETRIC_ATTRIBUTE, None)
                try:
                    if symmetric is None:
                        self.backend.register_mem_pool(self.pool)
                    else:
                        self.backend.register_mem_pool(self.pool, symm=symmetric)
                except RuntimeError as error:
                    warnings.warn(
                        f"nccl_mem: registering the pool with the NCCL communicator failed ({error}); collectives on "
                        "its buffers work but copy through NCCL's own buffers",
                        RuntimeWarning,
                        stacklevel=2,
                    )
        finally:
            self.mem_context.__exit__(*exc)
        return False
