"""Rank workers of the peer-memory tests (loaded by path in each process by apex.core.testing.run_ranks,
so absolute imports only)."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from apex.contrib.peer_memory import PeerHaloExchanger1d, PeerMemoryPool

LAYOUTS = ("nchw", "channels_last", "explicit_nhwc")


def _device():
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _split_dim(layout: str, h_split: bool) -> int:
    if layout == "explicit_nhwc":
        return 1 if h_split else 2
    return 2 if h_split else 3


def one_case(halo_ex, ranks, rank_in_group, layout, h_split, half_halo, dtype, inner, seed):
    """Run the exchanger on a padded random slice; compare with the slice of the whole (all-gathered)
    tensor around this rank's part, zeros beyond the ends. Returns the number of elements compared."""
    device = _device()
    dim = _split_dim(layout, h_split)
    shape = [2, 3, 5, 4] if layout != "explicit_nhwc" else [2, 5, 4, 3]  # N, C, H, W or N, H, W, C
    shape[dim] = inner + 2 * half_halo
    g = torch.Generator().manual_seed(seed + 7919 * rank_in_group)
    y = torch.randn(shape, generator=g).to(dtype).to(device)
    if layout == "channels_last":
        y = y.contiguous(memory_format=torch.channels_last)
    original = y.clone()
    # the reference: every rank's unpadded part, gathered in group order, with half_halo zeros each end
    mine = y.narrow(dim, half_halo, inner).contiguous()
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    ordered = [parts[r] for r in ranks]
    zeros = torch.zeros_like(mine.narrow(dim, 0, half_halo))
    whole = torch.cat([zeros, *ordered, zeros], dim)
    expected = whole.narrow(dim, rank_in_group * inner, inner + 2 * half_halo)

    result = halo_ex(y, h_split, layout == "explicit_nhwc")
    assert result is None
    assert y.stride() == original.stride()  # in place, same tensor
    torch.testing.assert_close(y.cpu(), expected.cpu(), rtol=0, atol=0, msg=f"{layout} H_split={h_split} {dtype}")
    return y.numel()


def exchanges(rank: int, world: int, reverse: bool, seed: int):
    """Every layout, both splits, half_halo 1..3, fp32/fp16/bf16, odd inner sizes (and inner == half_halo);
    the group's order reversed with ``reverse``. Returns the number of elements compared."""
    ranks = list(range(world))[::-1] if reverse else list(range(world))
    rank_in_group = ranks.index(rank)
    pool = PeerMemoryPool(64 * 1024, 1024 * 1024, ranks)
    compared = 0
    for half_halo in (1, 2, 3):
        halo_ex = PeerHaloExchanger1d(ranks, rank_in_group, pool, half_halo)
        dtypes = (torch.float32, torch.float16, torch.bfloat16)
        for i, (layout, h_split) in enumerate(itertools.product(LAYOUTS, (True, False))):
            dtype = dtypes[(i + half_halo) % 3]
            for inner in (half_halo, 5):
                compared += one_case(halo_ex, ranks, rank_in_group, layout, h_split, half_halo, dtype, inner, seed + i)
        pool.reset()
    return compared


def pool_checks(rank: int, world: int):
    """PeerMemoryPool's bookkeeping: one tensor per peer, aligned offsets, separate regions, exhaustion,
    reset, channels-last strides."""
    pool = PeerMemoryPool(1000, 600)  # rounded up to 1024 and 768
    assert (pool.static_size, pool.dynamic_size) == (1024, 768)
    assert pool.peer_ranks == list(range(world)) and pool.peer_rank == rank
    a = pool.allocate_peer_tensors([2, 3], torch.float32, False, False)
    b = pool.allocate_peer_tensors([1, 2, 3, 5], torch.float16, True, False)
    assert len(a) == world and all(t.shape == (2, 3) and t.dtype == torch.float32 for t in a)
    assert b[0].is_contiguous(memory_format=torch.channels_last) and not b[0].is_contiguous()
    start = pool.peer_raw[rank].data_ptr()
    assert a[rank].data_ptr() == start and b[rank].data_ptr() == start + 256  # 24 bytes, next at 256
    d = pool.allocate_peer_tensors([4], torch.int32, False, True)
    assert d[rank].data_ptr() == start + 1024  # the dynamic region follows the static one
    # a write to my tensor lands in my buffer only
    a[rank].fill_(3.0)
    assert torch.all(pool.peer_raw[rank][:24].view(torch.float32) == 3.0)
    assert all(torch.all(pool.peer_raw[r][:24] == 0) for r in range(world) if r != rank)
    errors = []
    for fn in (
        lambda: pool.allocate_peer_tensors([200], torch.float32, False, True),  # 16 + 800 > 768
        lambda: pool.allocate_peer_tensors([200], torch.float32, False, False),
        lambda: pool.allocate_peer_tensors([2], torch.float64, False, False),
        lambda: PeerMemoryPool(10, 10, [r for r in range(world) if r != rank]),
    ):
        try:
            fn()
            errors.append(None)
        except (RuntimeError, TypeError, ValueError) as e:
            errors.append(str(e))
    pool.reset()
    again = pool.allocate_peer_tensors([4], torch.int32, False, True)
    assert again[rank].data_ptr() == start + 1024
    return errors
