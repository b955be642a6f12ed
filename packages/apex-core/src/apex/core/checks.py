"""Argument checks shared by every reference and fake implementation.

They read only metadata (dtype, device, shape, strides), so they run unchanged on fake
tensors under ``torch.compile``; the CUDA kernels perform the same checks in C++ with the
same wording, so a bad argument gets one clear error on every path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def placed(op: str, name: str, t: torch.Tensor, device: torch.device) -> None:
    """A strided tensor on ``device``."""
    if t.layout != torch.strided:
        raise ValueError(f"{op}: {name} has layout {t.layout}; only dense (strided) tensors are supported")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, expected {device}")


def dense(op: str, name: str, t: torch.Tensor, device: torch.device) -> None:
    """A strided, contiguous tensor on ``device``."""
    placed(op, name, t, device)
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} is not contiguous")


def rows(op: str, name: str, t: torch.Tensor, device: torch.device) -> None:
    """A strided 2-D tensor on ``device`` whose rows are each contiguous (unit stride along the
    last dimension) and do not overlap, at any row stride: a contiguous tensor, or a view of the
    first columns of a wider one, as Inductor's padded matmuls produce (``mm(a, pad(b))[:, :n]``)."""
    placed(op, name, t, device)
    n_rows, n_cols = t.shape
    if (n_cols > 1 and t.stride(1) != 1) or (n_rows > 1 and t.stride(0) < n_cols):
        raise ValueError(
            f"{op}: {name} must have contiguous rows (unit stride along its last dimension, rows not "
            f"overlapping), got strides {tuple(t.stride())} for shape {tuple(t.shape)}"
        )


def same_lengths(op: str, **lists: Sequence) -> int:
    lengths = {name: len(value) for name, value in lists.items()}
    if len(set(lengths.values())) > 1:
        described = ", ".join(f"{name} has {n}" for name, n in lengths.items())
        raise ValueError(f"{op}: tensor lists must have the same length ({described})")
    return next(iter(lengths.values()), 0)


def is_dense(t: torch.Tensor) -> bool:
    """Contiguous, or a permutation of a contiguous layout (channels-last, a transpose): the
    elements fill ``numel`` consecutive places of the storage, so an element-wise kernel over
    the storage sees each once."""
    if t.is_contiguous():
        return True
    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(stride for size, stride in zip(t.shape, t.stride()) if size != 1)


def same_layouts(op: str, **lists: Sequence[torch.Tensor]) -> None:
    """Tensors at one index of the lists are all contiguous, or have one shape and one stride
    order (checked with :func:`tensor_list`'s density): an element-wise kernel over the storage
    then pairs the same elements. Lists shorter than the first are skipped past their end."""
    named = list(lists.items())
    for i in range(max((len(v) for v in lists.values()), default=0)):
        at = [(name, tensors[i]) for name, tensors in named if i < len(tensors)]
        odd = next(((name, t) for name, t in at if not t.is_contiguous()), None)
        if odd is None:
            continue
        odd_name, odd_t = odd
        for name, t in at:
            if t is not odd_t and _layout(t) != _layout(odd_t):
                raise ValueError(
                    f"{op}: {odd_name}[{i}] is not contiguous and {name}[{i}] has another layout (shape "
                    f"{tuple(odd_t.shape)} strides {odd_t.stride()} vs shape {tuple(t.shape)} strides {t.stride()}); "
                    "a non-contiguous tensor needs the same shape and strides at its index of every list"
                )


def tensor_list(
    op: str,
    name: str,
    tensors: Sequence[torch.Tensor],
    device: torch.device | None,
    dtypes=FLOAT_DTYPES,
    dense: bool = True,
) -> torch.device | None:
    """Check one list's tensors: one dtype among ``dtypes``, one device, dense (contiguous or a
    permutation of it, such as channels-last: see :func:`is_dense`; ops taking several lists
    also check :func:`same_layouts`). Returns the device."""
    first_dtype = None
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name}[{i}] is a {type(t).__name__}, not a Tensor")
        if t.layout != torch.strided:
            raise ValueError(f"{op}: {name}[{i}] has layout {t.layout}; only dense (strided) tensors are supported")
        if t.dtype not in dtypes:
            raise TypeError(f"{op}: {name}[{i}] has dtype {t.dtype}; expected one of {_dtype_names(dtypes)}")
        if first_dtype is None:
            first_dtype = t.dtype
        elif t.dtype != first_dtype:
            raise TypeError(
                f"{op}: {name}[{i}] has dtype {t.dtype} but {name}[0] has {first_dtype}; "
                "all tensors of one list must share a dtype"
            )
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"{op}: {name}[{i}] is on {t.device}, expected {device}")
        if dense and not is_dense(t):
            raise ValueError(
                f"{op}: {name}[{i}] is not contiguous and not dense (a strided view with gaps or overlaps, "
                f"shape {tuple(t.shape)} strides {t.stride()}); pass a contiguous tensor"
            )
    return device


def scalar_tensor(op: str, name: str, t: torch.Tensor, dtypes, device: torch.device | None) -> torch.device:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected {_dtype_names(dtypes)}")
    if t.numel() != 1:
        raise ValueError(f"{op}: {name} must have exactly one element, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, expected {device}")
    return t.device


def positive_chunk_size(op: str, chunk_size: int) -> None:
    if chunk_size <= 0:
        raise ValueError(f"{op}: chunk_size must be positive, got {chunk_size}")
