"""Rank workers of the nccl_p2p tests (loaded by path in each process by apex.core.testing.run_ranks,
so absolute imports only)."""

from __future__ import annotations

import nccl_p2p_cuda
import torch
import torch.distributed as dist

from apex.contrib.nccl_p2p import exchange_halos

# (shape, dtype, channels_last) of the halos exchanged; channels_last halos of an H row are
# non-contiguous views, as a halo sliced out of an activation is.
CASES = [
    ((2, 3, 1, 5), torch.float32, False),
    ((1, 4, 2, 3), torch.float16, True),
    ((3, 1, 1, 1), torch.bfloat16, False),
    ((2, 5, 1, 7), torch.int32, True),
]


def halo(seed: int, rank: int, side: int, case: int, device="cpu") -> torch.Tensor:
    """Rank ``rank``'s output halo on ``side`` (0 left, 1 right) of case ``case``: random, distinct per
    rank and side, exactly representable in every dtype of CASES."""
    shape, dtype, _ = CASES[case]
    g = torch.Generator().manual_seed(seed * 1000 + rank * 10 + side + 100 * case)
    return torch.randint(-64, 64, shape, generator=g).to(dtype).to(device)


def _view(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """``t``'s values as a view one row high inside a bigger tensor (non-contiguous where channels_last)."""
    if not channels_last:
        return t.clone()
    big = torch.zeros(t.shape[0], t.shape[1], t.shape[2] + 2, t.shape[3], dtype=t.dtype, device=t.device)
    big = big.contiguous(memory_format=torch.channels_last)
    view = big[:, :, 1 : 1 + t.shape[2], :]
    view.copy_(t)
    return view


def _device():
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def legacy(rank: int, world: int, seed: int):
    """Every case through nccl_p2p_cuda (in place and returning), neighbours rank-1 and rank+1 (wrapped
    around, and -1 at the ends). Returns {wrap: {(case, mode): (left_input, right_input)}}."""
    device = _device()
    unique_id = nccl_p2p_cuda.get_unique_nccl_id(1).to(device)
    dist.broadcast(unique_id, 0)
    handle = nccl_p2p_cuda.init_nccl_comm(unique_id.cpu(), rank, world)
    return {wrap: _legacy_exchanges(handle, rank, world, seed, wrap, device) for wrap in (False, True)}


def _legacy_exchanges(handle, rank, world, seed, wrap, device):
    left = (rank - 1) % world if wrap or rank > 0 else -1
    right = (rank + 1) % world if wrap or rank < world - 1 else -1
    out = {}
    for case, (_, _, channels_last) in enumerate(CASES):
        lo = _view(halo(seed, rank, 0, case, device), channels_last)
        ro = _view(halo(seed, rank, 1, case, device), channels_last)
        li = _view(torch.full_like(lo, 77), channels_last)  # poisoned: every element must be written
        ri = _view(torch.full_like(ro, 77), channels_last)
        assert nccl_p2p_cuda.left_right_halo_exchange_inplace(handle, left, right, lo, ro, li, ri) is None
        out[(case, "inplace")] = (li.cpu(), ri.cpu())
        got = nccl_p2p_cuda.left_right_halo_exchange(handle, left, right, lo, ro)
        assert isinstance(got, list) and len(got) == 2
        out[(case, "returned")] = (got[0].cpu(), got[1].cpu())
        # the outputs are only read
        torch.testing.assert_close(lo.cpu(), halo(seed, rank, 0, case), rtol=0, atol=0)
    nccl_p2p_cuda.add_delay(10)
    return out


def mismatched_id(rank: int, world: int):
    """Every rank passes its own random id: init_nccl_comm must refuse on every rank."""
    try:
        nccl_p2p_cuda.init_nccl_comm(nccl_p2p_cuda.get_unique_nccl_id(1), rank, world)
    except ValueError as e:
        return str(e)
    return None


def group_subset(rank: int, world: int, seed: int):
    """exchange_halos on global ranks of a subset: the odd ranks exchange among themselves, in a chain;
    the even ones do not take part."""
    members = [r for r in range(world) if r % 2 == 1]
    if rank not in members:
        return None
    i = members.index(rank)
    left = members[i - 1] if i > 0 else -1
    right = members[i + 1] if i < len(members) - 1 else -1
    lo, ro = halo(seed, rank, 0, 0), halo(seed, rank, 1, 0)
    li, ri = torch.full_like(lo, 77), torch.full_like(ro, 77)
    exchange_halos(left, right, lo, ro, li, ri)
    return li, ri
