"""apex.contrib.cudnn_gbn.GroupBatchNorm2d against torch's BatchNorm2d, eager and under torch.compile
(CUDA only, one GPU, group_size=1).

    python packages/apex-contrib-cudnn-gbn/benchmarks/bench_cudnn_gbn.py [--out DIR] [--samples N] [--batch N ...]

One training step of one norm at ResNet-50 shapes on a channels_last ``(N, C, H, W)`` tensor
(upstream's only layout; upstream has no fused add + ReLU): forward, then the gradients of x, weight
and bias through ``torch.autograd.grad``. float16 and bfloat16 input, float32 parameters. Per row:
ours, eager and compiled torch in ms (CUDA events, median of samples, data cycling through enough
copies to outgrow L2), eager / ours and compiled / ours, and ours in GB/s over the least traffic of
the step (x, dy read; y, dx written) and as a share of the device copy bandwidth measured in the same
run. Bar: ours at least as fast as eager torch.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from apex.contrib.cudnn_gbn import GroupBatchNorm2d
from apex.core.benchmarking import (
    bench_arguments,
    compare_ms,
    copies_for_l2,
    copy_bandwidth_gbps,
    finish,
    gb_per_s,
    progress,
    require_cuda,
    require_kernels,
    verdict,
)

# (C, H=W) of ResNet-50's batch norms: the stem, then the first layer of each stage and its widest.
SHAPES = [(64, 112), (64, 56), (256, 56), (128, 28), (512, 28), (256, 14), (1024, 14), (512, 7), (2048, 7)]
DTYPES = [torch.float16, torch.bfloat16]
EAGER_BAR = 1.0
HEADER = ["N", "C", "HxW", "dtype", "ours ms", "eager ms", "compiled ms", "eager / ours", "compiled / ours",
          "ours GB/s", "% of copy"]  # fmt: skip


def step(module):
    def run(x, dy):
        return torch.autograd.grad(module(x), [x, module.weight, module.bias], dy)

    return run


def measure(n, c, hw, dtype, samples):
    shape = (n, c, hw, hw)
    one = n * hw * hw * c * dtype.itemsize
    copies = copies_for_l2(2 * one)
    cl = torch.channels_last
    data = [
        (
            torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=cl).requires_grad_(),
            torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=cl),
        )
        for _ in range(copies)
    ]
    torch.compiler.reset()  # a fresh compile per case: one code object would hit dynamo's recompile limit
    runs = {
        "ours": step(GroupBatchNorm2d(c, 1).cuda()),
        "eager": step(nn.BatchNorm2d(c).cuda()),
        "compiled": step(torch.compile(nn.BatchNorm2d(c).cuda())),
    }
    x, dy = data[0]
    expected = runs["eager"](x, dy)
    for got, want in zip(runs["ours"](x, dy), expected):
        torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2)
    ms = compare_ms({name: [lambda d=d, f=fn: f(*d) for d in data] for name, fn in runs.items()}, samples)
    gbps = gb_per_s(4 * one, ms["ours"])
    cells = [f"{ms['ours']:.3f}", f"{ms['eager']:.3f}", f"{ms['compiled']:.3f}"]
    cells += [f"{ms['eager'] / ms['ours']:.2f}x", f"{ms['compiled'] / ms['ours']:.2f}x", f"{gbps:.0f}"]
    return cells, gbps, ms["eager"] / ms["ours"]


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_cudnn_gbn", __doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 64], help="images per GPU")
    args = parser.parse_args(argv)
    if not require_cuda("bench_cudnn_gbn"):
        return 1
    require_kernels("parallel")
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps(args.samples)
    rows, verdicts = [], []
    for n in args.batch:
        for c, hw in SHAPES:
            for dtype in DTYPES:
                cells, gbps, ratio = measure(n, c, hw, dtype, args.samples)
                case = [str(n), str(c), f"{hw}x{hw}", str(dtype).removeprefix("torch.")]
                rows.append([*case, *cells, f"{100 * gbps / copy_gbps:.0f}%"])
                progress(rows[-1])
                verdicts.append(verdict(f"{' '.join(case)}: eager torch / ours", ratio, EAGER_BAR))
                torch.cuda.empty_cache()
    return finish("bench_cudnn_gbn", HEADER, rows, verdicts, out=args.out, copy_gbps=copy_gbps)


if __name__ == "__main__":
    sys.exit(main())
