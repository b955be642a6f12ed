"""apex.contrib.nccl_allocator.scale against PyTorch's ``x * alpha``, eager and under torch.compile (CUDA only).

    python packages/apex-contrib-nccl-allocator/benchmarks/bench_nccl_allocator.py [--out DIR] [--samples N]

Per shape and dtype: ours, eager and compiled torch in ms (CUDA events, median of samples, data
cycling through enough copies to outgrow L2), eager / ours, and ours in GB/s (bytes read and
written) and as a fraction of the device copy bandwidth measured in the same run. Bar: ours moves
at least COPY_FRACTION_BAR of the copy bandwidth at every shape.
"""

from __future__ import annotations

import math
import sys

import torch

from apex.contrib.nccl_allocator import scale
from apex.core.benchmarking import (
    bench_arguments,
    copies_for_l2,
    copy_bandwidth_gbps,
    finish,
    gb_per_s,
    nbytes,
    require_cuda,
    time_ms,
    verdict,
)

SHAPES = [(8192, 8192), (16384, 8191)]
DTYPES = [torch.bfloat16, torch.float32]
ALPHA = 0.5
COPY_FRACTION_BAR = 0.8
HEADER = ["shape", "dtype", "ours ms", "eager ms", "compiled ms", "eager / ours", "ours GB/s", "% of copy"]


def measure(shape, dtype, samples: int, compiled) -> tuple[list[str], float]:
    """One row of the table, and ours in GB/s."""
    copies = copies_for_l2(2 * math.prod(shape) * dtype.itemsize)
    data = [torch.randn(shape, device="cuda").to(dtype) for _ in range(copies)]
    torch.testing.assert_close(scale(data[0], ALPHA), data[0] * ALPHA)

    def timed(fn):
        return time_ms([lambda x=x: fn(x) for x in data], samples)

    ours = timed(lambda x: scale(x, ALPHA))
    eager = timed(lambda x: x * ALPHA)
    compiled_ms = timed(compiled)
    gbps = gb_per_s(2 * nbytes(data[:1]), ours)  # x read, out written
    row = [f"{ours:.3f}", f"{eager:.3f}", f"{compiled_ms:.3f}", f"{eager / ours:.2f}x", f"{gbps:.0f}"]
    return row, gbps


def main(argv: list[str] | None = None) -> int:
    args = bench_arguments("bench_nccl_allocator", __doc__).parse_args(argv)
    if not require_cuda("bench_nccl_allocator"):
        return 1
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps(args.samples)
    compiled = torch.compile(lambda x: x * ALPHA, fullgraph=True)
    rows, verdicts = [], []
    for shape in SHAPES:
        for dtype in DTYPES:
            cells, gbps = measure(shape, dtype, args.samples, compiled)
            case = ["x".join(map(str, shape)), str(dtype).removeprefix("torch.")]
            rows.append([*case, *cells, f"{100 * gbps / copy_gbps:.0f}%"])
            verdicts.append(verdict(f"{' '.join(case)}: share of copy bandwidth", gbps / copy_gbps, COPY_FRACTION_BAR))
    return finish("bench_nccl_allocator", HEADER, rows, verdicts, out=args.out, copy_gbps=copy_gbps)


if __name__ == "__main__":
    sys.exit(main())
