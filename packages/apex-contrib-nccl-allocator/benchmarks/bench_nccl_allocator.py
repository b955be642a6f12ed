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
import queue
import statistics
import sys
import tempfile
import time
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
    """One rank's timings, put on ``results`` as (rank, None, rows); a failure as (rank, message, None)."""
    try:
        results.put((rank, None, _rank_rows(rank, store_file, samples)))
    except Exception as error:  # reported by the parent, which then stops the other rank
        results.put((rank, f"{type(error).__name__}: {error}", None))


def _rank_rows(rank: int, store_file: str, samples: int) -> list:
    import apex.contrib.nccl_allocator as nccl_allocator

    nvls = os.environ.get("NCCL_NVLS_ENABLE")
    nccl_allocator.init()
    if nvls is not None:
        # init() turns NVLink SHARP on, as upstream; a machine that sets NCCL_NVLS_ENABLE keeps its setting
        # (shared hosts turn it off: NVLS there can take the GPUs out of service).
        os.environ["NCCL_NVLS_ENABLE"] = nvls
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
        # RuntimeError saying why where PyTorch's NCCL backend offers no ncclMemAlloc allocator here
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
        return rows
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
    rows_of, errors = {}, {}
    deadline = time.monotonic() + 1800
    while len(rows_of) + len(errors) < WORLD and time.monotonic() < deadline:
        try:
            rank, error, rows = results.get(timeout=1.0)
        except queue.Empty:
            for r, p in enumerate(procs):
                if p.exitcode not in (None, 0) and r not in rows_of and r not in errors:
                    errors[r] = f"exited with code {p.exitcode} without reporting"
            continue
        if error is None:
            rows_of[rank] = rows
        else:
            errors[rank] = error
            deadline = min(deadline, time.monotonic() + 10.0)  # the other rank may wait on this one: not long
    for p in procs:
        p.join(timeout=5.0 if not errors else 0.5)
        if p.is_alive():
            p.kill()
            p.join()
    if errors or 0 not in rows_of:
        for r in range(WORLD):
            if r in errors:
                print(f"bench_nccl_allocator: rank {r}: {errors[r]}", file=sys.stderr)
        if not errors:
            print("bench_nccl_allocator: rank 0 did not report within 30 minutes", file=sys.stderr)
        return 1
    rows_raw = rows_of[0]
    rows, verdicts = [], []
    for size, dtype, pool_ms, plain_ms in rows_raw:
        bus = 2 * (WORLD - 1) / WORLD * size / (pool_ms * 1e-3) / 1e9
        name = str(dtype).removeprefix("torch.")
        rows.append([str(size), name, f"{pool_ms:.4f}", f"{plain_ms:.4f}", f"{plain_ms / pool_ms:.2f}x", f"{bus:.0f}"])
        verdicts.append(verdict(f"{size} bytes {name}: plain / pool", plain_ms / pool_ms, POOL_BAR))
    return finish("bench_nccl_allocator", HEADER, rows, verdicts, out=args.out)


if __name__ == "__main__":
    sys.exit(main())
