"""Rank workers of test_testing.py (loaded by path in each rank by apex.core.testing.run_ranks)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def summed(rank: int, world: int, base: float):
    t = torch.tensor([base + rank])
    dist.all_reduce(t)
    return t.item()


def raises_on_one(rank: int, world: int):
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def environment(rank: int, world: int, names: list[str]):
    """The values of ``names`` in this rank's environment, and whether a test already ran in it."""
    return {name: os.environ.get(name) for name in names}, "_apex_ranks_testing_ran" in sys.modules


def mark_ran(rank: int, world: int):
    sys.modules["_apex_ranks_testing_ran"] = sys.modules[__name__]
    return rank
