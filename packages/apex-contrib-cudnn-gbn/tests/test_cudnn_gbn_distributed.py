"""GroupBatchNorm2d and cudnn_gbn_lib with group_size > 1 on real process groups (gloo, 2 and 4 ranks):
each rank's output and input gradient equal a float64 batch norm over its group's concatenated batch,
the group's weight gradients sum to that norm's, and the running statistics follow it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from apex.core.testing import run_ranks

from ._ranks import EPS, MOMENTUM, full_data, rows
from ._reference import close, reference_step

RANKS = str(Path(__file__).with_name("_ranks.py"))
CHW = (11, 3, 2)  # C odd, not a multiple of 8


def check(results, batches, group_size, seed, kind):
    world = len(batches)
    x, x2, dy, weight, bias = full_data(batches, CHW, seed)
    for first in range(0, world, group_size):
        group = list(range(first, first + group_size))
        take = torch.cat([torch.arange(sum(batches))[rows(batches, r)] for r in group])
        rm, rv = torch.zeros(CHW[0], dtype=torch.float64), torch.ones(CHW[0], dtype=torch.float64)
        ref = reference_step(x[take], dy[take], weight, bias, rm, rv, MOMENTUM, EPS)
        F.batch_norm(x2[take].double(), rm, rv, None, None, True, MOMENTUM, EPS)
        offset = 0
        for r in group:
            got = results[r][group_size][kind]
            part = slice(offset, offset + batches[r])
            offset += batches[r]
            what = f"{kind} rank {r} group size {group_size}"
            close(got["y"], ref["y"][part], torch.float32, f"{what} y")
            close(got["dx"], ref["dx"][part], torch.float32, f"{what} grad x")
            close(got["mean"], ref["mean"], torch.float32, f"{what} minibatch mean")
            close(got["invstd"], ref["invstd"], torch.float32, f"{what} minibatch inv var")
            if kind == "module":
                close(got["running_mean"], rm, torch.float32, f"{what} running_mean")
                close(got["running_var"], rv, torch.float32, f"{what} running_var")
        for name in ("dweight", "dbias"):
            total = sum(results[r][group_size][kind][name].double() for r in group)
            close(total, ref[name], torch.float32, f"{kind} group {group} {name} summed over the group")


def test_two_ranks_unequal_batches():
    batches = [3, 1]
    results = run_ranks(RANKS, "worker", 2, args=([1, 2], batches, CHW, 5, False), timeout=240)
    for group_size in (1, 2):
        check(results, batches, group_size, 5, "module")


def test_four_ranks_module_and_legacy():
    batches = [2, 2, 2, 2]  # cudnn_gbn_lib.backward assumes equal batches, as upstream's kernels
    results = run_ranks(RANKS, "worker", 4, args=([1, 2, 4], batches, CHW, 9, True), timeout=240)
    for group_size in (1, 2, 4):
        check(results, batches, group_size, 9, "module")
        check(results, batches, group_size, 9, "legacy")


@pytest.mark.multigpu
def test_two_gpus_nccl():
    batches = [2, 2]
    results = run_ranks(RANKS, "worker", 2, backend="nccl", args=([1, 2], batches, CHW, 3, True), timeout=240)
    for group_size in (1, 2):
        check(results, batches, group_size, 3, "module")
        check(results, batches, group_size, 3, "legacy")
