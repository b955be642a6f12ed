"""apex.contrib.clip_grad.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_(foreach=True), eager and
under torch.compile, on the gradients of GPT-2 medium (~355M parameters in ~290 tensors: the set of
packages/apex-core/benchmarks/bench_multi_tensor.py), float32 and bfloat16 (CUDA only).

    python packages/apex-contrib-clip-grad/benchmarks/bench_clip_grad.py [--out DIR] [--samples N] [--no-compile]

Per dtype: ours, PyTorch's foreach eager and compiled in ms (CUDA events, median of samples; the
gradients are larger than L2 many times over), torch / ours, and ours in GB/s (each gradient read
for the norm, then read and written by the scaling) and as a share of the device copy bandwidth
measured in the same run. Bar (issue 21): ours at least as fast as PyTorch's foreach eager, per dtype.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from apex.contrib.clip_grad import clip_grad_norm_
from apex.core.benchmarking import (
    bench_arguments,
    copy_bandwidth_gbps,
    finish,
    gb_per_s,
    nbytes,
    require_cuda,
    require_kernels,
    time_ms,
    verdict,
)

DTYPES = [torch.float32, torch.bfloat16]
MAX_NORM = 1.0
SPEEDUP_BAR = 1.0
HEADER = ["dtype", "tensors", "params", "ours ms", "torch ms", "compiled ms", "torch / ours", "ours GB/s", "% of copy"]
MULTI_TENSOR_BENCH = Path(__file__).resolve().parents[2] / "apex-core" / "benchmarks" / "bench_multi_tensor.py"


def gpt_shapes() -> list[tuple]:
    """The GPT parameter set of apex-core's multi-tensor benchmark (one definition, imported from the source tree)."""
    spec = importlib.util.spec_from_file_location("bench_multi_tensor", MULTI_TENSOR_BENCH)
    if spec is None or not MULTI_TENSOR_BENCH.exists():
        raise FileNotFoundError(f"{MULTI_TENSOR_BENCH} not found: run this from the apex source tree")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.gpt_shapes()


def make_params(shapes, dtype) -> list[torch.nn.Parameter]:
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="cuda"))
        p.grad = torch.randn(shape, dtype=dtype, device="cuda")
        params.append(p)
    return params


def check(params) -> None:
    """Ours and PyTorch's agree on copies of the gradients (and both clip)."""
    ours = [torch.nn.Parameter(p.detach()) for p in params]
    theirs = [torch.nn.Parameter(p.detach()) for p in params]
    for p, a, b in zip(params, ours, theirs):
        a.grad, b.grad = p.grad.clone(), p.grad.clone()
    norm = clip_grad_norm_(ours, MAX_NORM)
    their_norm = torch.nn.utils.clip_grad_norm_(theirs, MAX_NORM, foreach=True)
    assert norm.dtype == their_norm.dtype and float(norm) > MAX_NORM
    tolerance = {"rtol": 1e-3, "atol": 0} if params[0].dtype == torch.float32 else {"rtol": 3e-2, "atol": 1e-6}
    torch.testing.assert_close(norm, their_norm, **tolerance)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, **tolerance)


def measure(shapes, dtype, samples: int, compile_torch: bool) -> tuple[list[str], float, float]:
    """One row of the table, ours in GB/s, and torch / ours."""
    params = make_params(shapes, dtype)
    check(params)

    def timed(fn):
        return time_ms([lambda: fn(params)], samples, min_calls=20)

    ours = timed(lambda ps: clip_grad_norm_(ps, MAX_NORM))
    eager = timed(lambda ps: torch.nn.utils.clip_grad_norm_(ps, MAX_NORM, foreach=True))
    compiled_cell = "-"
    if compile_torch:
        compiled = torch.compile(lambda ps: torch.nn.utils.clip_grad_norm_(ps, MAX_NORM, foreach=True))
        compiled_cell = f"{timed(compiled):.3f}"
    size = nbytes([p.grad for p in params])
    gbps = gb_per_s(3 * size, ours)  # the norm reads every gradient, the scaling reads and writes it
    n_params = sum(p.numel() for p in params)
    row = [str(dtype).removeprefix("torch."), str(len(params)), f"{n_params / 1e6:.1f}M"]
    row += [f"{ours:.3f}", f"{eager:.3f}", compiled_cell, f"{eager / ours:.2f}x", f"{gbps:.0f}"]
    return row, gbps, eager / ours


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_clip_grad", __doc__, no_compile=True)
    args = parser.parse_args(argv)
    if not require_cuda("bench_clip_grad"):
        return 1
    require_kernels("core")
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps(args.samples)
    shapes = gpt_shapes()
    rows, verdicts = [], []
    for dtype in DTYPES:
        cells, gbps, speedup = measure(shapes, dtype, args.samples, not args.no_compile)
        rows.append([*cells, f"{100 * gbps / copy_gbps:.0f}%"])
        name = str(dtype).removeprefix("torch.")
        verdicts.append(verdict(f"gpt-355M {name}: torch foreach eager ms / ours ms", speedup, SPEEDUP_BAR))
        torch.cuda.empty_cache()
    notes = [
        f"max_norm {MAX_NORM}; torch = torch.nn.utils.clip_grad_norm_(foreach=True); compiled = the same under "
        "torch.compile (default mode); GB/s counts 3 x the gradients' bytes (norm read, scale read + write)"
    ]
    return finish("bench_clip_grad", HEADER, rows, verdicts, out=args.out, copy_gbps=copy_gbps, notes=notes)


if __name__ == "__main__":
    sys.exit(main())
