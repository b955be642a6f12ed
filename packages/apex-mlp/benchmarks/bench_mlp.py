"""apex.mlp.MLP against PyTorch's nn.Sequential(Linear, ReLU, ...), eager and under torch.compile
(CUDA only): one forward and backward step.

    python packages/apex-mlp/benchmarks/bench_mlp.py [--out DIR] [--samples N]

Per case: ours, eager and compiled torch in ms (CUDA events, median of samples, input copies
cycling), eager / ours, compiled / ours, and ours in TFLOP/s and as a fraction of the bf16 matmul
rate measured in the same run (an 8192^3 torch.mm). The input needs no gradient (data), so the
first layer's input-gradient GEMM is not counted, nor done by either side. Bar: ours at least
EAGER_BAR times as fast as eager PyTorch. "eager bar needs": the share of the matmul rate at which
the step's GEMMs alone would take eager's time / EAGER_BAR (every other kernel free); over 100%,
the bar asks for GEMMs faster than the 8192^3 product.
"""

from __future__ import annotations

import itertools
import sys

import torch
from torch import nn

from apex.core.benchmarking import (
    bench_arguments,
    compare_ms,
    copies_for_l2,
    finish,
    require_cuda,
    require_kernels,
    time_ms,
    verdict,
)
from apex.mlp import MLP

CASES = [(8192, [1024, 4096, 4096, 1024], torch.bfloat16)]  # (batch, mlp_sizes, dtype)
EAGER_BAR = 1.1
MATMUL_SIZE = 8192
HEADER = ["batch", "mlp_sizes", "dtype", "ours ms", "eager ms", "compiled ms", "eager / ours", "compiled / ours",
          "ours TFLOP/s", "% of matmul", "eager bar needs"]  # fmt: skip


def matmul_tflops(samples: int) -> float:
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda", dtype=torch.bfloat16)
    ms = time_ms([lambda: torch.mm(a, b)], samples)
    return 2 * MATMUL_SIZE**3 / (ms * 1e-3) / 1e12


def step_flops(batch: int, sizes: list[int]) -> int:
    """Forward, weight gradients and input gradients of every layer but the first."""
    products = [i * o for i, o in itertools.pairwise(sizes)]
    return 2 * batch * (3 * sum(products) - products[0])


def sequential_like(mlp: MLP) -> nn.Sequential:
    layers = []
    for w, b in zip(mlp.weights, mlp.biases):
        linear = nn.Linear(w.shape[1], w.shape[0], device=w.device, dtype=w.dtype)
        with torch.no_grad():
            linear.weight.copy_(w)
            linear.bias.copy_(b)
        layers += [linear, nn.ReLU()]
    return nn.Sequential(*layers)


def measure(batch: int, sizes: list[int], dtype, samples: int) -> tuple[list[str], float, float, float]:
    """One row of the table, ours in TFLOP/s, eager / ours, and the TFLOP/s the bar asks for."""
    mlp = MLP(sizes).to(device="cuda", dtype=dtype)
    eager = sequential_like(mlp)
    compiled = torch.compile(sequential_like(mlp), fullgraph=True)
    copies = min(4, copies_for_l2(batch * sizes[0] * dtype.itemsize))
    inputs = [torch.randn(batch, sizes[0], device="cuda", dtype=dtype) for _ in range(copies)]
    grad = torch.randn(batch, sizes[-1], device="cuda", dtype=dtype)
    torch.testing.assert_close(mlp(inputs[0]), eager(inputs[0]), rtol=2e-2, atol=2e-2)

    def calls(module):
        params = list(module.parameters())

        def step(x):
            torch.autograd.grad(module(x), params, grad)

        return [lambda x=x: step(x) for x in inputs]

    ms = compare_ms({"ours": calls(mlp), "eager": calls(eager), "compiled": calls(compiled)}, samples)
    ours, eager_ms, compiled_ms = ms["ours"], ms["eager"], ms["compiled"]
    flops = step_flops(batch, sizes)
    tflops = flops / (ours * 1e-3) / 1e12
    needed = flops / (eager_ms / EAGER_BAR * 1e-3) / 1e12
    row = [f"{ours:.3f}", f"{eager_ms:.3f}", f"{compiled_ms:.3f}", f"{eager_ms / ours:.2f}x",
           f"{compiled_ms / ours:.2f}x", f"{tflops:.0f}"]  # fmt: skip
    return row, tflops, eager_ms / ours, needed


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_mlp", __doc__)
    args = parser.parse_args(argv)
    if not require_cuda("bench_mlp"):
        return 1
    require_kernels("mlp")
    torch.manual_seed(0)
    peak = matmul_tflops(args.samples)
    rows, verdicts = [], []
    for batch, sizes, dtype in CASES:
        cells, tflops, speedup, needed = measure(batch, sizes, dtype, args.samples)
        case = [str(batch), "-".join(map(str, sizes)), str(dtype).removeprefix("torch.")]
        rows.append([*case, *cells, f"{100 * tflops / peak:.0f}%", f"{100 * needed / peak:.0f}%"])
        verdicts.append(verdict(f"{' '.join(case)}: forward+backward, eager / ours", speedup, EAGER_BAR))
    notes = [f"bf16 matmul rate ({MATMUL_SIZE}^3 torch.mm): {peak:.0f} TFLOP/s"]
    return finish("bench_mlp", HEADER, rows, verdicts, out=args.out, notes=notes)


if __name__ == "__main__":
    sys.exit(main())
