"""apex.fused_dense against PyTorch, bf16, forward + backward, eager and under torch.compile (CUDA only).

    python packages/apex-fused-dense/benchmarks/bench_fused_dense.py [--out DIR] [--samples N] [--quick]

Times (CUDA events, median of samples) at GPT shapes (tokens x hidden x 4*hidden):

- FusedDenseGeluDense(h, 4h, h) against ``nn.Linear -> GELU(tanh) -> nn.Linear``, eager and compiled;
  bars: >= GELU_EAGER_BAR x eager, and at least as fast as compiled;
- FusedDense(h, 4h) against ``nn.Linear(h, 4h)``; bar: >= DENSE_EAGER_BAR x eager;
- wgrad_gemm_accum_fp32 (bf16 inputs, float32 main_grad) against ``main_grad.add_(d_output.t() @ input)``
  at (tokens, in, out); bars: faster, as close to a float64 reference, >= WGRAD_MATMUL_BAR of the
  matmul rate.

Forward + backward computes the gradients of the input and of every parameter (torch.autograd.grad,
so no accumulation into .grad). TFLOP/s count 2*m*n*k per GEMM; the matmul rate is a bf16
8192^3 torch.mm measured in the same run. "eager bar needs": the share of that rate at which the
step's GEMMs alone would take eager's time divided by the bar (every other kernel free); over 100%,
the bar asks for GEMMs faster than the 8192^3 product.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from apex.core.benchmarking import (
    bench_arguments,
    compare_ms,
    finish,
    require_cuda,
    require_kernels,
    time_ms,
    verdict,
)
from apex.fused_dense import FusedDense, FusedDenseGeluDense, _ops

GPT_SHAPES = [(8192, 1024, 4096), (8192, 4096, 16384), (16384, 8192, 32768)]
WGRAD_SHAPES = [(8192, 4096, 4096), (16384, 8192, 8192)]
GELU_EAGER_BAR = 1.1
GELU_COMPILED_BAR = 1.0
DENSE_EAGER_BAR = 1.05
WGRAD_MATMUL_BAR = 0.85
DTYPE = torch.bfloat16
HEADER = [
    "case",
    "shape",
    "ours ms",
    "eager ms",
    "compiled ms",
    "eager / ours",
    "compiled / ours",
    "ours TFLOP/s",
    "% of matmul",
    "eager bar needs",
]


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def matmul_tflops(samples: int) -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=DTYPE) for _ in range(2))
    return tflops(2 * 8192**3, time_ms([lambda: torch.mm(a, b)], samples))


def forward_backward(module: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    params = list(module.parameters())
    return lambda: torch.autograd.grad(module(x), [x, *params], dy)


def layer_rows(tokens, hidden, samples, matmul, with_compiled):
    """(gelu row, dense row, verdicts) at one GPT shape."""
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE, requires_grad=True)
    rows, verdicts = [], []
    shape = f"{tokens}x{hidden}x{4 * hidden}"

    ours = FusedDenseGeluDense(hidden, 4 * hidden, hidden).to("cuda", DTYPE)
    eager = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(approximate="tanh"), nn.Linear(4 * hidden, hidden))
    eager = eager.to("cuda", DTYPE)
    with torch.no_grad():
        eager[0].weight.copy_(ours.weight1), eager[0].bias.copy_(ours.bias1)
        eager[2].weight.copy_(ours.weight2), eager[2].bias.copy_(ours.bias2)
    dy = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE)
    torch.testing.assert_close(ours(x), eager(x), rtol=5e-2, atol=5e-2)
    variants = {"ours": [forward_backward(ours, x, dy)], "eager": [forward_backward(eager, x, dy)]}
    if with_compiled:
        variants["compiled"] = [forward_backward(torch.compile(eager, fullgraph=True), x, dy)]
    ms = compare_ms(variants, samples)
    ours_ms, eager_ms, compiled_ms = ms["ours"], ms["eager"], ms.get("compiled", float("nan"))
    flops = 6 * 2 * tokens * hidden * 4 * hidden
    rows.append(row("FusedDenseGeluDense", shape, ours_ms, eager_ms, compiled_ms, flops, matmul, GELU_EAGER_BAR))
    verdicts.append(verdict(f"FusedDenseGeluDense {shape}: eager / ours", eager_ms / ours_ms, GELU_EAGER_BAR))
    if with_compiled:
        verdicts.append(
            verdict(f"FusedDenseGeluDense {shape}: compiled / ours", compiled_ms / ours_ms, GELU_COMPILED_BAR)
        )
    del ours, eager

    ours = FusedDense(hidden, 4 * hidden).to("cuda", DTYPE)
    eager = nn.Linear(hidden, 4 * hidden).to("cuda", DTYPE)
    with torch.no_grad():
        eager.weight.copy_(ours.weight), eager.bias.copy_(ours.bias)
    dy = torch.randn(tokens, 4 * hidden, device="cuda", dtype=DTYPE)
    torch.testing.assert_close(ours(x), eager(x), rtol=5e-2, atol=5e-2)
    ms = compare_ms({"ours": [forward_backward(ours, x, dy)], "eager": [forward_backward(eager, x, dy)]}, samples)
    ours_ms, eager_ms = ms["ours"], ms["eager"]
    flops = 3 * 2 * tokens * hidden * 4 * hidden
    rows.append(row("FusedDense", shape, ours_ms, eager_ms, float("nan"), flops, matmul, DENSE_EAGER_BAR))
    verdicts.append(verdict(f"FusedDense {shape}: eager / ours", eager_ms / ours_ms, DENSE_EAGER_BAR))
    return rows, verdicts


def row(case, shape, ours_ms, eager_ms, compiled_ms, flops, matmul, bar):
    """One table row; ``eager_ms`` is the unfused path's time for wgrad (``bar`` 1: faster)."""
    rate = tflops(flops, ours_ms)
    compiled = "-" if compiled_ms != compiled_ms else f"{compiled_ms:.3f}"
    compiled_ratio = "-" if compiled_ms != compiled_ms else f"{compiled_ms / ours_ms:.2f}x"
    return [
        case,
        shape,
        f"{ours_ms:.3f}",
        f"{eager_ms:.3f}",
        compiled,
        f"{eager_ms / ours_ms:.2f}x",
        compiled_ratio,
        f"{rate:.0f}",
        f"{100 * rate / matmul:.0f}%",
        f"{100 * tflops(flops, eager_ms / bar) / matmul:.0f}%",
    ]


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected).norm() / expected.norm()).item()


def wgrad_rows(tokens, in_features, out_features, samples, matmul):
    torch.manual_seed(0)
    x = torch.randn(tokens, in_features, device="cuda", dtype=DTYPE)
    dy = torch.randn(tokens, out_features, device="cuda", dtype=DTYPE)
    start = torch.randn(out_features, in_features, device="cuda")
    expected = start.double() + dy.double().t() @ x.double()
    ours_grad, unfused_grad = start.clone(), start.clone()
    _ops.wgrad_gemm_accum_fp32(x, dy, ours_grad)
    unfused_grad.add_(dy.t() @ x)
    ours_error, unfused_error = relative_error(ours_grad, expected), relative_error(unfused_grad, expected)
    del expected

    ours_ms = time_ms([lambda: _ops.wgrad_gemm_accum_fp32(x, dy, ours_grad)], samples)
    unfused_ms = time_ms([lambda: unfused_grad.add_(dy.t() @ x)], samples)
    flops = 2 * tokens * in_features * out_features
    rate = tflops(flops, ours_ms)
    shape = f"{tokens}x{in_features}x{out_features}"
    cells = row("wgrad_gemm_accum_fp32", shape, ours_ms, unfused_ms, float("nan"), flops, matmul, 1.0)
    name = f"wgrad_gemm_accum_fp32 {shape}"
    verdicts = [
        verdict(f"{name}: unfused / ours", unfused_ms / ours_ms, 1.0),
        verdict(f"{name}: matmul-rate share", rate / matmul, WGRAD_MATMUL_BAR),
        # >= 1 when ours is at least as close to float64 as the unfused bf16 GEMM + float32 add.
        verdict(
            f"{name}: unfused error / ours ({unfused_error:.2e} / {ours_error:.2e})", unfused_error / ours_error, 1.0
        ),
    ]
    return [cells], verdicts


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_fused_dense", __doc__)
    parser.add_argument("--quick", action="store_true", help="the smallest GPT shape and wgrad shape only, no compile")
    args = parser.parse_args(argv)
    if not require_cuda("bench_fused_dense"):
        return 1
    require_kernels("fused_dense")
    matmul = matmul_tflops(args.samples)
    rows, verdicts = [], []
    for tokens, hidden, _ in GPT_SHAPES[:1] if args.quick else GPT_SHAPES:
        more_rows, more_verdicts = layer_rows(tokens, hidden, args.samples, matmul, not args.quick)
        rows += more_rows
        verdicts += more_verdicts
        torch.cuda.empty_cache()
    for shape in WGRAD_SHAPES[:1] if args.quick else WGRAD_SHAPES:
        more_rows, more_verdicts = wgrad_rows(*shape, args.samples, matmul)
        rows += more_rows
        verdicts += more_verdicts
        torch.cuda.empty_cache()
    notes = [f"bf16 matmul rate (torch.mm 8192^3, same run): {matmul:.0f} TFLOP/s"]
    return finish("bench_fused_dense", HEADER, rows, verdicts, out=args.out, notes=notes)


if __name__ == "__main__":
    sys.exit(main())
