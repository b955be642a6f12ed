"""Kernel table of one SyncBatchNorm forward + backward on one GPU, channels-last with a fused ReLU.

    python packages/apex-parallel/benchmarks/profile_c_last_kernels.py

ResNet-50 shapes at batch 256 (bf16 input, float32 weight): a norm followed by a ReLU, and a
bottleneck's last norm with the residual add (z) and its ReLU. For each kernel of five calls:
device microseconds a call and the equivalent number of passes over the input tensor at the copy
bandwidth measured in the same run (one pass = the tensor's bytes read or written once). The
``CUDAFunctor_add`` rows are autograd accumulating the leaf gradients, not ours. With z, both ways
of making the masked gradient: written by the reduction (sync_batchnorm._MASKED_IN_REDUCE, the
default) or by the fused input-gradient kernel. For finding where time goes (benchmarks/NOTES.md);
there is no bar here.
"""

from __future__ import annotations

import itertools
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from apex.core.benchmarking import copy_bandwidth_gbps, require_cuda
from apex.parallel import SyncBatchNorm, sync_batchnorm

SHAPES = [(64, 112, False), (256, 56, True)]  # channels, height = width, residual add
MASKED = [True, False]  # the masked gradient from the reduction, or from the input-gradient kernel


def main() -> int:
    if not require_cuda("profile_c_last_kernels"):
        return 1
    bandwidth = copy_bandwidth_gbps(5) * 1e9  # bytes per second
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    for masked, (channels, size, add) in itertools.product(MASKED, SHAPES):
        if not masked and not add:
            continue  # the same as with: the masked gradient is only written for z
        sync_batchnorm._MASKED_IN_REDUCE = masked
        x = torch.randn(256, channels, size, size, device="cuda", dtype=torch.bfloat16)
        x = x.to(memory_format=torch.channels_last).requires_grad_()
        z = torch.randn_like(x).requires_grad_() if add else None
        dy = torch.randn_like(x)
        norm = SyncBatchNorm(channels, fuse_relu=True).cuda()

        def step(norm=norm, x=x, z=z, dy=dy):
            (norm(x, z) if z is not None else norm(x)).backward(dy)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        tensor_bytes = x.numel() * x.element_size()
        case = f"256x{channels}x{size}x{size}{' with z' if add else ''}"
        where = "masked in reduce" if masked else "masked in backward"
        print(f"== {where}: {case}: {tensor_bytes / 1e6:.0f} MB a pass")
        for event in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
            us = event.device_time_total / 5
            if us > 5:
                passes = us * 1e-6 * bandwidth / tensor_bytes
                print(f"  {us:8.1f} us  {passes:4.1f} passes  {event.key[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
