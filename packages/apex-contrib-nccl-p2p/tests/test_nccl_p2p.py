"""nccl_p2p_cuda and exchange_halos on real gloo process groups (NCCL marked multigpu): each rank's
received halos against its neighbours' sent ones, recomputed here from the seeds; errors."""

from __future__ import annotations

from pathlib import Path

import nccl_p2p_cuda
import pytest
import torch

from apex.contrib import nccl_p2p
from apex.core.testing import run_ranks, wheel_files

from ._ranks import CASES, halo

RANKS = str(Path(__file__).with_name("_ranks.py"))
PACKAGE = Path(__file__).parents[1]


def expected(seed, rank, world, case, wrap):
    left = (rank - 1) % world if wrap or rank > 0 else -1
    right = (rank + 1) % world if wrap or rank < world - 1 else -1
    shape, dtype, _ = CASES[case]
    zero = torch.zeros(shape, dtype=dtype)
    # the left neighbour's right output halo, the right neighbour's left one; zeros where none
    li = halo(seed, left, 1, case) if left >= 0 else zero
    ri = halo(seed, right, 0, case) if right >= 0 else zero
    return li, ri


def check(results, world, seed):
    assert len(results) == world
    for wrap in (False, True):
        check_one([r[wrap] for r in results], world, seed, wrap)


def check_one(results, world, seed, wrap):
    for rank, got in enumerate(results):
        for case in range(len(CASES)):
            li, ri = expected(seed, rank, world, case, wrap)
            for mode in ("inplace", "returned"):
                gl, gr = got[(case, mode)]
                assert gl.dtype == li.dtype and gl.shape == li.shape
                torch.testing.assert_close(gl, li, rtol=0, atol=0, msg=f"rank {rank} case {case} {mode} left")
                torch.testing.assert_close(gr, ri, rtol=0, atol=0, msg=f"rank {rank} case {case} {mode} right")


@pytest.mark.parametrize("world", [2, 4])
def test_legacy_exchange(world):
    check(run_ranks(RANKS, "legacy", world, args=(3 + world,), timeout=240), world, 3 + world)


def test_mismatched_ids_are_refused_on_every_rank():
    messages = run_ranks(RANKS, "mismatched_id", 2, timeout=240)
    assert all(m is not None and "unique_nccl_id differs across ranks" in m for m in messages)


def test_exchange_on_a_subset_of_ranks():
    results = run_ranks(RANKS, "group_subset", 4, args=(11,), timeout=240)
    assert results[0] is None and results[2] is None
    # ranks 1 and 3 form a chain: 1 gets zeros on its left and 3's left halo on its right
    torch.testing.assert_close(results[1][0], torch.zeros_like(results[1][0]), rtol=0, atol=0)
    torch.testing.assert_close(results[1][1], halo(11, 3, 0, 0), rtol=0, atol=0)
    torch.testing.assert_close(results[3][0], halo(11, 1, 1, 0), rtol=0, atol=0)
    torch.testing.assert_close(results[3][1], torch.zeros_like(results[3][1]), rtol=0, atol=0)


def test_unique_id_shape_and_randomness():
    ids = nccl_p2p_cuda.get_unique_nccl_id(3)
    assert ids.shape == (3, 128) and ids.dtype == torch.uint8 and ids.device.type == "cpu"
    assert not torch.equal(ids[0], ids[1])  # 128 random bytes twice alike: probability 2**-1024


def test_package_exposes_the_legacy_functions():
    for name in nccl_p2p_cuda.__all__:
        assert getattr(nccl_p2p, name) is getattr(nccl_p2p_cuda, name)


BAD = {
    "n zero": (lambda: nccl_p2p_cuda.get_unique_nccl_id(0), ValueError, "n must be a positive int"),
    "negative delay": (lambda: nccl_p2p_cuda.add_delay(-1), ValueError, "delay must be an int >= 0"),
    "no process group": (
        lambda: nccl_p2p_cuda.init_nccl_comm(nccl_p2p_cuda.get_unique_nccl_id(1), 0, 1),
        RuntimeError,
        "torch.distributed is not initialised",
    ),
    "unknown handle": (
        lambda: nccl_p2p_cuda.left_right_halo_exchange(12345, -1, -1, torch.ones(2), torch.ones(2)),
        ValueError,
        "handle 12345 was not returned by init_nccl_comm",
    ),
    "size mismatch": (
        lambda: nccl_p2p.exchange_halos(-1, -1, torch.ones(2), torch.ones(3), torch.ones(2), torch.ones(2)),
        ValueError,
        "right_output_halo has 3 elements",
    ),
    "dtype mismatch": (
        lambda: nccl_p2p.exchange_halos(-1, -1, torch.ones(2), torch.ones(2), torch.ones(2).half(), torch.ones(2)),
        TypeError,
        "left_input_halo has dtype torch.float16",
    ),
    "empty halo": (
        lambda: nccl_p2p.exchange_halos(-1, -1, *[torch.ones(0)] * 4),
        ValueError,
        "left_output_halo is empty",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_naming_the_argument(case):
    fn, error, message = BAD[case]
    with pytest.raises(error, match=message):
        fn()


def test_no_neighbours_zeroes_without_communicating():
    # ranks -1/-1 need no process group at all
    li, ri = torch.full((2, 3), 5.0), torch.full((2, 3), 5.0)
    nccl_p2p.exchange_halos(-1, -1, torch.randn(2, 3), torch.randn(2, 3), li, ri)
    assert li.abs().sum() == 0 and ri.abs().sum() == 0


def test_wheel_ships_the_legacy_module(tmp_path):
    names = wheel_files(PACKAGE, tmp_path)
    assert "nccl_p2p_cuda.py" in names
    assert "apex/contrib/nccl_p2p/halo_exchange.py" in names
    assert not any(n.startswith("apex/__init__") or n == "apex/contrib/__init__.py" for n in names)


@pytest.mark.multigpu
def test_two_gpus_nccl():
    check(run_ranks(RANKS, "legacy", 2, backend="nccl", args=(5,), timeout=240), 2, 5)
