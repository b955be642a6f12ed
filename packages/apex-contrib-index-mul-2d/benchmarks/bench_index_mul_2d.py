"""apex.contrib.index_mul_2d against PyTorch's ``in1[idx1] * in2``, eager and under torch.compile, in one
process (CUDA only).

    python packages/apex-contrib-index-mul-2d/benchmarks/bench_index_mul_2d.py [--out DIR] [--samples N]

Shape (N1, N2, F) = (100000, 1000000, 64), the bars of issue 21, in float32, float16 and bfloat16,
random indices (each row of in1 used about ten times). Two passes per dtype:

- fwd: the forward alone (no autograd);
- fwd+bwd: the forward with autograd and ``torch.autograd.grad`` of both inputs (ours: the
  fused backward, atomics into grad_in1; eager: PyTorch's mul backward and index backward, which
  sorts the indices).

Times are medians of CUDA-event samples of back-to-back calls (apex.core.benchmarking.time_ms).
Bytes model of the forward (its least traffic): read in1 once, in2 and idx1, write out:
``(N1 * F + 2 * N2 * F) * itemsize + 8 * N2``. Bars: fwd+bwd eager / ours >= 1.5, and the forward
at >= 70% of the device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import sys

import torch

from apex.core.benchmarking import (
    bench_arguments,
    copy_bandwidth_gbps,
    finish,
    gb_per_s,
    require_cuda,
    require_kernels,
    time_ms,
    verdict,
)

N1, N2, F = 100_000, 1_000_000, 64
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BARS = {"eager fwd+bwd": 1.5, "copy fwd": 0.7}
HEADER = ["dtype", "pass", "ours ms", "eager ms", "compiled ms", "eager/ours", "compiled/ours", "GB/s", "% of copy"]


def eager(in1: torch.Tensor, in2: torch.Tensor, idx1: torch.Tensor) -> torch.Tensor:
    return in1[idx1] * in2


def forward_and_backward(fn, in1, in2, idx1, grad):
    a, b = in1.detach().requires_grad_(), in2.detach().requires_grad_()
    return lambda: torch.autograd.grad(fn(a, b, idx1), (a, b), grad)


def check_agreement(ours, in1, in2, idx1, grad) -> None:
    """Ours against eager before anything is timed: the forward bit for bit, the gradients to rounding."""
    torch.testing.assert_close(ours(in1, in2, idx1), eager(in1, in2, idx1), rtol=0, atol=0)
    got = forward_and_backward(ours, in1, in2, idx1, grad)()
    expected = forward_and_backward(eager, in1.float(), in2.float(), idx1, grad.float())()
    for g, e in zip(got, expected):
        scale = e.abs().max().item()
        torch.testing.assert_close(g.float(), e, rtol=1e-2, atol=1e-2 * scale)


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_index_mul_2d", __doc__)
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not require_cuda("bench_index_mul_2d.py"):
        return 1
    from apex.contrib.index_mul_2d import index_mul_2d

    require_kernels("index_mul_2d")
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps(args.samples)
    compiled = torch.compile(eager, fullgraph=True, dynamic=False)
    rows, verdicts = [], []
    idx1 = torch.randint(0, N1, (N2,), device="cuda")
    for dtype in DTYPES:
        in1 = torch.randn(N1, F, device="cuda").to(dtype)
        in2 = torch.randn(N2, F, device="cuda").to(dtype)
        grad = torch.randn(N2, F, device="cuda").to(dtype)
        check_agreement(index_mul_2d, in1, in2, idx1, grad)
        impls = {"ours": index_mul_2d, "eager": eager, "compiled": compiled}
        forward_bytes = (N1 * F + 2 * N2 * F) * in1.element_size() + idx1.numel() * idx1.element_size()
        for pass_name in ("fwd", "fwd+bwd"):
            if pass_name == "fwd":
                calls = {name: (lambda fn=fn, a=in1, b=in2: fn(a, b, idx1)) for name, fn in impls.items()}
            else:
                calls = {name: forward_and_backward(fn, in1, in2, idx1, grad) for name, fn in impls.items()}
            ms = {name: time_ms([call], args.samples) for name, call in calls.items()}
            speedup, vs_compiled = ms["eager"] / ms["ours"], ms["compiled"] / ms["ours"]
            name = str(dtype).removeprefix("torch.")
            cells = [name, pass_name, f"{ms['ours']:.3f}", f"{ms['eager']:.3f}", f"{ms['compiled']:.3f}"]
            cells += [f"{speedup:.2f}", f"{vs_compiled:.2f}"]
            if pass_name == "fwd":
                gbps = gb_per_s(forward_bytes, ms["ours"])
                cells += [f"{gbps:.0f}", f"{100 * gbps / copy_gbps:.1f}"]
                label = f"{name} fwd: fraction of copy bandwidth >= {BARS['copy fwd']}"
                verdicts.append(verdict(label, gbps / copy_gbps, BARS["copy fwd"]))
            else:
                cells += ["", ""]
                label = f"{name} fwd+bwd: eager/ours >= {BARS['eager fwd+bwd']}"
                verdicts.append(verdict(label, speedup, BARS["eager fwd+bwd"]))
            rows.append(cells)
        del in1, in2, grad
    notes = [
        f"(N1, N2, F) = ({N1}, {N2}, {F}), idx1 uniform random int64",
        "forward bytes model: in1 read once, in2 and idx1 read, out written",
        "eager: in1[idx1] * in2 with autograd; compiled: the same under torch.compile(fullgraph=True)",
    ]
    return finish("bench_index_mul_2d", HEADER, rows, verdicts, out=args.out, copy_gbps=copy_gbps, notes=notes)


if __name__ == "__main__":
    sys.exit(main())
