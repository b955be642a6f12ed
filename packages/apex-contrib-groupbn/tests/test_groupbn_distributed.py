"""BatchNorm2d_NHWC and bnp with bn_group > 1 on real process groups (gloo, 2 and 4 ranks): each rank's
output and input gradients equal a float64 batch norm over its group's concatenated batch, the group's
weight gradients sum to that norm's, and the running statistics follow it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from apex.core.testing import run_ranks

from ._ranks import EPS, MOMENTUM, full_data, rows
from ._reference import batch_norm_nhwc, close, reference_step

RANKS = str(Path(__file__).with_name("_ranks.py"))
HWC = (3, 2, 11)  # C odd, not a multiple of 8


def expected_for_group(batches, group, seed, relu):
    """The float64 reference of one group's concatenated batch: the first step, then the second
    step's running statistics and the eval output on the second batch."""
    x, x2, z, dy, weight, bias = full_data(batches, HWC, seed)
    take = torch.cat([torch.arange(sum(batches))[rows(batches, r)] for r in group])
    c = HWC[-1]
    rm, rv = torch.zeros(c, dtype=torch.float64), torch.ones(c, dtype=torch.float64)
    ref = reference_step(x[take], z[take] if relu else None, dy[take], weight, bias, rm, rv, MOMENTUM, EPS, relu)
    batch_norm_nhwc(x2[take], None, weight, bias, rm, rv, MOMENTUM, EPS, False, True)
    ref["running_mean"], ref["running_var"] = rm, rv
    return ref


def check(results, batches, group_size, seed, relu, kind):
    world = len(batches)
    for first in range(0, world, group_size):
        group = list(range(first, first + group_size))
        ref = expected_for_group(batches, group, seed, relu)
        offset = 0
        for r in group:
            got = results[r][group_size][kind]
            part = slice(offset, offset + batches[r])
            offset += batches[r]
            what = f"{kind} rank {r} group size {group_size}"
            close(got["y"], ref["y"][part], torch.float32, f"{what} y")
            close(got["dx"], ref["dx"][part], torch.float32, f"{what} grad x")
            if relu:
                close(got["dz"], ref["dz"][part], torch.float32, f"{what} grad z")
            if kind == "module":
                close(got["running_mean"], ref["running_mean"], torch.float32, f"{what} running_mean")
                close(got["running_var"], ref["running_var"], torch.float32, f"{what} running_var")
                close(got["mean"], ref["mean"], torch.float32, f"{what} minibatch_mean")
                close(got["invstd"], ref["invstd"], torch.float32, f"{what} minibatch_riv")
                x2 = full_data(batches, HWC, seed)[1][rows(batches, r)]
                z = full_data(batches, HWC, seed)[2][rows(batches, r)] if relu else None
                weight, bias = full_data(batches, HWC, seed)[4:]
                rm, rv = ref["running_mean"], ref["running_var"]
                expected_eval = batch_norm_nhwc(x2, z, weight, bias, rm, rv, 0.0, EPS, relu, False)
                close(got["eval_y"], expected_eval, torch.float32, f"{what} eval y")
        for name in ("dweight", "dbias"):
            total = sum(results[r][group_size][kind][name].double() for r in group)
            close(total, ref[name], torch.float32, f"{kind} group {group} {name} summed over the group")


@pytest.mark.parametrize("relu", [False, True], ids=["plain", "relu+z"])
def test_two_ranks(relu):
    batches = [3, 2]  # unequal batches: the module pools counts
    results = run_ranks(RANKS, "worker", 2, args=([1, 2], batches, HWC, 7, relu, False), timeout=240)
    for group_size in (1, 2):
        check(results, batches, group_size, 7, relu, "module")


@pytest.mark.parametrize("relu", [False, True], ids=["plain", "relu+z"])
def test_four_ranks_module_and_legacy(relu):
    batches = [2, 2, 2, 2]  # bnp's backward assumes equal batches, as upstream's kernels
    results = run_ranks(RANKS, "worker", 4, args=([1, 2, 4], batches, HWC, 11, relu, True), timeout=240)
    for group_size in (1, 2, 4):
        check(results, batches, group_size, 11, relu, "module")
        check(results, batches, group_size, 11, relu, "legacy")


@pytest.mark.multigpu
def test_two_gpus_nccl():
    batches = [3, 2]
    results = run_ranks(RANKS, "worker", 2, backend="nccl", args=([1, 2], batches, HWC, 13, True, True), timeout=240)
    for group_size in (1, 2):
        check(results, [3, 2], group_size, 13, True, "module")


def test_group_size_must_divide_the_world():
    messages = run_ranks(RANKS, "bad_group_size", 2, timeout=120)
    assert all(m is not None and "not divisible by the group size 3" in m for m in messages)
