"""``PeerMemoryPool``: upstream's pool of peer-accessible buffers, as ordinary local tensors.

Upstream allocates one raw CUDA buffer per rank, all-gathers CUDA IPC handles and opens every peer's
buffer, so that ``allocate_peer_tensors`` returns, for each rank of the peer group, a view into *that
rank's* memory, which a kernel then writes to directly. PyTorch has no public API for that, and ours
moves halos with torch.distributed instead (:class:`~apex.contrib.peer_memory.PeerHaloExchanger1d`).

So here the pool keeps upstream's interface and bookkeeping (256-byte alignment, separate static and
dynamic regions, "pool exhausted" when a region is full, ``reset()`` of the dynamic region) over local
buffers: ``allocate_peer_tensors`` returns one tensor per peer rank, each carved at the same offset from a
local buffer of that index. The entry of this rank is its own; the others are local stand-ins: writing to
them does **not** reach the peer.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["PeerMemoryPool"]

ALIGNMENT = 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int32)


def _aligned(size: int) -> int:
    return (size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def carve(buffer: torch.Tensor, offset: int, shape, dtype: torch.dtype, channels_last: bool) -> torch.Tensor:
    """A ``dtype`` tensor of ``shape`` over the bytes of the uint8 ``buffer`` from ``offset`` (channels-last
    strides for a 4-D shape with ``channels_last``)."""
    shape = [int(s) for s in shape]
    nbytes = math.prod(shape) * dtype.itemsize
    flat = buffer[offset : offset + nbytes].view(dtype)
    if channels_last and len(shape) == 4:
        _, c, h, w = shape
        return flat.as_strided(shape, (h * w * c, 1, w * c, c))
    return flat.view(shape)


class PeerMemoryPool:
    """A pool of per-peer buffers of ``static_size`` + ``dynamic_size`` bytes (each rounded up to 256).

    Args:
        static_size: bytes of the static region (tensors that live for the whole run).
        dynamic_size: bytes of the dynamic region (tensors of one step; ``reset()`` frees them all).
        peer_ranks: the global ranks of the peer group, this rank among them; None: every rank of the
            default process group (upstream: the ranks of this node).
        device: where the buffers live (keyword-only, ours); None: the current CUDA device if CUDA is
            available, else the CPU.

    Needs an initialised default process group, as upstream (which all-gathers IPC handles; ours
    communicates nothing here). Differs from upstream: see the module docstring.
    """

    def __init__(self, static_size: int, dynamic_size: int, peer_ranks=None, *, device=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("PeerMemoryPool: torch.distributed is not initialised; call init_process_group first")
        for name, size in (("static_size", static_size), ("dynamic_size", dynamic_size)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ValueError(f"PeerMemoryPool: {name} must be an int >= 0 (bytes), got {size!r}")
        rank = dist.get_rank()
        if peer_ranks is None:
            peer_ranks = list(range(dist.get_world_size()))
        peer_ranks = [int(r) for r in peer_ranks]
        if rank not in peer_ranks:
            raise ValueError(f"PeerMemoryPool: peer_ranks {peer_ranks} does not hold this process's rank {rank}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.alignment = ALIGNMENT
        self.rank = rank
        self.peer_ranks = peer_ranks
        self.peer_group_size = len(peer_ranks)
        self.peer_rank = peer_ranks.index(rank)
        self.static_size = _aligned(static_size)
        self.dynamic_size = _aligned(dynamic_size)
        self.static_offset = 0
        self.dynamic_offset = 0
        self.device = torch.device(device)
        total = self.static_size + self.dynamic_size
        self.peer_raw = [torch.zeros(total, dtype=torch.uint8, device=self.device) for _ in peer_ranks]

    def reset(self) -> None:
        """Free every dynamic tensor (the dynamic region starts over)."""
        self.dynamic_offset = 0

    def allocate_peer_tensors(self, shape, dtype, channels_last: bool, dynamic: bool) -> list[torch.Tensor]:
        """One tensor of ``shape`` and ``dtype`` per peer rank (in ``peer_ranks``' order), from the dynamic
        region if ``dynamic`` else the static one; ``channels_last`` strides for a 4-D shape.

        dtype: float16, bfloat16 (ours), float32 or int32. RuntimeError when the region is exhausted, as
        upstream's assertion (upstream also refuses an allocation that fills the region exactly).
        Element ``peer_rank`` is this rank's; the others are local tensors (module docstring)."""
        if dtype not in DTYPES:
            raise TypeError(
                f"allocate_peer_tensors: dtype {dtype} not supported; expected float16, bfloat16, float32 or int32"
            )
        if any(isinstance(s, bool) or int(s) < 0 for s in shape):
            raise ValueError(f"allocate_peer_tensors: shape must hold sizes >= 0, got {list(shape)}")
        nbytes = math.prod(int(s) for s in shape) * dtype.itemsize
        if dynamic:
            start = _aligned(self.dynamic_offset)
            if start + nbytes >= self.dynamic_size:
                raise RuntimeError("Dynamic peer memory pool exhausted")
            self.dynamic_offset = start + nbytes
            start += self.static_size
        else:
            start = _aligned(self.static_offset)
            if start + nbytes >= self.static_size:
                raise RuntimeError("Static peer memory pool exhausted")
            self.static_offset = start + nbytes
        return [carve(raw, start, shape, dtype, channels_last) for raw in self.peer_raw]
