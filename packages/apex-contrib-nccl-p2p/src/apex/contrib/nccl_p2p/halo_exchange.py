"""Left/right halo exchanges over torch.distributed, and upstream's ``nccl_p2p_cuda`` functions.

Upstream builds a second NCCL communicator from a ``ncclUniqueId`` and calls ``ncclSend``/``ncclRecv``
on it. Ours are public PyTorch: ``torch.distributed.batch_isend_irecv`` on a process group, so they
run on any backend (gloo on the CPU in the tests, NCCL on GPUs) with the current stream ordering that
torch.distributed gives (the returned works are waited on before the function returns).

``exchange_halos`` is the one implementation; the exchangers of ``apex.contrib.peer_memory`` and
``apex.contrib.bottleneck`` call it too.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = [
    "add_delay",
    "exchange_halos",
    "get_unique_nccl_id",
    "init_nccl_comm",
    "left_right_halo_exchange",
    "left_right_halo_exchange_inplace",
]

# sizeof(ncclUniqueId): upstream's id tensors are [n, 128] uint8.
UNIQUE_ID_BYTES = 128

_COMMUNICATORS: list[dist.ProcessGroup] = []


def _check_halos(op, left_output_halo, right_output_halo, left_input_halo, right_input_halo) -> None:
    named = {
        "left_output_halo": left_output_halo,
        "right_output_halo": right_output_halo,
        "left_input_halo": left_input_halo,
        "right_input_halo": right_input_halo,
    }
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if left_output_halo.numel() == 0:
        raise ValueError(f"{op}: left_output_halo is empty (shape {tuple(left_output_halo.shape)})")
    for name, t in named.items():
        if t.numel() != left_output_halo.numel():
            raise ValueError(
                f"{op}: {name} has {t.numel()} elements (shape {tuple(t.shape)}); every halo must have as many "
                f"as left_output_halo, {left_output_halo.numel()} (shape {tuple(left_output_halo.shape)})"
            )
        if t.dtype != left_output_halo.dtype:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected left_output_halo's, {left_output_halo.dtype}")
        if t.device != left_output_halo.device:
            raise ValueError(
                f"{op}: {name} is on {t.device}; expected left_output_halo's device, {left_output_halo.device}"
            )


def exchange_halos(
    left_rank: int,
    right_rank: int,
    left_output_halo: torch.Tensor,
    right_output_halo: torch.Tensor,
    left_input_halo: torch.Tensor,
    right_input_halo: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    op: str = "exchange_halos",
) -> None:
    """Send ``left_output_halo`` to ``left_rank`` and ``right_output_halo`` to ``right_rank``; receive
    ``left_rank``'s right output halo into ``left_input_halo`` and ``right_rank``'s left output halo
    into ``right_input_halo``. A negative rank means "no neighbour": that input halo is zeroed and
    nothing is sent that way. Ranks are global ranks (``group`` None: the default group).

    Every rank named as a neighbour must make the matching call. Halos of any shape and memory
    format: elements are matched in logical (row-major) order, non-contiguous halos go through a
    contiguous staging copy (gloo and NCCL send contiguous buffers only).
    """
    _check_halos(op, left_output_halo, right_output_halo, left_input_halo, right_input_halo)
    ops, staged = [], []

    def send(t: torch.Tensor, peer: int) -> None:
        ops.append(dist.P2POp(dist.isend, t.contiguous(), peer, group))

    def recv(t: torch.Tensor, peer: int) -> None:
        buf = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
        ops.append(dist.P2POp(dist.irecv, buf, peer, group))
        if buf is not t:
            staged.append((t, buf))

    # Sends right-going first and receives from the left first: where both neighbours are one rank
    # (two ranks, wrapped around), in-order matching of one peer's messages then still pairs each
    # receive with the right send.
    if right_rank >= 0:
        send(right_output_halo, right_rank)
    if left_rank >= 0:
        send(left_output_halo, left_rank)
    if left_rank >= 0:
        recv(left_input_halo, left_rank)
    if right_rank >= 0:
        recv(right_input_halo, right_rank)
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for t, buf in staged:
        t.copy_(buf)
    if left_rank < 0:
        left_input_halo.zero_()
    if right_rank < 0:
        right_input_halo.zero_()


def get_unique_nccl_id(n: int) -> torch.Tensor:
    """``n`` random ids, a CPU uint8 tensor ``[n, 128]`` (upstream: ``n`` ``ncclUniqueId``).

    Ours are 128 random bytes each: :func:`init_nccl_comm` only checks that every rank passed the
    same id (the caller broadcasts it, as with upstream); it does not create a NCCL communicator
    from it.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"get_unique_nccl_id: n must be a positive int, got {n!r}")
    return torch.frombuffer(bytearray(os.urandom(n * UNIQUE_ID_BYTES)), dtype=torch.uint8).reshape(n, UNIQUE_ID_BYTES)


def _collective_device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_nccl_comm(unique_nccl_id: torch.Tensor, my_rank: int, num_ranks: int) -> int:
    """A handle (an int, as upstream) to a torch.distributed process group over ranks ``0 ..
    num_ranks-1`` of the default group, for the halo exchanges below.

    Collective: every rank of the default group calls it. Differs from upstream: the default process
    group must be initialised and span exactly ``num_ranks`` ranks, with ``my_rank`` this process's
    rank (raises otherwise); the group is made by ``torch.distributed.new_group`` on the default
    backend, not by ``ncclCommInitRank``. ``unique_nccl_id`` (the first 128 bytes) is all-gathered
    over the new group and must be the same on every rank (ValueError on every rank otherwise);
    it is not used further.
    """
    op = "init_nccl_comm"
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{op}: torch.distributed is not initialised; call init_process_group first")
    if not isinstance(unique_nccl_id, torch.Tensor) or unique_nccl_id.dtype != torch.uint8:
        raise TypeError(f"{op}: unique_nccl_id must be a uint8 tensor (from get_unique_nccl_id)")
    if unique_nccl_id.numel() < UNIQUE_ID_BYTES:
        raise ValueError(
            f"{op}: unique_nccl_id has {unique_nccl_id.numel()} bytes; expected at least {UNIQUE_ID_BYTES}"
        )
    world = dist.get_world_size()
    if num_ranks != world:
        raise ValueError(f"{op}: num_ranks is {num_ranks} but the default process group has {world} ranks")
    if my_rank != dist.get_rank():
        raise ValueError(f"{op}: my_rank is {my_rank} but this process is rank {dist.get_rank()}")
    group = dist.new_group(ranks=list(range(world)))
    device = _collective_device(group)
    mine = unique_nccl_id.reshape(-1)[:UNIQUE_ID_BYTES].to(device)
    ids = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(ids, mine, group=group)
    if any(not torch.equal(other, mine) for other in ids):
        raise ValueError(f"{op}: unique_nccl_id differs across ranks; broadcast one id from one rank first")
    _COMMUNICATORS.append(group)
    return len(_COMMUNICATORS) - 1


def _communicator(op: str, handle: int) -> dist.ProcessGroup:
    if isinstance(handle, bool) or not isinstance(handle, int) or not 0 <= handle < len(_COMMUNICATORS):
        raise ValueError(f"{op}: handle {handle!r} was not returned by init_nccl_comm in this process")
    return _COMMUNICATORS[handle]


def _check_rank(op: str, name: str, rank: int, group: dist.ProcessGroup) -> None:
    size = dist.get_world_size(group)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank >= size:
        raise ValueError(
            f"{op}: {name} must be an int below the communicator's {size} ranks (negative: none), got {rank!r}"
        )


def left_right_halo_exchange_inplace(
    handle: int,
    left_rank: int,
    right_rank: int,
    left_output_halo: torch.Tensor,
    right_output_halo: torch.Tensor,
    left_input_halo: torch.Tensor,
    right_input_halo: torch.Tensor,
) -> None:
    """Upstream's in-place exchange on the communicator ``handle``: ``left_output_halo`` goes to
    ``left_rank`` (its ``right_input_halo``), ``right_output_halo`` to ``right_rank`` (its
    ``left_input_halo``); a negative rank zeroes that input halo. Returns None."""
    op = "left_right_halo_exchange_inplace"
    group = _communicator(op, handle)
    _check_rank(op, "left_rank", left_rank, group)
    _check_rank(op, "right_rank", right_rank, group)
    # The communicator spans the default group's ranks in order: its ranks are global ranks.
    exchange_halos(
        left_rank, right_rank, left_output_halo, right_output_halo, left_input_halo, right_input_halo, group, op
    )


def left_right_halo_exchange(
    handle: int, left_rank: int, right_rank: int, left_output_halo: torch.Tensor, right_output_halo: torch.Tensor
) -> list[torch.Tensor]:
    """As :func:`left_right_halo_exchange_inplace` into new tensors: returns ``[left_input_halo,
    right_input_halo]`` (``empty_like(right_output_halo)`` and ``empty_like(left_output_halo)`` filled)."""
    for name, t in (("left_output_halo", left_output_halo), ("right_output_halo", right_output_halo)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"left_right_halo_exchange: {name} must be a tensor, got {type(t).__name__}")
    left_input_halo = torch.empty_like(right_output_halo)
    right_input_halo = torch.empty_like(left_output_halo)
    op = "left_right_halo_exchange"
    group = _communicator(op, handle)
    _check_rank(op, "left_rank", left_rank, group)
    _check_rank(op, "right_rank", right_rank, group)
    exchange_halos(
        left_rank, right_rank, left_output_halo, right_output_halo, left_input_halo, right_input_halo, group, op
    )
    return [left_input_halo, right_input_halo]


def add_delay(delay: int) -> None:
    """Upstream spins a one-thread CUDA kernel for ``delay`` nanoseconds on the current stream, a
    scheduling hint to overlap halo convolutions. Ours checks ``delay`` (an int >= 0) and does
    nothing: no kernel of ours needs the hint, and delaying the stream changes no result."""
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
        raise ValueError(f"add_delay: delay must be an int >= 0 (nanoseconds), got {delay!r}")
