"""Rank workers of test_testing.py (loaded by path in each rank by apex.core.testing.run_ranks)."""

from __future__ import annotations

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
