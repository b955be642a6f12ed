"""apex-normalization's CPU path (the PyTorch references) against PyTorch's own CPU ops, in one run.

For each norm (layer norm with weight and bias, layer norm without, RMS norm with a weight, RMS
norm without), dtype and shape (rows x normalized shape), ours (``apex.normalization.functional``)
and PyTorch's (``F.layer_norm`` / ``F.rms_norm``) are timed on the same data, forward alone and
forward plus backward (``torch.autograd.grad`` of the input and parameters). A sample is the mean
of as many calls in a row as last about SAMPLE_MS (a single call of the smallest shape, half a
millisecond, measured mostly the timer and the cache state); samples of the two alternate, so that
load from other processes falls on both, and the median is reported. The bar: ours at most 1.2x
PyTorch's time, per row.

    python packages/apex-normalization/benchmarks/bench_norms_cpu.py [--samples N] [--quick] [--out DIR]
        [--shapes 2048x16x64,...]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from apex.core.benchmarking import bench_arguments, finish
from apex.normalization import functional as AF

SHAPES = [(65536, (512,)), (8192, (4096,)), (16384, (1024,)), (2048, (16, 64))]
QUICK_SHAPES = [(65536, (512,)), (2048, (16, 64))]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BAR = 1.2
EPS = 1e-5

NORMS = {
    "layer+affine": (
        lambda x, w, b, s: AF.fused_layer_norm_affine(x, w, b, s, EPS),
        lambda x, w, b, s: F.layer_norm(x, s, w, b, EPS),
        True,
        True,
    ),
    "layer": (
        lambda x, w, b, s: AF.fused_layer_norm(x, s, EPS),
        lambda x, w, b, s: F.layer_norm(x, s, eps=EPS),
        False,
        False,
    ),
    "rms+weight": (
        lambda x, w, b, s: AF.fused_rms_norm_affine(x, w, s, EPS),
        lambda x, w, b, s: F.rms_norm(x, s, w, EPS),
        True,
        False,
    ),
    "rms": (
        lambda x, w, b, s: AF.fused_rms_norm(x, s, EPS),
        lambda x, w, b, s: F.rms_norm(x, s, eps=EPS),
        False,
        False,
    ),
}


SAMPLE_MS = 20.0  # a sample repeats the call until it lasts about this long (the same count for both)


def timed(fn, calls: int) -> float:
    """Milliseconds per call over ``calls`` calls in a row."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) * 1e3 / calls


def compare(ours, theirs, samples: int) -> tuple[float, float]:
    for _ in range(2):  # warm-up
        ours(), theirs()
    calls = max(1, round(SAMPLE_MS / timed(theirs, 1)))
    a, b = [], []
    for _ in range(samples):
        a.append(timed(ours, calls))
        b.append(timed(theirs, calls))
    return statistics.median(a), statistics.median(b)


def shape_name(rows: int, shape: tuple) -> str:
    return f"{rows}x{'x'.join(map(str, shape))}"


def main() -> int:
    parser = bench_arguments("bench_norms_cpu", __doc__, samples=7)
    parser.add_argument("--quick", action="store_true", help="two shapes")
    parser.add_argument("--shapes", help="comma-separated shapes as the table names them (2048x16x64,...)")
    args = parser.parse_args()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        wanted = args.shapes.split(",")
        shapes = [(r, s) for r, s in SHAPES if shape_name(r, s) in wanted]
        if len(shapes) != len(wanted):
            parser.error(f"--shapes: one of {', '.join(shape_name(r, s) for r, s in SHAPES)}")
    torch.manual_seed(0)
    rows_out, verdicts = [], []
    for rows, shape in shapes:
        for dname, dtype in DTYPES.items():
            x = torch.randn(rows, *shape).to(dtype).requires_grad_()
            w = (torch.rand(shape) + 0.5).to(dtype).requires_grad_()
            b = torch.randn(shape).to(dtype).requires_grad_()
            dy = torch.randn_like(x)
            for norm, (ours, theirs, with_w, with_b) in NORMS.items():
                leaves = [x] + ([w] if with_w else []) + ([b] if with_b else [])

                def forward(fn, x=x, w=w, b=b, shape=shape):
                    return lambda: fn(x, w, b, shape)

                def both(fn, x=x, w=w, b=b, shape=shape, leaves=leaves, dy=dy):
                    return lambda: torch.autograd.grad(fn(x, w, b, shape), leaves, dy)

                for what, wrap in (("forward", forward), ("forward+backward", both)):
                    ours_ms, torch_ms = compare(wrap(ours), wrap(theirs), args.samples)
                    ratio = ours_ms / torch_ms
                    name = f"{norm} {dname} {shape_name(rows, shape)} {what}"
                    rows_out.append([name, f"{ours_ms:.2f}", f"{torch_ms:.2f}", f"{ratio:.2f}"])
                    verdicts.append(f"{'PASS' if ratio <= BAR else 'FAIL'}: {name} (ours/torch {ratio:.2f}, bar {BAR})")
    notes = [f"a sample: the mean of as many calls in a row as last about {SAMPLE_MS:.0f} ms; median of {args.samples}"]
    header = ["case", "ours ms", "torch ms", "ours/torch"]
    return finish("bench_norms_cpu", header, rows_out, verdicts, out=args.out, notes=notes, cpu=True)


if __name__ == "__main__":
    sys.exit(main())
