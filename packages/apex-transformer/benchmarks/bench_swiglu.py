"""apex-transformer's fused SwiGLU against PyTorch's ``F.silu(gate) * up``, eager and under
torch.compile, in one process (CUDA only).

    python packages/apex-transformer/benchmarks/bench_swiglu.py [--out DIR] [--samples N]

Cases (bfloat16): Llama-style MLPs, ``[tokens, 2 * ffn]`` inputs (the fused gate-and-up
projection's output) with ``(tokens, ffn)`` in {(16384, 8192) (bench_e2e's Llama-1B), (8192,
14336) (Llama-3-8B at 8 x 1024 tokens)}. Forward, and forward + backward (the gradient of the
input through ``torch.autograd.grad``, the forward included since eager's backward cost depends
on what its forward saved):

- ours: ``apex.transformer.functional.fused_swiglu``;
- eager: ``gate, up = x.chunk(2, -1); F.silu(gate) * up``;
- compiled: the same under ``torch.compile`` (its backward the compiled one).

Times are medians of CUDA-event samples of back-to-back calls (apex.core.benchmarking.time_ms).
Bytes model (bfloat16, 2 B an element of [tokens, ffn]): forward 3 (read gate and up, write the
output); forward + backward 3 + 5 (read the output's gradient, gate and up, write both halves'
gradients). Bars, each row: ours >= 1.5x eager, ours at least as fast as compiled, ours >= 80% of
the device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from apex.core.benchmarking import (
    against_torch,
    bench_arguments,
    copy_bandwidth_gbps,
    markdown_table,
    report,
    require_cuda,
    require_kernels,
    time_ms,
)

DTYPE = torch.bfloat16
SHAPES = [(16384, 8192), (8192, 14336)]
BARS = {"eager": 1.5, "compiled": 1.0, "copy": 0.8}


def eager_swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def forward_backward(fn, x: torch.Tensor, grad: torch.Tensor):
    leaf = x.detach().requires_grad_()
    return lambda: torch.autograd.grad(fn(leaf), leaf, grad)


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_swiglu", __doc__)
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not require_cuda("bench_swiglu.py"):
        return 1
    from apex.transformer.functional import fused_swiglu

    require_kernels("transformer")
    copy_gbps = copy_bandwidth_gbps(args.samples)
    header = ["case", "pass", "ours ms", "eager ms", "compiled ms", "eager/ours", "compiled/ours", "GB/s", "% of copy"]
    rows, verdicts = [], []
    compiled = torch.compile(eager_swiglu)
    impls = (("ours", fused_swiglu), ("eager", eager_swiglu), ("compiled", compiled))
    for tokens, ffn in SHAPES:
        name = f"{tokens}x2x{ffn}"
        x = torch.randn(tokens, 2 * ffn, device="cuda", dtype=DTYPE)
        grad = torch.randn(tokens, ffn, device="cuda", dtype=DTYPE)
        # the results agree before anything is timed
        torch.testing.assert_close(fused_swiglu(x), eager_swiglu(x), atol=3e-2, rtol=3e-2)
        element = tokens * ffn * x.element_size()
        for pass_name, elements in (("fwd", 3), ("fwd+bwd", 8)):
            if pass_name == "fwd":
                calls = {impl: (lambda fn=fn, x=x: fn(x)) for impl, fn in impls}
            else:
                calls = {impl: forward_backward(fn, x, grad) for impl, fn in impls}
            ms = {impl: time_ms([call], args.samples) for impl, call in calls.items()}
            cells, case_verdicts = against_torch(f"{name} {pass_name}", ms, elements * element, copy_gbps, BARS)
            rows.append([name, pass_name, *cells])
            verdicts += case_verdicts
    notes = [
        "bytes model: 2 B per bf16 element of [tokens, ffn]; forward 3 such tensors, forward + backward 8",
        "eager: F.silu(gate) * up over x.chunk(2, -1); compiled: the same under torch.compile",
    ]
    report(
        "bench_swiglu", [*markdown_table(header, rows), "", *verdicts], out=args.out, copy_gbps=copy_gbps, notes=notes
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
