"""PeerHaloExchanger1d and PeerMemoryPool on real gloo process groups (NCCL marked multigpu), against the
slice of the all-gathered whole tensor around each rank's part; the legacy peer_memory_cuda module."""

from __future__ import annotations

from pathlib import Path

import peer_memory_cuda
import pytest
import torch

from apex.contrib.peer_memory import PeerHaloExchanger1d
from apex.core.testing import run_ranks, wheel_files

RANKS = str(Path(__file__).with_name("_ranks.py"))
PACKAGE = Path(__file__).parents[1]


@pytest.mark.parametrize(("world", "reverse"), [(2, False), (4, True)])
def test_halo_exchange_matches_all_gather(world, reverse):
    compared = run_ranks(RANKS, "exchanges", world, args=(reverse, 17), timeout=240)
    assert len(compared) == world and all(c == compared[0] > 0 for c in compared)


def test_pool_bookkeeping():
    errors = run_ranks(RANKS, "pool_checks", 2, timeout=240)
    for rank_errors in errors:
        dynamic, static, dtype, rank = rank_errors
        assert dynamic == "Dynamic peer memory pool exhausted"
        assert static == "Static peer memory pool exhausted"
        assert dtype is not None and "dtype torch.float64 not supported" in dtype
        assert rank is not None and "does not hold this process's rank" in rank


class _Pool:
    pass


BAD = {
    "half_halo zero": (lambda: PeerHaloExchanger1d([0], 0, _Pool(), 0), "half_halo must be an int >= 1"),
    "rank_in_group outside": (lambda: PeerHaloExchanger1d([0, 1], 2, _Pool(), 1), "rank_in_group 2 is not an index"),
    "y too thin": (
        lambda: PeerHaloExchanger1d([0], 0, _Pool(), 2)(torch.zeros(1, 2, 5, 3)),
        "y has 5 along dim 2 .H.; with half_halo 2 it needs at least 6",
    ),
    "y not 4-D": (lambda: PeerHaloExchanger1d([0], 0, _Pool(), 1)(torch.zeros(3, 5, 3)), "y must be a 4-D tensor"),
    "negative numSM": (
        lambda: PeerHaloExchanger1d([0], 0, _Pool(), 1)(torch.zeros(1, 1, 3, 3), True, False, -1),
        "numSM must be an int >= 0",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_naming_the_argument(case):
    fn, message = BAD[case]
    with pytest.raises(ValueError, match=message):
        fn()


def test_single_rank_group_zeroes_both_halos():
    # a group of one rank: no neighbour on either side, no communication needed
    y = torch.randn(2, 3, 6, 4)
    inner = y[:, :, 1:5].clone()
    PeerHaloExchanger1d([0], 0, _Pool(), 1)(y)
    assert torch.all(y[:, :, 0] == 0) and torch.all(y[:, :, 5] == 0)
    torch.testing.assert_close(y[:, :, 1:5], inner, rtol=0, atol=0)


def test_legacy_raw_buffers_and_views():
    raw = peer_memory_cuda.allocate_raw(4096)
    try:
        half = peer_memory_cuda.blob_view_half(raw, [2, 3], False)
        assert half.dtype == torch.float16 and half.shape == (2, 3) and half.data_ptr() == raw
        assert torch.all(half == 0)
        floats = peer_memory_cuda.blob_view_float(raw + 256, [1, 4, 2, 3], True)
        assert floats.is_contiguous(memory_format=torch.channels_last) and floats.data_ptr() == raw + 256
        floats.copy_(torch.randn(1, 4, 2, 3))
        ints = peer_memory_cuda.blob_view_int(raw + 256, [24], False)
        # the same bytes seen as int32
        assert torch.equal(ints, floats.permute(0, 2, 3, 1).reshape(-1).view(torch.int32))
        peer_memory_cuda.zero(raw + 256, 96)
        assert torch.all(ints == 0)
        with pytest.raises(ValueError, match="is not inside a buffer of allocate_raw"):
            peer_memory_cuda.blob_view_float(raw + 4000, [100], False)
    finally:
        peer_memory_cuda.free_raw(raw)
    with pytest.raises(ValueError, match="was not returned by allocate_raw"):
        peer_memory_cuda.free_raw(raw)


@pytest.mark.parametrize("name", ["get_raw_ipc_address", "get_raw_peers", "push_pull_halos_1d"])
def test_legacy_ipc_functions_explain_themselves(name):
    with pytest.raises(NotImplementedError, match=f"^{name}: .*CUDA IPC.*PeerHaloExchanger1d"):
        getattr(peer_memory_cuda, name)(*([0] * {"get_raw_ipc_address": 1, "get_raw_peers": 3}.get(name, 14)))


def test_wheel_ships_the_legacy_module(tmp_path):
    names = wheel_files(PACKAGE, tmp_path)
    assert "peer_memory_cuda.py" in names and "apex/contrib/peer_memory/peer_memory.py" in names
    assert not any(n.startswith("apex/__init__") or n == "apex/contrib/__init__.py" for n in names)


@pytest.mark.multigpu
def test_two_gpus_nccl():
    compared = run_ranks(RANKS, "exchanges", 2, backend="nccl", args=(False, 23), timeout=240)
    assert all(c == compared[0] > 0 for c in compared)
