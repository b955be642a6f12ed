"""apex.contrib.layer_norm's FastLayerNorm (and FastLayerNormFN.apply, Megatron-Core's call) against
apex.normalization's FusedLayerNorm, whose kernel they run, and PyTorch's layer norm eager and under
torch.compile, in one process (CUDA only).

    python packages/apex-contrib-layer-norm/benchmarks/bench_layer_norm.py [--out DIR] [--samples N] [--no-compile]

Cases: bfloat16 input and parameters, Megatron-like (tokens, hidden) shapes, forward and forward +
backward (``torch.autograd.grad`` of the output for the input, weight and bias). Times are medians of
CUDA-event samples of back-to-back calls (apex.core.benchmarking.time_ms), data rotated past L2; ours
and FusedLayerNorm are each timed twice, alternating, and the lower median kept, so that a drift of
the clock between two timings does not read as a difference between two calls of one kernel.
Bytes model: the forward reads x and writes y (2 x size), the backward reads x and dy and writes dx
(3 x size); the parameters are negligible. Bar (issue 21): FastLayerNorm and FastLayerNormFN.apply
within 3% of FusedLayerNorm (FusedLayerNorm ms / ours ms >= 0.97), per shape and pass.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from apex.contrib.layer_norm import FastLayerNorm, FastLayerNormFN
from apex.core.benchmarking import (
    bench_arguments,
    copies_for_l2,
    copy_bandwidth_gbps,
    finish,
    gb_per_s,
    require_cuda,
    require_kernels,
    time_ms,
    verdict,
)
from apex.normalization import FusedLayerNorm

DTYPE = torch.bfloat16
EPS = 1e-5
# (tokens, hidden): sequence x micro-batch rows of GPT-style models, hidden 2048 to 12288.
SHAPES = [(16384, 2048), (8192, 4096), (8192, 8192), (4096, 12288)]
BAR = 0.97
HEADER = [
    "tokens x hidden",
    "pass",
    "FastLayerNorm ms",
    "FastLayerNormFN ms",
    "FusedLayerNorm ms",
    "torch ms",
    "compiled ms",
    "Fused / Fast",
    "Fused / FN",
    "Fast GB/s",
    "% of copy",
]


def make_modules(hidden: int):
    """FastLayerNorm and FusedLayerNorm with the same random bfloat16 parameters."""
    fast = FastLayerNorm(hidden, eps=EPS, device="cuda", dtype=DTYPE)
    fused = FusedLayerNorm(hidden, eps=EPS, device="cuda", dtype=DTYPE)
    weight = torch.rand(hidden, device="cuda") + 0.5
    bias = torch.randn(hidden, device="cuda") * 0.1
    with torch.no_grad():
        for m in (fast, fused):
            m.weight.copy_(weight)
            m.bias.copy_(bias)
    return fast, fused


def measure(shape, samples: int, compile_torch: bool) -> list[tuple[list[str], float, float, float]]:
    """Per pass: (row cells, ours GB/s, Fused / Fast, Fused / FN)."""
    tokens, hidden = shape
    fast, fused = make_modules(hidden)
    w, b = fast.weight, fast.bias
    size = tokens * hidden * DTYPE.itemsize
    data = [
        tuple(torch.randn(shape, device="cuda", dtype=DTYPE) for _ in ("x", "dy"))
        for _ in range(copies_for_l2(2 * size))
    ]
    data = [(x.requires_grad_(), dy) for x, dy in data]
    x0 = data[0][0]
    with torch.no_grad():  # one kernel: the same bits
        assert torch.equal(fast(x0), fused(x0)), "FastLayerNorm and FusedLayerNorm differ"
        assert torch.equal(FastLayerNormFN.apply(x0, w, b, EPS), fused(x0)), "FastLayerNormFN and FusedLayerNorm differ"

    def torch_ln(x):
        return F.layer_norm(x, (hidden,), w, b, EPS)

    def fn_apply(x):
        return FastLayerNormFN.apply(x, w, b, EPS)

    compiled = torch.compile(torch_ln, dynamic=False) if compile_torch else None
    fns = {"fast": fast, "fn": fn_apply, "fused": fused, "torch": torch_ln, "compiled": compiled}
    rows = []
    for name, backward in (("fwd", False), ("fwd+bwd", True)):

        def calls(fn, backward=backward):
            if backward:

                def step(x, dy, fn=fn):
                    params = (w, b) if fn is not fused else (fused.weight, fused.bias)
                    torch.autograd.grad(fn(x), (x, *params), dy)

                return [lambda x=x, dy=dy: step(x, dy) for x, dy in data]
            return [lambda x=x: fn(x) for x, _ in data]

        def timed(key):
            return time_ms(calls(fns[key]), samples)

        ms = {}
        for key in ("fused", "fast", "fn", "fused", "fast", "fn"):  # alternating, twice
            ms[key] = min(ms.get(key, float("inf")), timed(key))
        ms["torch"] = timed("torch")
        compiled_cell = f"{timed('compiled'):.3f}" if compiled is not None else "-"
        gbps = gb_per_s((5 if backward else 2) * size, ms["fast"])
        cells = [f"{tokens}x{hidden}", name, *(f"{ms[k]:.3f}" for k in ("fast", "fn", "fused", "torch"))]
        fast_ratio, fn_ratio = ms["fused"] / ms["fast"], ms["fused"] / ms["fn"]
        cells += [compiled_cell, f"{fast_ratio:.3f}", f"{fn_ratio:.3f}", f"{gbps:.0f}"]
        rows.append((cells, gbps, fast_ratio, fn_ratio))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_layer_norm", __doc__, no_compile=True)
    args = parser.parse_args(argv)
    if not require_cuda("bench_layer_norm"):
        return 1
    require_kernels("normalization")
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps(args.samples)
    table, verdicts = [], []
    for shape in SHAPES:
        for cells, gbps, fast_ratio, fn_ratio in measure(shape, args.samples, not args.no_compile):
            table.append([*cells, f"{100 * gbps / copy_gbps:.0f}%"])
            case = f"{cells[0]} {cells[1]}"
            verdicts.append(verdict(f"{case}: FusedLayerNorm ms / FastLayerNorm ms", fast_ratio, BAR))
            verdicts.append(verdict(f"{case}: FusedLayerNorm ms / FastLayerNormFN.apply ms", fn_ratio, BAR))
        torch.cuda.empty_cache()
    notes = [
        "bfloat16 input and parameters; torch = F.layer_norm, compiled = the same under torch.compile (default mode); "
        "GB/s counts 2 x size (fwd) or 5 x size (fwd+bwd)"
    ]
    return finish("bench_layer_norm", HEADER, table, verdicts, out=args.out, copy_gbps=copy_gbps, notes=notes)


if __name__ == "__main__":
    sys.exit(main())
