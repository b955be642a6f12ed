"""apex.contrib.group_norm.GroupNorm(act="silu") against nn.GroupNorm + F.silu, eager and under torch.compile (CUDA).

    python packages/apex-contrib-group-norm/benchmarks/bench_group_norm.py [--out DIR] [--samples N] [--all]

Channels-last input of Stable-Diffusion-like shapes (N, C, H, W), 32 groups, parameters in the
input's dtype, bfloat16 and float16. Per shape and dtype, forward and forward+backward (the
gradients of input, weight and bias, through torch.autograd.grad): ours, eager torch and
compiled torch (``torch.compile(fullgraph=True)`` of nn.GroupNorm + SiLU) in ms (CUDA events,
median of samples, data cycling through enough copies to outgrow L2), the ratios torch / ours,
and ours in GB/s (the least traffic: x read and y written forward, plus x and dy read and dx
written backward) and as a share of the device copy bandwidth measured in the same run.
Bars, forward+backward at every shape: at least 1.0x compiled torch and 1.5x eager torch.
``--all`` runs every N in {2, 4, 8}, C in {320, 640, 1280}, H = W in {64, 32, 16}.
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F

from apex.contrib.group_norm import GroupNorm
from apex.core.benchmarking import (
    bench_arguments,
    copies_for_l2,
    copy_bandwidth_gbps,
    finish,
    gb_per_s,
    progress,
    require_cuda,
    require_kernels,
    time_ms,
    verdict,
)

GROUPS = 32
# (N, C, H = W): the UNet's resolutions and their channel counts (SD 1.x / 2.x), batch 2 and 8.
SHAPES = [(2, 320, 64), (2, 640, 32), (2, 1280, 16), (8, 320, 64), (8, 640, 32), (8, 1280, 32), (8, 1280, 16)]
ALL_SHAPES = list(itertools.product((2, 4, 8), (320, 640, 1280), (64, 32, 16)))
DTYPES = [torch.bfloat16, torch.float16]
COMPILED_BAR = 1.0
EAGER_BAR = 1.5
HEADER = [
    "shape (N, C, H, W)",
    "dtype",
    "pass",
    "ours ms",
    "eager ms",
    "compiled ms",
    "eager / ours",
    "compiled / ours",
    "ours GB/s",
    "% of copy",
]


class TorchGroupNormSilu(torch.nn.Module):
    def __init__(self, channels: int, dtype: torch.dtype):
        super().__init__()
        self.norm = torch.nn.GroupNorm(GROUPS, channels, device="cuda", dtype=dtype)

    def forward(self, x):
        return F.silu(self.norm(x))


def modules(channels: int, dtype: torch.dtype):
    ours = GroupNorm(GROUPS, channels, act="silu", device="cuda", dtype=dtype)
    theirs = TorchGroupNormSilu(channels, dtype)
    with torch.no_grad():
        ours.weight.copy_(1 + 0.1 * torch.randn(channels, device="cuda"))
        ours.bias.copy_(0.1 * torch.randn(channels, device="cuda"))
        theirs.norm.weight.copy_(ours.weight)
        theirs.norm.bias.copy_(ours.bias)
    return ours, theirs


def forward_backward(fn, params):
    def run(x, dy):
        return torch.autograd.grad(fn(x), (x, *params), dy)

    return run


def measure(shape, dtype, samples: int) -> list[tuple[str, float, float, float, float]]:
    """(pass, ours, eager, compiled ms, bytes) for the forward and the forward+backward."""
    n, c, side = shape
    numel = n * c * side * side
    ours, theirs = modules(c, dtype)
    compiled = torch.compile(theirs, fullgraph=True, dynamic=False)  # a static kernel per shape, as deployed
    copies = copies_for_l2(3 * numel * dtype.itemsize)
    xs = [
        torch.randn(n, c, side, side, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
        for _ in range(copies)
    ]
    dys = [torch.randn_like(x) for x in xs]
    with torch.no_grad():
        torch.testing.assert_close(ours(xs[0]), theirs(xs[0]), rtol=2e-2, atol=2e-2)
    results = []
    with torch.no_grad():
        times = [time_ms([lambda x=x, fn=fn: fn(x) for x in xs], samples) for fn in (ours, theirs, compiled)]
    results.append(("forward", *times, 2 * numel * dtype.itemsize))
    for x in xs:
        x.requires_grad_()
    runners = [
        forward_backward(ours, (ours.weight, ours.bias)),
        forward_backward(theirs, (theirs.norm.weight, theirs.norm.bias)),
        forward_backward(compiled, (theirs.norm.weight, theirs.norm.bias)),
    ]
    got = runners[0](xs[0], dys[0])
    want = runners[1](xs[0], dys[0])
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2 * b.float().abs().max().item())
    times = [time_ms([lambda x=x, dy=dy, run=run: run(x, dy) for x, dy in zip(xs, dys)], samples) for run in runners]
    results.append(("forward+backward", *times, 5 * numel * dtype.itemsize))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_group_norm", __doc__)
    parser.add_argument("--all", action="store_true", help="every N, C, H = W of the grid in the docstring")
    args = parser.parse_args(argv)
    if not require_cuda("bench_group_norm"):
        return 1
    require_kernels("group_norm")
    torch.manual_seed(0)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    copy_gbps = copy_bandwidth_gbps(args.samples)
    rows, verdicts = [], []
    for shape in ALL_SHAPES if args.all else SHAPES:
        n, c, side = shape
        for dtype in DTYPES:
            case = [f"{n}x{c}x{side}x{side}", str(dtype).removeprefix("torch.")]
            for name, ours, eager, compiled, moved in measure(shape, dtype, args.samples):
                gbps = gb_per_s(moved, ours)
                rows.append(
                    [
                        *case,
                        name,
                        f"{ours:.4f}",
                        f"{eager:.4f}",
                        f"{compiled:.4f}",
                        f"{eager / ours:.2f}x",
                        f"{compiled / ours:.2f}x",
                        f"{gbps:.0f}",
                        f"{100 * gbps / copy_gbps:.0f}%",
                    ]
                )
                progress(rows[-1])
                if name == "forward+backward":
                    label = " ".join(case)
                    verdicts.append(verdict(f"{label} fwd+bwd: compiled torch / ours", compiled / ours, COMPILED_BAR))
                    verdicts.append(verdict(f"{label} fwd+bwd: eager torch / ours", eager / ours, EAGER_BAR))
    notes = [f"GroupNorm({GROUPS} groups, act='silu'), channels-last input, parameters in the input's dtype"]
    return finish("bench_group_norm", HEADER, rows, verdicts, out=args.out, copy_gbps=copy_gbps, notes=notes)


if __name__ == "__main__":
    sys.exit(main())
