"""Multi-tensor kernels of apex-core against PyTorch's native foreach ops, in one process.

Two workloads: a GPT-like set of ~355M parameters in ~290 tensors (bandwidth-bound) and
~2000 small tensors (launch-bound). Each row times ours and the closest native equivalent
with CUDA events (median of several samples, after warm-up), on random data, and reports
the effective bandwidth against a device-to-device copy measured in the same run.

    python packages/apex-core/benchmarks/bench_multi_tensor.py [--out DIR] [--quick]

Timing: a sample is a run of back-to-back calls, cycling through enough copies of the data
that it cannot stay in L2, started behind a short GPU sleep so that the host queues work
ahead; per-call time is the sample's time divided by its calls. Host launch overhead
therefore shows where it exceeds the GPU time (the small-tensor cases).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from apex.core.benchmarking import (
    bench_arguments,
    copies_for_l2,
    copy_bandwidth_gbps,
    gb_per_s,
    markdown_table,
    nbytes,
    report,
    require_cuda,
    require_kernels,
    time_ms,
)

CHUNK_SIZE = 65536


@dataclass
class Row:
    case: str
    torch_op: str
    dtype: str
    n_tensors: int
    n_params: int
    ours_ms: float
    torch_ms: float
    bytes_moved: int

    def cells(self, copy_gbps: float) -> list[str]:
        gbps = gb_per_s(self.bytes_moved, self.ours_ms)
        return [
            self.case,
            self.dtype,
            str(self.n_tensors),
            f"{self.n_params / 1e6:.1f}M",
            f"{self.ours_ms:.3f}",
            f"{self.torch_ms:.3f}",
            f"{self.torch_ms / self.ours_ms:.2f}x",
            f"{gbps:.0f}",
            f"{100 * gbps / copy_gbps:.0f}%",
        ]


HEADER = ["case", "dtype", "tensors", "params", "ours ms", "torch ms", "speedup", "ours GB/s", "% of copy"]


def gpt_shapes(layers: int = 24, hidden: int = 1024, vocab: int = 50257, context: int = 1024) -> list[tuple]:
    """GPT-2 medium: token and position embeddings, 12 tensors per layer, final layer norm."""
    shapes: list[tuple] = [(vocab, hidden), (context, hidden)]
    for _ in range(layers):
        shapes += [(hidden,), (hidden,)]  # ln_1
        shapes += [(3 * hidden, hidden), (3 * hidden,)]  # attention qkv
        shapes += [(hidden, hidden), (hidden,)]  # attention projection
        shapes += [(hidden,), (hidden,)]  # ln_2
        shapes += [(4 * hidden, hidden), (4 * hidden,)]  # mlp fc
        shapes += [(hidden, 4 * hidden), (hidden,)]  # mlp projection
    return [*shapes, (hidden,), (hidden,)]


def small_shapes(count: int = 2000, seed: int = 0) -> list[tuple]:
    """Log-uniform sizes from 1 to 16K elements, many of them odd."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.exp(torch.rand(count, generator=gen) * math.log(16384)).long().clamp(min=1)
    return [(int(n),) for n in sizes]


def make_list(shapes, dtype, device) -> list[torch.Tensor]:
    return [torch.randn(s, dtype=dtype, device=device) for s in shapes]


def bench_workload(name: str, shapes, dtype, samples: int, check: bool) -> list[Row]:
    ops = torch.ops.apex_core
    device = torch.device("cuda")
    probe = make_list(shapes, dtype, device)
    n_params = sum(t.numel() for t in probe)
    copies = copies_for_l2(nbytes(probe))
    del probe
    # Every copy: x, y (inputs), out (outputs); in-place cases update x.
    data = [
        (make_list(shapes, dtype, device), make_list(shapes, dtype, device), make_list(shapes, dtype, device))
        for _ in range(copies)
    ]
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    one = torch.ones(1, dtype=torch.float32, device=device)
    a, b = 0.5, 2.0
    size = nbytes(data[0][0])
    label = str(dtype).replace("torch.", "")
    rows: list[Row] = []

    def run(case, torch_op, ours, native, moved, compare=None):
        if check and compare is not None:
            compare()
        ours_ms = time_ms([lambda d=d: ours(*d) for d in data], samples, min_calls=20, warmup=1)
        torch_ms = time_ms([lambda d=d: native(*d) for d in data], samples, min_calls=20, warmup=1)
        rows.append(Row(f"{name}: {case}", torch_op, label, len(shapes), n_params, ours_ms, torch_ms, moved))

    def close(actual, expected):
        torch.testing.assert_close(actual, expected, rtol=1e-3 if dtype == torch.float32 else 2e-2, atol=1e-5)

    x0, y0, out0 = data[0]

    # out = x * a (out of place) vs torch._foreach_mul, which allocates its outputs.
    def compare_scale():
        ops.multi_tensor_scale(CHUNK_SIZE, flag, x0, out0, a)
        close(out0, torch._foreach_mul(x0, a))

    run(
        "scale out-of-place",
        "_foreach_mul",
        lambda x, y, out: ops.multi_tensor_scale(CHUNK_SIZE, flag, x, out, a),
        lambda x, y, out: torch._foreach_mul(x, a),
        2 * size,
        compare_scale,
    )

    # In-place unscale with an inf/NaN check (the grad unscale of a loss scaler), scale 1 so that
    # repeated calls keep the data unchanged.
    run(
        "unscale+check in-place",
        "_amp_foreach_non_finite_check_and_unscale_",
        lambda x, y, out: ops.multi_tensor_scale(CHUNK_SIZE, flag, x, x, 1.0, one),
        lambda x, y, out: torch._amp_foreach_non_finite_check_and_unscale_(x, found_inf, one),
        2 * size,
    )

    # out = a * x + b * y vs two native passes (mul, then add with alpha).
    def compare_axpby():
        ops.multi_tensor_axpby(CHUNK_SIZE, flag, x0, y0, out0, a, b, -1)
        close(out0, torch._foreach_add(torch._foreach_mul(x0, a), y0, alpha=b))

    run(
        "axpby",
        "_foreach_add(_foreach_mul)",
        lambda x, y, out: ops.multi_tensor_axpby(CHUNK_SIZE, flag, x, y, out, a, b, -1),
        lambda x, y, out: torch._foreach_add(torch._foreach_mul(x, a), y, alpha=b),
        3 * size,
        compare_axpby,
    )

    def native_norms(x):
        per = torch._foreach_norm(x)
        return torch.linalg.vector_norm(torch.stack(per)), per

    def compare_l2norm():
        total, per = ops.multi_tensor_l2norm(CHUNK_SIZE, flag, x0, True)
        ref_total, ref_per = native_norms([t.float() for t in x0])
        close(total, ref_total.reshape(1))
        close(per, torch.stack(ref_per))

    run(
        "l2norm per-tensor",
        "_foreach_norm + vector_norm(stack)",
        lambda x, y, out: ops.multi_tensor_l2norm(CHUNK_SIZE, flag, x, True),
        lambda x, y, out: native_norms(x),
        size,
        compare_l2norm,
    )

    def native_unscale_norms(x):
        torch._amp_foreach_non_finite_check_and_unscale_(x, found_inf, one)
        return native_norms(x)

    run(
        "unscale+l2norm in-place",
        "_amp_..._unscale_ + _foreach_norm",
        lambda x, y, out: ops.multi_tensor_unscale_l2norm(CHUNK_SIZE, flag, x, x, one, True),
        lambda x, y, out: native_unscale_norms(x),
        2 * size,
    )
    assert flag.item() == 0 and found_inf.item() == 0, "random finite data raised the overflow flag"
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_multi_tensor", __doc__)
    parser.add_argument("--quick", action="store_true", help="GPT set in fp32 only, fewer samples")
    parser.add_argument("--no-check", action="store_true", help="skip comparing results with torch first")
    args = parser.parse_args(argv)
    if not require_cuda("bench_multi_tensor"):
        return 1
    require_kernels("core")
    torch.manual_seed(0)
    samples = 5 if args.quick else args.samples
    check = not args.no_check

    copy_gbps = copy_bandwidth_gbps(samples)
    rows: list[Row] = []
    workloads = [("gpt-355M", gpt_shapes(), torch.float32)]
    if not args.quick:
        # fp16, not bf16: the dtype that loss scaling is for, and torch's unscale has no bf16 kernel.
        workloads += [("gpt-355M", gpt_shapes(), torch.float16), ("2000 small", small_shapes(), torch.float32)]
    for name, shapes, dtype in workloads:
        rows += bench_workload(name, shapes, dtype, samples, check)
        torch.cuda.empty_cache()

    table = markdown_table([*HEADER, "torch op"], [[*row.cells(copy_gbps), f"`{row.torch_op}`"] for row in rows])
    notes = [f"chunk_size {CHUNK_SIZE}; speedup = torch ms / ours ms; GB/s counts bytes each op must read and write"]
    report("bench_multi_tensor", table, out=args.out, copy_gbps=copy_gbps, notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
