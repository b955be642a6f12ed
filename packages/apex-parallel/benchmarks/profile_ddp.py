"""Diagnostics for the DDP step of bench_parallel.py: variants of both wrappers, timed in turns.

    python packages/apex-parallel/benchmarks/profile_ddp.py [--rounds 5] [--steps 8]

Two ranks over NCCL, the models and step of bench_parallel.py (ResNet-50, GPT-124M; bf16
autocast, fused AdamW). For each model it times, in alternating rounds (median, and every round's
ms/step): the model without DDP (no communication), torch's DDP (default and 40 MB buckets) and
ours (default, message_size 2.5e6 and 4e7, delay_allreduce). Then a profiler summary of three
steps of ours and of torch. This is for finding where time goes, not a bar: bench_parallel.py
holds the bars.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

from apex.core.testing import run_ranks

HERE = Path(__file__).resolve().parent


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_parallel", HERE / "bench_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def variants_for(factory, base, rank: int) -> dict[str, nn.Module]:
    from apex.parallel import DistributedDataParallel

    def clone():
        model = factory()
        model.load_state_dict(base.state_dict())
        return model

    def torch_ddp(**kwargs):
        return nn.parallel.DistributedDataParallel(clone(), device_ids=[rank], broadcast_buffers=False, **kwargs)

    return {
        "no DDP (no communication)": clone(),
        "torch": torch_ddp(),
        "torch, 40 MB buckets": torch_ddp(bucket_cap_mb=40),
        "ours": DistributedDataParallel(clone()),
        "ours, message_size 2.5e6": DistributedDataParallel(clone(), message_size=2_500_000),
        "ours, message_size 4e7": DistributedDataParallel(clone(), message_size=40_000_000),
        "ours, delay_allreduce": DistributedDataParallel(clone(), delay_allreduce=True),
    }


def worker(rank: int, world_size: int, rounds: int, count: int) -> list[str]:
    """One rank's runs; returns the report lines (rank 0's are printed)."""
    bench = load_bench()
    device = torch.device("cuda", rank)
    torch.backends.cudnn.benchmark = True
    lines: list[str] = []
    for name in ("ResNet-50", "GPT-124M"):
        factory, (inputs, targets), loss_fn = bench.model_case(name, device)
        torch.manual_seed(0)
        variants = variants_for(factory, factory(), rank)
        optimizers = {k: torch.optim.AdamW(v.parameters(), lr=1e-4, fused=True) for k, v in variants.items()}

        def steps(key: str, count: int, variants=variants, optimizers=optimizers, batch=(inputs, targets, loss_fn)):
            return bench.timed_steps(variants[key], optimizers[key], *batch, count)

        for key in variants:
            steps(key, 4)
        keys = list(variants)
        times: dict[str, list[float]] = {key: [] for key in keys}
        for r in range(rounds):
            for key in keys if r % 2 == 0 else keys[::-1]:
                times[key].append(steps(key, count))
        for key in keys:
            spread = ", ".join(f"{t:.1f}" for t in times[key])
            lines.append(f"{name} {key}: {statistics.median(times[key]):.2f} ms/step (rounds: {spread})")
        for key in ("ours", "torch"):
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                steps(key, 3)
            lines.append(f"--- {name} {key}: three steps")
            lines.append(
                prof.key_averages().table(sort_by="self_device_time_total", row_limit=10, max_name_column_width=50)
            )
        del variants, optimizers, steps
        torch.cuda.empty_cache()
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="steps per round")
    args = parser.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("profile_ddp: needs 2 CUDA devices", file=sys.stderr)
        return 1
    lines = run_ranks(__file__, "worker", 2, backend="nccl", args=(args.rounds, args.steps), timeout=1800)[0]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
