"""apex-normalization's layer norm and RMS norm against PyTorch's, eager and compiled, in one process.

For each norm (layer norm with weight and bias, RMS norm with a weight; bfloat16 input and
parameters) and shape (rows x hidden), three implementations are timed on the same data:
ours (``apex.normalization`` functions), eager PyTorch (``F.layer_norm`` / ``F.rms_norm``) and
the same PyTorch call under ``torch.compile``. Two passes: the forward alone, and forward plus
backward (input, weight and bias gradients through ``torch.autograd.grad``; inputs require grad
in both passes, as in training).

    python packages/apex-normalization/benchmarks/bench_norms.py [--out DIR] [--samples N] [--quick] [--norms ...]
        [--shapes ROWSxHIDDEN,...]

Timing. The bars are about the kernels, so the "ms" columns are device time: one pass over
enough copies of the data to outgrow L2 is captured in a CUDA graph, and a sample is one replay
timed with CUDA events (median over samples). The "eager ms" columns time the same calls
launched from Python back to back (apex.core.benchmarking.time_ms), which includes the host
overhead of each implementation where it exceeds the device time (the small shapes).

Bytes model (per element, bfloat16): forward 4 (read x, write y); forward + backward 10 (also
read x and dy, write dx). GB/s and % of copy are for ours, against a device-to-device copy
measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from apex.core.benchmarking import (
    bench_arguments,
    copies_for_l2,
    copy_bandwidth_gbps,
    gb_per_s,
    markdown_table,
    report,
    require_cuda,
    require_kernels,
    time_ms,
    verdict,
)

LARGE_SHAPES = [(32768, 1024), (16384, 4096), (8192, 8192), (4096, 16384)]
SMALL_SHAPES = [(1024, 1024), (128, 4096)]
EPS = 1e-5
DTYPE = torch.bfloat16
BYTES_PER_ELEMENT = {"fwd": 4, "fwd+bwd": 10}
BARS = {"speedup": 1.5, "copy": 0.75, "forward": 1.0}


def load_kernels() -> None:
    """Fail unless apex-normalization's CUDA kernels are loaded (profile_norms.py calls it too)."""
    require_kernels("normalization")


def graph_ms(calls: list[Callable[[], object]], samples: int) -> float:
    """Median device time per call of one CUDA-graph replay of ``calls``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as graph capture wants
        for _ in range(2):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    del graph
    return statistics.median(times)


@dataclass
class Data:
    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    dy: torch.Tensor


def make_data(rows: int, hidden: int, rms: bool) -> Data:
    x = torch.randn(rows, hidden, device="cuda", dtype=DTYPE).requires_grad_()
    weight = (torch.rand(hidden, device="cuda") + 0.5).to(DTYPE).requires_grad_()
    bias = None if rms else torch.randn(hidden, device="cuda", dtype=DTYPE).requires_grad_()
    return Data(x, weight, bias, torch.randn(rows, hidden, device="cuda", dtype=DTYPE))


def ours_fn(rms: bool, hidden: int):
    from apex.normalization.functional import fused_layer_norm_affine, fused_rms_norm_affine

    if rms:
        return lambda d: fused_rms_norm_affine(d.x, d.weight, hidden, EPS)
    return lambda d: fused_layer_norm_affine(d.x, d.weight, d.bias, hidden, EPS)


def torch_fn(rms: bool, hidden: int):
    if rms:
        return lambda d: F.rms_norm(d.x, (hidden,), d.weight, EPS)
    return lambda d: F.layer_norm(d.x, (hidden,), d.weight, d.bias, EPS)


def compiled_fn(rms: bool, hidden: int):
    if rms:
        compiled = torch.compile(lambda x, w: F.rms_norm(x, (hidden,), w, EPS), dynamic=False)
        return lambda d: compiled(d.x, d.weight)
    compiled = torch.compile(lambda x, w, b: F.layer_norm(x, (hidden,), w, b, EPS), dynamic=False)
    return lambda d: compiled(d.x, d.weight, d.bias)


def with_backward(fn):
    def run(d: Data):
        out = fn(d)
        leaves = [t for t in (d.x, d.weight, d.bias) if t is not None]
        return torch.autograd.grad(out, leaves, d.dy)

    return run


@dataclass
class Row:
    norm: str
    rows: int
    hidden: int
    mode: str
    ours_ms: float
    torch_ms: float
    compiled_ms: float
    ours_eager_ms: float
    torch_eager_ms: float

    @property
    def large(self) -> bool:
        return (self.rows, self.hidden) in LARGE_SHAPES

    def gbps(self) -> float:
        return gb_per_s(BYTES_PER_ELEMENT[self.mode] * self.rows * self.hidden, self.ours_ms)

    def cells(self, copy_gbps: float) -> list[str]:
        return [
            self.norm,
            f"{self.rows}x{self.hidden}",
            self.mode,
            f"{self.ours_ms:.4f}",
            f"{self.torch_ms:.4f}",
            f"{self.compiled_ms:.4f}",
            f"{self.torch_ms / self.ours_ms:.2f}x",
            f"{self.compiled_ms / self.ours_ms:.2f}x",
            f"{self.gbps():.0f}",
            f"{100 * self.gbps() / copy_gbps:.0f}%",
            f"{self.ours_eager_ms:.4f}",
            f"{self.torch_eager_ms:.4f}",
        ]


HEADER = [
    "norm",
    "rows x hidden",
    "pass",
    "ours ms",
    "torch ms",
    "compiled ms",
    "torch/ours",
    "compiled/ours",
    "ours GB/s",
    "% of copy",
    "ours eager ms",
    "torch eager ms",
]


def check_against_torch() -> None:
    """Ours equals PyTorch's (forward and gradients) on one shape per kernel path, before any timing."""
    for rms in (False, True):
        for hidden in (1024, 4096, 16384, 1000):
            d = make_data(64, hidden, rms)
            got = [ours_fn(rms, hidden)(d), *with_backward(ours_fn(rms, hidden))(d)]
            expected = [torch_fn(rms, hidden)(d), *with_backward(torch_fn(rms, hidden))(d)]
            for g, e in zip(got, expected):
                scale = max(1.0, e.float().abs().max().item())
                torch.testing.assert_close(g.float(), e.float(), rtol=2e-2, atol=2e-2 * scale)


def bench(norm: str, rows: int, hidden: int, samples: int, quick: bool = False) -> list[Row]:
    """Rows of both passes; ``quick`` leaves out the compiled and eager timings (NaN there)."""
    rms = norm == "rms_norm"
    copies = copies_for_l2(rows * hidden * DTYPE.itemsize * 3)
    data = [make_data(rows, hidden, rms) for _ in range(copies)]
    implementations = {"ours": ours_fn(rms, hidden), "torch": torch_fn(rms, hidden)}
    if not quick:
        implementations["compiled"] = compiled_fn(rms, hidden)
    result = []
    for mode in ("fwd", "fwd+bwd"):
        ms, eager = {"compiled": float("nan")}, {"ours": float("nan"), "torch": float("nan")}
        for name, fn in implementations.items():
            call = fn if mode == "fwd" else with_backward(fn)
            calls = [lambda d=d, call=call: call(d) for d in data]
            ms[name] = graph_ms(calls, samples)
            if name != "compiled" and not quick:
                eager[name] = time_ms(calls, samples)
        times = (ms["ours"], ms["torch"], ms["compiled"], eager["ours"], eager["torch"])
        result.append(Row(norm, rows, hidden, mode, *times))
    del data
    torch.cuda.empty_cache()
    return result


def verdicts(rows: list[Row], copy_gbps: float) -> list[str]:
    lines = []

    def bar(name: str, value: float, needed: float) -> None:
        lines.append(verdict(name, value, needed))

    for r in rows:
        shape = f"{r.norm} {r.rows}x{r.hidden}"
        if r.mode == "fwd+bwd" and r.large:
            speedup = r.torch_ms / r.ours_ms
            bar(f"{shape} forward+backward >= {BARS['speedup']}x eager PyTorch", speedup, BARS["speedup"])
            if r.hidden >= 4096:
                bar(f"{shape} forward+backward >= 75% of copy bandwidth", r.gbps() / copy_gbps, BARS["copy"])
        if r.mode == "fwd":
            bar(f"{shape} forward not slower than eager PyTorch", r.torch_ms / r.ours_ms, BARS["forward"])
    return lines


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"1024x1024,2048x512"`` -> ``[(1024, 1024), (2048, 512)]``."""
    shapes = []
    for item in text.split(","):
        rows, sep, hidden = item.strip().partition("x")
        if not (sep and rows.isdigit() and hidden.isdigit() and int(rows) > 0 and int(hidden) > 0):
            raise argparse.ArgumentTypeError(f"{item!r} is not ROWSxHIDDEN (positive integers)")
        shapes.append((int(rows), int(hidden)))
    return shapes


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_norms", __doc__, samples=20)
    parser.add_argument(
        "--quick", action="store_true", help="tuning runs: device time of ours and eager PyTorch only (no compile)"
    )
    parser.add_argument("--norms", default="layer_norm,rms_norm", help="comma-separated: layer_norm, rms_norm")
    parser.add_argument(
        "--shapes",
        type=parse_shapes,
        default=LARGE_SHAPES + SMALL_SHAPES,
        help="comma-separated ROWSxHIDDEN (tuning runs); default: the bars' shapes",
    )
    args = parser.parse_args(argv)
    if not require_cuda("bench_norms"):
        return 1
    load_kernels()
    torch.manual_seed(0)
    check_against_torch()
    copy_gbps = copy_bandwidth_gbps(args.samples)
    rows = []
    for norm in args.norms.split(","):
        for r, h in args.shapes:
            rows += bench(norm, r, h, args.samples, args.quick)
    notes = [
        "bfloat16 input and parameters, eps 1e-5; layer norm with weight and bias, RMS norm with weight",
        "ms: device time per call from CUDA-graph replays; eager ms: back-to-back Python launches (host included)",
        "bytes per element: forward 4 (read x, write y), forward+backward 10 (also read x, dy, write dx)",
    ]
    table = markdown_table(HEADER, [r.cells(copy_gbps) for r in rows])
    report("bench_norms", [*table, "", *verdicts(rows, copy_gbps)], out=args.out, copy_gbps=copy_gbps, notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
