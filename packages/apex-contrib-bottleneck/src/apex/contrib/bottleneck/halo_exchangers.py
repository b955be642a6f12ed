"""Halo exchangers for ``SpatialBottleneck``, upstream's classes and call semantics, on torch.distributed.

Each exchanger's ``left_right_halo_exchange(left_output_halo, right_output_halo, left_input_halo=None,
right_input_halo=None)`` sends ``left_output_halo`` to the previous rank of ``ranks`` and
``right_output_halo`` to the next; it receives the previous rank's right output halo as the left input
halo and the next rank's left output halo as the right one, zeroed on the group's first (left) and last
(right) rank. Without input halos it returns ``(left_input_halo, right_input_halo)``; with them it fills
them in place and returns None. Calling an exchanger is the same (upstream's ``HaloPadder`` calls it so).
Every rank of the group calls it together. Halos of any shape, dtype and memory format.

- ``HaloExchangerNoComm(ranks, rank_in_group)``: no communication; returns (or copies) the two output halos
  swapped. For performance tests only, as upstream: its results are wrong for a real split.
- ``HaloExchangerAllGather(ranks, rank_in_group, comm)``: one ``all_gather`` of both halos over the
  process group ``comm`` (whose ranks are ``ranks`` in order; None: the default group).
- ``HaloExchangerSendRecv(ranks, rank_in_group)``: point-to-point through ``nccl_p2p_cuda`` on a handle from
  ``init_nccl_comm`` (collective over the whole default group at construction, as upstream).
- ``HaloExchangerPeer(ranks, rank_in_group, peer_pool, explicit_nhwc, numSM=1)``: upstream's peer-memory
  kernel; ours is the same point-to-point exchange (``peer_pool``, ``explicit_nhwc`` and ``numSM`` are kept
  and unused; see apex-contrib-peer-memory).
- ``HaloPadder(halo_ex)``: ``__call__(y, half_halo, explicit_nhwc, H_split)`` returns ``y`` padded by
  ``half_halo`` rows (columns) on each side of H (W), the pads holding the neighbours' edge rows; ``wait()``
  makes the current CUDA stream wait for it (it runs on side streams on CUDA, as upstream).

Differs from upstream: any backend (gloo on the CPU); the all-gather exchanger takes halos of any shape
(upstream: explicit NHWC only); on CUDA the side streams first wait for the current stream (upstream's
``HaloPadder`` does not, a race). Upstream's ``HaloPadder`` calls ``torch.empty(shape=...)``, which fails;
ours works.
"""

from __future__ import annotations

import nccl_p2p_cuda
import torch
import torch.distributed as dist

from apex.contrib.nccl_p2p import exchange_halos

__all__ = [
    "HaloExchanger",
    "HaloExchangerAllGather",
    "HaloExchangerNoComm",
    "HaloExchangerPeer",
    "HaloExchangerSendRecv",
    "HaloPadder",
]


def _streams(count: int):
    return [torch.cuda.Stream() if torch.cuda.is_available() else None for _ in range(count)]


class HaloExchanger:
    """Neighbours of ``ranks[rank_in_group]`` in ``ranks``: ``left_rank`` / ``right_rank`` (-1 at the
    ends), ``left_zero`` / ``right_zero``, and the wrapped-around indices, as upstream."""

    def __init__(self, ranks, rank_in_group):
        ranks = [int(r) for r in ranks]
        if not 0 <= rank_in_group < len(ranks):
            raise ValueError(f"{type(self).__name__}: rank_in_group {rank_in_group} is not an index of ranks {ranks}")
        self.stream1, self.stream2, self.stream3 = _streams(3)
        self.group_size = len(ranks)
        self.ranks = ranks
        self.rank_in_group = rank_in_group
        self.wrap_around_left_rank_in_group = (rank_in_group + self.group_size - 1) % self.group_size
        self.wrap_around_right_rank_in_group = (rank_in_group + 1) % self.group_size
        self.left_rank = ranks[rank_in_group - 1] if rank_in_group > 0 else -1
        self.left_zero = rank_in_group == 0
        self.right_rank = ranks[rank_in_group + 1] if rank_in_group < self.group_size - 1 else -1
        self.right_zero = rank_in_group == self.group_size - 1

    def _exchange(self, left_output_halo, right_output_halo, left_input_halo, right_input_halo) -> None:
        raise NotImplementedError

    def left_right_halo_exchange(
        self, left_output_halo, right_output_halo, left_input_halo=None, right_input_halo=None
    ):
        if (left_input_halo is None) != (right_input_halo is None):
            raise ValueError(
                f"{type(self).__name__}: pass both left_input_halo and right_input_halo (in place) or neither"
            )
        if left_input_halo is None:
            left_input_halo = torch.empty_like(right_output_halo)
            right_input_halo = torch.empty_like(left_output_halo)
            self._exchange(left_output_halo, right_output_halo, left_input_halo, right_input_halo)
            return left_input_halo, right_input_halo
        self._exchange(left_output_halo, right_output_halo, left_input_halo, right_input_halo)
        return None

    __call__ = left_right_halo_exchange


class HaloExchangerNoComm(HaloExchanger):
    def __init__(self, ranks, rank_in_group):
        super().__init__(ranks, rank_in_group)

    def left_right_halo_exchange(
        self, left_output_halo, right_output_halo, left_input_halo=None, right_input_halo=None
    ):
        if left_input_halo is None:
            return right_output_halo, left_output_halo
        left_input_halo.copy_(right_output_halo)
        right_input_halo.copy_(left_output_halo)
        return None

    __call__ = left_right_halo_exchange


class HaloExchangerAllGather(HaloExchanger):
    def __init__(self, ranks, rank_in_group, comm):
        super().__init__(ranks, rank_in_group)
        self.comm = comm

    def _exchange(self, left_output_halo, right_output_halo, left_input_halo, right_input_halo) -> None:
        if left_output_halo.shape != right_output_halo.shape:
            raise ValueError(
                f"HaloExchangerAllGather: left_output_halo {tuple(left_output_halo.shape)} and right_output_halo "
                f"{tuple(right_output_halo.shape)} must have one shape"
            )
        send = torch.stack([left_output_halo, right_output_halo]).contiguous()
        gathered = torch.empty((self.group_size, *send.shape), dtype=send.dtype, device=send.device)
        dist.all_gather(list(gathered.unbind(0)), send, group=self.comm)
        if self.left_zero:
            left_input_halo.zero_()
        else:
            left_input_halo.copy_(gathered[self.wrap_around_left_rank_in_group, 1])
        if self.right_zero:
            right_input_halo.zero_()
        else:
            right_input_halo.copy_(gathered[self.wrap_around_right_rank_in_group, 0])


class HaloExchangerSendRecv(HaloExchanger):
    def __init__(self, ranks, rank_in_group):
        super().__init__(ranks, rank_in_group)
        if dist.get_rank() != self.ranks[rank_in_group]:
            raise ValueError(
                f"HaloExchangerSendRecv: ranks[{rank_in_group}] is {self.ranks[rank_in_group]} but this process "
                f"is rank {dist.get_rank()}"
            )
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        unique_id = nccl_p2p_cuda.get_unique_nccl_id(1).to(device)
        dist.broadcast(unique_id, 0)
        self.handle = nccl_p2p_cuda.init_nccl_comm(unique_id.cpu(), dist.get_rank(), dist.get_world_size())

    def _exchange(self, left_output_halo, right_output_halo, left_input_halo, right_input_halo) -> None:
        nccl_p2p_cuda.left_right_halo_exchange_inplace(
            self.handle,
            self.left_rank,
            self.right_rank,
            left_output_halo,
            right_output_halo,
            left_input_halo,
            right_input_halo,
        )


class HaloExchangerPeer(HaloExchanger):
    def __init__(self, ranks, rank_in_group, peer_pool, explicit_nhwc, numSM=1):
        super().__init__(ranks, rank_in_group)
        if isinstance(numSM, bool) or not isinstance(numSM, int) or numSM < 0:
            raise ValueError(f"HaloExchangerPeer: numSM must be an int >= 0, got {numSM!r}")
        self.diagnostics = False
        self.explicit_nhwc = explicit_nhwc
        self.numSM = numSM
        self.peer_pool = peer_pool

    def _exchange(self, left_output_halo, right_output_halo, left_input_halo, right_input_halo) -> None:
        exchange_halos(
            self.left_rank,
            self.right_rank,
            left_output_halo,
            right_output_halo,
            left_input_halo,
            right_input_halo,
            op="HaloExchangerPeer",
        )


class HaloPadder:
    """Pads ``y`` with its neighbours' edge rows (columns) through ``halo_ex``; see the module docstring."""

    def __init__(self, halo_ex):
        self.halo_ex = halo_ex
        self.stream1, self.stream2 = _streams(2)

    def __call__(self, y, half_halo, explicit_nhwc, H_split):
        if not isinstance(y, torch.Tensor) or y.dim() != 4:
            raise ValueError(f"HaloPadder: y must be a 4-D tensor, got {getattr(y, 'shape', type(y))}")
        dim = (1 if H_split else 2) if explicit_nhwc else (2 if H_split else 3)
        size = y.shape[dim]
        if isinstance(half_halo, bool) or not isinstance(half_halo, int) or not 1 <= half_halo <= size:
            raise ValueError(
                f"HaloPadder: half_halo must be an int in [1, {size}] (y's size along dim {dim}), got {half_halo!r}"
            )
        shape = list(y.shape)
        shape[dim] += 2 * half_halo
        memory_format = torch.contiguous_format if explicit_nhwc else torch.channels_last
        ypad = torch.empty(shape, dtype=y.dtype, device=y.device, memory_format=memory_format)
        left, middle, right = (
            ypad.narrow(dim, 0, half_halo),
            ypad.narrow(dim, half_halo, size),
            ypad.narrow(dim, half_halo + size, half_halo),
        )
        out_left, out_right = y.narrow(dim, 0, half_halo), y.narrow(dim, size - half_halo, half_halo)
        if y.is_cuda and self.stream1 is not None:
            current = torch.cuda.current_stream()
            self.stream1.wait_stream(current)
            self.stream2.wait_stream(current)
            with torch.cuda.stream(self.stream1):
                self.halo_ex(out_left, out_right, left, right)
            with torch.cuda.stream(self.stream2):
                middle.copy_(y)
        else:
            self.halo_ex(out_left, out_right, left, right)
            middle.copy_(y)
        return ypad

    def wait(self):
        if self.stream1 is not None and torch.cuda.is_available():
            current = torch.cuda.current_stream()
            current.wait_stream(self.stream1)
            current.wait_stream(self.stream2)
