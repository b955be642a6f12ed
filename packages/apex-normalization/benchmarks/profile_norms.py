"""One norm's forward and backward at one shape, a few times, for Nsight Compute to capture.

bfloat16 input and parameters, as bench_norms.py; layer norm with weight and bias, RMS norm with a
weight. The first calls warm up; capture a later one, for instance the backward kernel of the
third call:

    ncu --clock-control none -k regex:backward_in_registers -s 2 -c 1 --section SpeedOfLight \\
        --section WarpStateStats --section SchedulerStats --section Occupancy \\
        python packages/apex-normalization/benchmarks/profile_norms.py layer_norm 4096 16384

(``--clock-control none`` keeps the clocks as they run in the benchmarks; ``-k regex:forward`` for
the forward kernel.)
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_norms import EPS, load_kernels, make_data, ours_fn, with_backward


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("norm", choices=("layer_norm", "rms_norm"))
    parser.add_argument("rows", type=int)
    parser.add_argument("hidden", type=int)
    parser.add_argument("--calls", type=int, default=4, help="forward+backward calls (default 4)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_norms: needs a CUDA device", file=sys.stderr)
        return 1
    load_kernels()
    torch.manual_seed(0)
    rms = args.norm == "rms_norm"
    data = make_data(args.rows, args.hidden, rms)
    step = with_backward(ours_fn(rms, args.hidden))
    for _ in range(args.calls):
        step(data)
    torch.cuda.synchronize()
    print(f"profile_norms: {args.calls} forward+backward calls of {args.norm} {args.rows}x{args.hidden} (eps {EPS})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
