"""``PeerHaloExchanger1d``: upstream's in-place 1-D halo exchange, on torch.distributed."""

from __future__ import annotations

import torch

from apex.contrib.nccl_p2p import exchange_halos

__all__ = ["PeerHaloExchanger1d"]


class PeerHaloExchanger1d:
    """Exchange ``half_halo`` rows (H split) or columns (W split) of a padded activation with the
    neighbouring ranks of a group, in place.

    Args:
        ranks: the global ranks of the group, in spatial order.
        rank_in_group: this process's index in ``ranks`` (``ranks[rank_in_group]`` must be its rank).
        peer_pool: a :class:`~apex.contrib.peer_memory.PeerMemoryPool` (kept, as upstream; ours takes
            no buffers from it, so ``peer_pool.reset()`` between calls is harmless and not needed).
        half_halo: rows (columns) on each side, an int >= 1.

    ``__call__(y, H_split=True, explicit_nhwc=False, numSM=0, diagnostics=False)``: ``y`` is this
    rank's slice padded by ``half_halo`` on both sides of the split dimension: H (dim 2 of NCHW, dim 1
    of explicit NHWC ``[N, H, W, C]``) or W (dim 3 of NCHW, dim 2 of explicit NHWC); with ``Hs`` its
    padded size and ``H = Hs - 2*half_halo``, rows ``[half_halo, 2*half_halo)`` go to the previous
    rank, rows ``[H, H + half_halo)`` to the next; rows ``[0, half_halo)`` are overwritten by the
    previous rank's and ``[H + half_halo, Hs)`` by the next rank's. The first rank's leading halo and
    the last rank's trailing halo are zeroed (no wrap-around), as upstream. Every rank of the group
    calls it together. Any dtype, contiguous or channels-last; returns None.

    Differs from upstream: the halos travel by ``torch.distributed`` point-to-point (any backend),
    not by a kernel writing into peers' memory; ``numSM`` (SMs for upstream's kernel) and
    ``diagnostics`` (its debug printing) are checked and otherwise unused; ``explicit_nhwc`` only picks
    the dimensions, as upstream.
    """

    def __init__(self, ranks, rank_in_group: int, peer_pool, half_halo: int):
        import torch.distributed as dist

        ranks = [int(r) for r in ranks]
        if not 0 <= rank_in_group < len(ranks):
            raise ValueError(f"PeerHaloExchanger1d: rank_in_group {rank_in_group} is not an index of ranks {ranks}")
        if dist.is_initialized() and ranks[rank_in_group] != dist.get_rank():
            raise ValueError(
                f"PeerHaloExchanger1d: ranks[rank_in_group] is {ranks[rank_in_group]} but this process is rank "
                f"{dist.get_rank()}"
            )
        if isinstance(half_halo, bool) or not isinstance(half_halo, int) or half_halo < 1:
            raise ValueError(f"PeerHaloExchanger1d: half_halo must be an int >= 1, got {half_halo!r}")
        self.ranks = ranks
        self.peer_group_size = len(ranks)
        self.peer_rank = rank_in_group
        self.low_neighbor = (rank_in_group + self.peer_group_size - 1) % self.peer_group_size
        self.high_neighbor = (rank_in_group + 1) % self.peer_group_size
        self.low_zero = rank_in_group == 0
        self.high_zero = rank_in_group == self.peer_group_size - 1
        self.peer_pool = peer_pool
        self.half_halo = half_halo

    def __call__(self, y, H_split=True, explicit_nhwc=False, numSM=0, diagnostics=False):
        if not isinstance(y, torch.Tensor) or y.dim() != 4:
            raise ValueError(f"PeerHaloExchanger1d: y must be a 4-D tensor, got {getattr(y, 'shape', type(y))}")
        if isinstance(numSM, bool) or not isinstance(numSM, int) or numSM < 0:
            raise ValueError(f"PeerHaloExchanger1d: numSM must be an int >= 0, got {numSM!r}")
        dim = (1 if H_split else 2) if explicit_nhwc else (2 if H_split else 3)
        hh = self.half_halo
        padded = y.shape[dim]
        inner = padded - 2 * hh
        if inner < hh:
            raise ValueError(
                f"PeerHaloExchanger1d: y has {padded} along dim {dim} ({'H' if H_split else 'W'}); with half_halo "
                f"{hh} it needs at least {3 * hh} (the halos on both sides and {hh} inside to send)"
            )
        low_out = y.narrow(dim, hh, hh)
        low_inp = y.narrow(dim, 0, hh)
        high_out = y.narrow(dim, inner, hh)
        high_inp = y.narrow(dim, inner + hh, hh)
        left = -1 if self.low_zero else self.ranks[self.low_neighbor]
        right = -1 if self.high_zero else self.ranks[self.high_neighbor]
        # inner >= half_halo: the rows sent and the rows received never overlap.
        exchange_halos(left, right, low_out, high_out, low_inp, high_inp, op="PeerHaloExchanger1d")
