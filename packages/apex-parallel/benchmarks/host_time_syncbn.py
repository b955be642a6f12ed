"""Host time per forward+backward call of SyncBatchNorm in one process (no process group), on CUDA.

    python packages/apex-parallel/benchmarks/host_time_syncbn.py [--calls 200] [--rounds 5]

At a tiny shape the GPU idles and a call costs what the host spends on it: the module's Python, the
autograd layer, the dispatcher and the kernel launches. CUDA events cannot see that, so each row is
wall time (time.perf_counter) around ``--calls`` calls, with one synchronize at the end, divided by
the calls; the median of ``--rounds`` rounds. Rows, each a norm with fused ReLU (channels-last memory
and the ``channel_last`` flag: with and without z) or norm then ReLU (NCHW):

- ``op``: SyncBatchNorm's world-1 path through ``batch_norm_train`` (on CUDA with the library
  loaded, the C++ autograd of csrc/syncbn_autograd.cpp; SyncBatchNorm's default at world 1);
- ``function``: the same module through ``SyncBatchNormFunction`` (the path before batch_norm_train);
- ``torch``: ``nn.BatchNorm2d`` (+ z) + ``torch.relu`` on the same input.

Printed: layout, shape, us per call for each, and op's saving over function. Issue 22: the eager
ResNet-50 step (53 norms) was host-bound.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from apex.parallel import SyncBatchNorm
from apex.parallel.sync_batchnorm import SyncBatchNormFunction


class FunctionPath(SyncBatchNorm):
    """SyncBatchNorm through SyncBatchNormFunction at every world size (the path before batch_norm_train)."""

    def _sync(self, input, z, weight, bias, running, factor, group, world, c_last, relu):
        return SyncBatchNormFunction.apply(
            input, z, weight, bias, running[0], running[1], self.eps, factor, group, world, c_last, relu
        )


class TorchNorm(nn.Module):
    """nn.BatchNorm2d, the residual z added, then ReLU, as a native model writes it."""

    def __init__(self, channels: int):
        super().__init__()
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x, z=None):
        out = self.bn(x)
        return torch.relu(out if z is None else out + z)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_us(module, x, z, dy, calls: int, rounds: int) -> float:
    def call():
        out = module(x, z) if z is not None else module(x)
        out.backward(dy)

    for _ in range(10):  # warm-up: library load, allocator, caches
        call()
    synchronize(x.device)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        synchronize(x.device)
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the script, not a measurement")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    n, c, h, w = 2, 64, 4, 4
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"host us per forward+backward call, {n}x{c}x{h}x{w} {args.dtype}, {where}")
    print(f"{'layout':<28} {'op':>8} {'function':>9} {'torch':>8} {'op saves':>9}")
    for layout, with_z in (
        ("channels_last memory", False),
        ("channels_last memory + z", True),
        ("channel_last flag + z", True),
        ("nchw", False),
    ):
        flag = layout.startswith("channel_last flag")
        shape = (n, h, w, c) if flag else (n, c, h, w)
        fmt = torch.channels_last if layout.startswith("channels_last memory") else torch.contiguous_format
        x = torch.randn(shape, device=device, dtype=dtype).contiguous(memory_format=fmt).requires_grad_()
        z = torch.randn_like(x).requires_grad_() if with_z else None
        dy = torch.randn_like(x)
        row = []
        for cls in (SyncBatchNorm, FunctionPath):  # NCHW: the ReLU (and z) after the norm, in the module
            module = cls(c, channel_last=flag, fuse_relu=True).to(device)
            row.append(host_us(module, x, z, dy, args.calls, args.rounds))
        if flag:
            row.append(float("nan"))  # nn.BatchNorm2d takes channels at dimension 1
        else:
            row.append(host_us(TorchNorm(c).to(device, dtype), x, z, dy, args.calls, args.rounds))
        ours, function, native = row
        print(f"{layout:<28} {ours:8.1f} {function:9.1f} {native:8.1f} {function - ours:9.1f}")


if __name__ == "__main__":
    main()
