"""SpatialBottleneck at 2 and 4 gloo ranks equals the unsplit Bottleneck on the whole input (output slices,
input-gradient slices, summed weight gradients) with the all-gather, send/recv and peer exchangers; HaloPadder.
NCCL runs are marked multigpu."""

from __future__ import annotations

from pathlib import Path

import pytest

from apex.core.testing import run_ranks

RANKS = str(Path(__file__).with_name("_ranks.py"))
PER_RANK = 3 * 5  # exchangers x (configs + one bf16)


@pytest.mark.parametrize("world", [2, 4])
def test_spatial_bottleneck_matches_unsplit(world):
    assert run_ranks(RANKS, "spatial", world, args=(5,), timeout=300) == [PER_RANK] * world


def test_halo_padder():
    assert run_ranks(RANKS, "padder", 2, args=(9,), timeout=240) == [4, 4]


@pytest.mark.multigpu
def test_spatial_two_gpus_nccl():
    assert run_ranks(RANKS, "spatial", 2, backend="nccl", args=(5,), timeout=300) == [PER_RANK] * 2
