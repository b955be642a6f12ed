"""All-reduce of tensors in an NCCL memory pool (apex.contrib.nccl_allocator) against plain tensors, on 2 GPUs.

    python packages/apex-contrib-nccl-allocator/benchmarks/bench_nccl_allocator.py [--out DIR] [--samples N]

The script starts two processes itself (one per GPU; ``nccl_allocator.init()``, then an NCCL process group) and
prints from rank 0. Per message size and dtype: the time of one in-place sum all-reduce of a tensor allocated
under ``nccl_mem`` (ncclMemAlloc'd, its pool registered with the communicator: zero-copy / NVLS where the
hardware has it) and of a tensor from PyTorch's caching allocator, in ms (CUDA events over ``ITERATIONS``
back-to-back all-reduces, median over samples, the two alternated), their ratio and the pool's bus bandwidth
(2 (n-1)/n bytes per byte reduced). Bar: plain / pool >= POOL_BAR at every size (the pool is not slower).
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from apex.core.benchmarking import bench_arguments, finish, require_cuda, verdict

WORLD = 2
SIZES_BYTES = [1 << 16, 1 << 20, 16 << 20, 256 << 20]
DTYPES = [torch.bfloat16, torch.float32]
ITERATIONS = 20
POOL_BAR = 0.95
HEADER = ["bytes", "dtype", "pool ms", "plain ms", "plain / pool", "pool bus GB/s"]


def timed_ms(tensor: torch.Tensor) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    torch.cuda.synchronize()
    start.record()
    for _ in range(ITERATIONS):
        dist.all_reduce(tensor)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / ITERATIONS


def rank_main(rank: int, store_file: str, samples: int, results) -> None:
    import apex.contrib.nccl_allocator as nccl_allocator

    nccl_allocator.init()
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=Path(store_file).as_uri(),
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=300),
        device_id=torch.device("cuda", rank),
    )
    try:
        pool = nccl_allocator.create_nccl_mem_pool()
        rows = []
        for size in SIZES_BYTES:
            for dtype in DTYPES:
                numel = size // dtype.itemsize
                with nccl_allocator.nccl_mem(pool):
                    pooled = torch.ones(numel, dtype=dtype, device="cuda")
                plain = torch.ones(numel, dtype=dtype, device="cuda")
                check = pooled.clone()
                dist.all_reduce(check)  # the values: the world size in every element
                assert torch.equal(check, torch.full_like(check, WORLD)), "all-reduce of pool memory is wrong"
                times = {"pool": [], "plain": []}
                for _ in range(samples):
                    times["pool"].append(timed_ms(pooled.zero_()))
                    times["plain"].append(timed_ms(plain.zero_()))
                rows.append((size, dtype, statistics.median(times["pool"]), statistics.median(times["plain"])))
                del pooled, plain, check
        if rank == 0:
            results.put(rows)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = bench_arguments("bench_nccl_allocator", __doc__, samples=10).parse_args(argv)
    if not require_cuda("bench_nccl_allocator", devices=WORLD):
        return 1
    context = mp.get_context("spawn")
    results = context.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="bench-nccl-allocator-"), "store")
    procs = [context.Process(target=rank_main, args=(r, store, args.samples, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    rows_raw = results.get(timeout=1800)
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        print("bench_nccl_allocator: a rank failed", file=sys.stderr)
        return 1
    rows, verdicts = [], []
    for size, dtype, pool_ms, plain_ms in rows_raw:
        bus = 2 * (WORLD - 1) / WORLD * size / (pool_ms * 1e-3) / 1e9
        name = str(dtype).removeprefix("torch.")
        rows.append([str(size), name, f"{pool_ms:.4f}", f"{plain_ms:.4f}", f"{plain_ms / pool_ms:.2f}x", f"{bus:.0f}"])
        verdicts.append(verdict(f"{size} bytes {name}: plain / pool", plain_ms / pool_ms, POOL_BAR))
    return finish("bench_nccl_allocator", HEADER, rows, verdicts, out=args.out)


if __name__ == "__main__":
    sys.exit(main())
