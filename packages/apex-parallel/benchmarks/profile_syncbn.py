"""Diagnostics for SyncBatchNorm on 2 GPUs: host and device time per call, profiles, bare collectives.

    python packages/apex-parallel/benchmarks/profile_syncbn.py

Two ranks over NCCL. Prints (rank 0):
- the device time of a bare all-gather and all-reduce of a few floats (the floor of one call);
- for a few of bench_parallel.py's shapes (bf16, N=64 per rank), ours and torch.nn.SyncBatchNorm:
  device time of forward+backward and of forward alone (CUDA events), and the host time of
  forward+backward (wall time of 50 calls queued without waiting). Host time close to device time
  means the call is host-bound;
- a profiler table of ten forward+backward calls for two channels-last shapes.
This is for finding where time goes; bench_parallel.py holds the bars.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from apex.core.testing import run_ranks

SHAPES = [("NHWC", 64, 56, 56), ("NHWC", 2048, 7, 7), ("NCHW", 256, 56, 56)]
PROFILED = {("NHWC", 64), ("NHWC", 2048)}


def bare_collectives(device, say) -> None:
    from apex.core.benchmarking import time_ms

    for n in (129, 4097):
        t = torch.zeros(n, device=device)
        out = torch.empty(2 * n, device=device)
        gather = time_ms([lambda out=out, t=t: dist.all_gather_into_tensor(out, t)], 20, min_calls=50)
        reduce = time_ms([lambda t=t: dist.all_reduce(t)], 20, min_calls=50)
        say(f"bare collectives, {n} floats: all_gather {gather * 1e3:.1f} us, all_reduce {reduce * 1e3:.1f} us")


def host_us(call, count: int = 50) -> float:
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(count):
        call()
    elapsed = (time.perf_counter() - start) / count * 1e6
    torch.cuda.synchronize()
    return elapsed


def worker(rank: int, world_size: int) -> list[str]:
    """One rank's runs; returns the report lines (rank 0's are printed)."""
    from apex.core.benchmarking import time_ms
    from apex.parallel import SyncBatchNorm

    device = torch.device("cuda", rank)
    lines: list[str] = []
    bare_collectives(device, lines.append)
    for layout, c, h, w in SHAPES:
        fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
        x = torch.randn(64, c, h, w, device=device, dtype=torch.bfloat16).contiguous(memory_format=fmt)
        x.requires_grad_()
        dy = torch.randn_like(x)
        for name, bn in (("torch", nn.SyncBatchNorm(c).to(device)), ("ours", SyncBatchNorm(c).to(device))):

            def call(bn=bn, x=x, dy=dy):
                return torch.autograd.grad(bn(x), (x, bn.weight, bn.bias), dy)

            for _ in range(5):
                call()
            host = host_us(call)
            both = time_ms([call], 20) * 1e3
            forward = time_ms([lambda bn=bn, x=x: bn(x)], 20) * 1e3
            lines.append(
                f"{layout} 64x{c}x{h}x{w} {name}: forward+backward {both:.0f} us device, {host:.0f} us host; "
                f"forward {forward:.0f} us device"
            )
            if (layout, c) in PROFILED:
                activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=activities) as prof:
                    for _ in range(10):
                        call()
                    torch.cuda.synchronize()
                table = prof.key_averages().table(
                    sort_by="self_device_time_total", row_limit=14, max_name_column_width=60
                )
                lines.append(table)
    return lines


def main() -> int:
    if torch.cuda.device_count() < 2:
        print("profile_syncbn: needs 2 CUDA devices", file=sys.stderr)
        return 1
    lines = run_ranks(__file__, "worker", 2, backend="nccl", timeout=900)[0]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
