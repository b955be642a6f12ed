"""Device time of the norm backward's kernels alone, at transformer shapes (CUDA only; a tuning probe,
not a bar: bench_norms.py has the bars).

bfloat16 input and weight, ``memory_efficient=True`` (the saved tensor is the output, as the
end-to-end benchmark's apex stacks run them), layer norm with a bias and RMS norm without, each in
the plain form and the fused residual-add form (which also writes the residual's gradient). One
forward per case; then ``--calls`` backwards after five of warm-up, under torch.profiler, and the
device time of every kernel they launched, per backward. Bytes counted: the saved output, dy and
dx (and the residual's gradient), each rows x hidden x 2; "% of copy" against a device copy timed
in the same run. The gradients are checked against a float32 autograd reference of the same
rounded inputs (largest error relative to the largest magnitude).

    python packages/apex-normalization/benchmarks/backward_kernels.py [--shapes 16384x768,...]

An A/B of two builds: run it once per build with that build first on PYTHONPATH (ab_norms.sh
shows how to build one into a folder).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from bench_norms import parse_shapes
from torch.profiler import ProfilerActivity, profile

from apex.core.benchmarking import copy_bandwidth_gbps, require_cuda, require_kernels
from apex.normalization import functional as AF

EPS = 1e-5
DEFAULT_SHAPES = "16384x768,16384x1024,32768x1024,16384x2048,1024x1024"


def case(rms: bool, residual: bool, rows: int, hidden: int, calls: int) -> tuple[float, float, dict[str, float]]:
    """(device us per backward, relative error, {kernel name: us per backward})."""
    dtype = torch.bfloat16
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype, requires_grad=True)
    r = torch.randn(rows, hidden, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.rand(hidden, device="cuda") + 0.5).to(dtype).requires_grad_()
    b = None if rms else torch.randn(hidden, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    leaves = [x, r, w] if residual else [x, w]
    if b is not None:
        leaves.append(b)
    if residual and rms:
        out = AF.fused_add_rms_norm_affine(x, r, w, hidden, EPS, True)[0]
    elif residual:
        out = AF.fused_add_layer_norm_affine(x, r, w, b, hidden, EPS, True)[0]
    elif rms:
        out = AF.fused_rms_norm_affine(x, w, hidden, EPS, True)
    else:
        out = AF.fused_layer_norm_affine(x, w, b, hidden, EPS, True)
    got = torch.autograd.grad(out, leaves, dy, retain_graph=True)

    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    s = ref_leaves[0] + ref_leaves[1] if residual else ref_leaves[0]
    at = 2 if residual else 1
    if rms:
        ref = F.rms_norm(s, (hidden,), ref_leaves[at], EPS)
    else:
        ref = F.layer_norm(s, (hidden,), ref_leaves[at], ref_leaves[at + 1], EPS)
    expected = torch.autograd.grad(ref, ref_leaves, dy.float())
    error = max(((g.float() - e).abs().max() / e.abs().max().clamp_min(1e-6)).item() for g, e in zip(got, expected))

    for _ in range(5):
        torch.autograd.grad(out, leaves, dy, retain_graph=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            torch.autograd.grad(out, leaves, dy, retain_graph=True)
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            kernels[event.name] = kernels.get(event.name, 0.0) + event.device_time / calls
    return sum(kernels.values()), error, kernels


def short(name: str) -> str:
    """A kernel's name without its namespace and template arguments."""
    base = name.split("<", 1)[0].rsplit("::", 1)[-1]  # "(anonymous namespace)" comes before the last "::"
    return base.split("(", 1)[0].removeprefix("void ").strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES), help=DEFAULT_SHAPES)
    parser.add_argument("--calls", type=int, default=20, help="profiled backwards per case (default 20)")
    args = parser.parse_args(argv)
    if not require_cuda("backward_kernels"):
        return 1
    require_kernels("normalization")
    torch.manual_seed(0)
    copy = copy_bandwidth_gbps(10)
    print(f"apex.normalization from {AF.__file__}; copy {copy:.0f} GB/s")
    print("| norm | form | rows x hidden | us | GB/s | % of copy | error | kernels (us) |")
    print("|---|---|---|---|---|---|---|---|")
    for rms in (False, True):
        for residual in (True, False):
            for rows, hidden in args.shapes:
                us, error, kernels = case(rms, residual, rows, hidden, args.calls)
                moved = rows * hidden * 2 * (4 if residual else 3)
                gbps = moved / us / 1e3
                detail = ", ".join(f"{short(k)} {v:.1f}" for k, v in sorted(kernels.items(), key=lambda kv: -kv[1]))
                print(
                    f"| {'rms_norm' if rms else 'layer_norm'} | {'residual' if residual else 'plain'} | "
                    f"{rows}x{hidden} | {us:.1f} | {gbps:.0f} | {100 * gbps / copy:.0f}% | {error:.1e} | {detail} |"
                )
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
