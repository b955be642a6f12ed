"""Upstream Apex's ``peer_memory_cuda`` extension module, as far as it maps onto local memory
(apex-contrib-peer-memory).

Upstream's functions and argument orders:

- ``allocate_raw(size) -> int``: ``size`` zeroed bytes on the current CUDA device (the CPU without CUDA);
  the int is their address, as upstream (a ``uint8`` tensor kept here owns them);
- ``free_raw(raw)``, ``zero(raw, size)``: free / zero ``size`` bytes from ``raw`` (an address inside
  an allocation of ``allocate_raw``);
- ``blob_view_half / blob_view_float / blob_view_int(raw, shape, channels_last) -> tensor``: a float16 /
  float32 / int32 tensor over the bytes from ``raw`` (channels-last strides for a 4-D shape);
- ``get_raw_ipc_address``, ``get_raw_peers``, ``push_pull_halos_1d``: raise NotImplementedError. They
  share GPU memory between processes through CUDA IPC handles, which PyTorch exposes no public API for;
  ours exchange halos through torch.distributed instead: use ``apex.contrib.peer_memory.PeerHaloExchanger1d``
  (or ``apex.contrib.nccl_p2p.exchange_halos``).

Addresses outside this process's allocations raise ValueError (upstream would read or write there).
"""

from __future__ import annotations

import torch

from apex.contrib.peer_memory.peer_memory import carve

__all__ = [
    "allocate_raw",
    "blob_view_float",
    "blob_view_half",
    "blob_view_int",
    "free_raw",
    "get_raw_ipc_address",
    "get_raw_peers",
    "push_pull_halos_1d",
    "zero",
]

_ALLOCATIONS: dict[int, torch.Tensor] = {}

_NO_IPC = (
    "{}: upstream shares GPU memory between processes through CUDA IPC handles, which PyTorch has no public "
    "API for; apex's peer memory exchanges halos through torch.distributed instead: use "
    "apex.contrib.peer_memory.PeerHaloExchanger1d (or apex.contrib.nccl_p2p.exchange_halos)"
)


def allocate_raw(size: int) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"allocate_raw: size must be an int >= 1 (bytes), got {size!r}")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    buffer = torch.zeros(size, dtype=torch.uint8, device=device)
    _ALLOCATIONS[buffer.data_ptr()] = buffer
    return buffer.data_ptr()


def _locate(op: str, raw: int, nbytes: int) -> tuple[torch.Tensor, int]:
    """The allocation holding bytes ``[raw, raw + nbytes)`` and ``raw``'s offset in it."""
    for base, buffer in _ALLOCATIONS.items():
        if base <= raw and raw + nbytes <= base + buffer.numel():
            return buffer, raw - base
    raise ValueError(f"{op}: raw {raw:#x} (+{nbytes} bytes) is not inside a buffer of allocate_raw in this process")


def free_raw(raw: int) -> None:
    if raw not in _ALLOCATIONS:
        raise ValueError(f"free_raw: raw {raw:#x} was not returned by allocate_raw (or is freed)")
    del _ALLOCATIONS[raw]


def zero(raw: int, size: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"zero: size must be an int >= 0 (bytes), got {size!r}")
    buffer, offset = _locate("zero", raw, size)
    buffer[offset : offset + size].zero_()


def _blob_view(op: str, dtype: torch.dtype, raw: int, shape, channels_last: bool) -> torch.Tensor:
    shape = [int(s) for s in shape]
    if any(s < 0 for s in shape):
        raise ValueError(f"{op}: shape must hold sizes >= 0, got {shape}")
    nbytes = dtype.itemsize
    for s in shape:
        nbytes *= s
    if raw % dtype.itemsize:
        raise ValueError(f"{op}: raw {raw:#x} is not aligned to {dtype.itemsize} bytes")
    buffer, offset = _locate(op, raw, nbytes)
    return carve(buffer, offset, shape, dtype, bool(channels_last))


def blob_view_half(raw: int, shape, channels_last: bool) -> torch.Tensor:
    return _blob_view("blob_view_half", torch.float16, raw, shape, channels_last)


def blob_view_float(raw: int, shape, channels_last: bool) -> torch.Tensor:
    return _blob_view("blob_view_float", torch.float32, raw, shape, channels_last)


def blob_view_int(raw: int, shape, channels_last: bool) -> torch.Tensor:
    return _blob_view("blob_view_int", torch.int32, raw, shape, channels_last)


def get_raw_ipc_address(raw):
    raise NotImplementedError(_NO_IPC.format("get_raw_ipc_address"))


def get_raw_peers(ipc_addresses, peer_rank, raw):
    raise NotImplementedError(_NO_IPC.format("get_raw_peers"))


def push_pull_halos_1d(*args):
    raise NotImplementedError(_NO_IPC.format("push_pull_halos_1d"))
