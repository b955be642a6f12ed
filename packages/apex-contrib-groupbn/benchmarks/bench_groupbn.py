"""apex.contrib.groupbn.BatchNorm2d_NHWC (fused add + ReLU) against torch's BatchNorm2d + add + ReLU,
eager and under torch.compile (CUDA only, one GPU, bn_group=1).

    python packages/apex-contrib-groupbn/benchmarks/bench_groupbn.py [--out DIR] [--samples N] [--batch N ...]

One training step of one norm at ResNet-50 shapes: ``y = relu(bn(x) + z)`` forward, then the
gradients of x, z, weight and bias through ``torch.autograd.grad``. Ours takes the ``(N, H, W, C)``
tensor; torch's take the same memory as an ``(N, C, H, W)`` channels_last view (no copy). float16
and bfloat16 input, float32 parameters. Per row: ours, eager and compiled torch in ms (CUDA events,
median of samples, data cycling through enough copies to outgrow L2), eager / ours and compiled /
ours, and ours in GB/s over the least traffic of the step (x, z, dy read; y, dx, dz written) and as a
share of the device copy bandwidth measured in the same run. Bar: ours at least as fast as eager torch.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from apex.contrib.groupbn import BatchNorm2d_NHWC
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


class TorchAddRelu(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x, z):  # x, z: (N, H, W, C) memory, viewed as channels_last (N, C, H, W)
        return torch.relu(self.bn(x.permute(0, 3, 1, 2)) + z.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)


def step(module):
    params = [module.weight, module.bias] if hasattr(module, "weight") else [module.bn.weight, module.bn.bias]

    def run(x, z, dy):
        return torch.autograd.grad(module(x, z), [x, z, *params], dy)

    return run


def measure(n, c, hw, dtype, samples):
    shape = (n, hw, hw, c)
    one = n * hw * hw * c * dtype.itemsize
    copies = copies_for_l2(3 * one)
    data = [
        tuple(torch.randn(shape, device="cuda", dtype=dtype).requires_grad_(i < 2) for i in range(3))
        for _ in range(copies)
    ]
    ours = BatchNorm2d_NHWC(c, fuse_relu=True).cuda()
    torch_bn = TorchAddRelu(c).cuda()
    torch.compiler.reset()  # a fresh compile per case: one code object would hit dynamo's recompile limit
    compiled = torch.compile(TorchAddRelu(c).cuda())
    runs = {"ours": step(ours), "eager": step(torch_bn), "compiled": step(compiled)}
    x, z, dy = data[0]
    expected = runs["eager"](x, z, dy)
    # Where bn(x) + z is within rounding of 0 the two sides may disagree on the ReLU's mask, which moves
    # dz and dx there by up to |dy| (a few elements in 10^5 at these sizes): those are left out of the
    # elementwise check. The parameter gradients sum dy over those elements too (256x64x112x112 fp16 on
    # an H100: dbias off by up to 38 where it reaches thousands): they are compared against their
    # largest element.
    with torch.no_grad():
        pre = torch_bn.bn(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1).float() + z.float()
        clear = pre.abs() > 1e-2
    for got, want in zip(runs["ours"](x, z, dy), expected):
        got, want = got.float(), want.float()
        if got.shape == clear.shape:
            torch.testing.assert_close(got[clear], want[clear], rtol=5e-2, atol=5e-2)
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=5e-2 * want.abs().max().item())
    ms = compare_ms({name: [lambda d=d, f=fn: f(*d) for d in data] for name, fn in runs.items()}, samples)
    gbps = gb_per_s(6 * one, ms["ours"])
    cells = [f"{ms['ours']:.3f}", f"{ms['eager']:.3f}", f"{ms['compiled']:.3f}"]
    cells += [f"{ms['eager'] / ms['ours']:.2f}x", f"{ms['compiled'] / ms['ours']:.2f}x", f"{gbps:.0f}"]
    return cells, gbps, ms["eager"] / ms["ours"]


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_groupbn", __doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 64], help="images per GPU")
    args = parser.parse_args(argv)
    if not require_cuda("bench_groupbn"):
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
    return finish("bench_groupbn", HEADER, rows, verdicts, out=args.out, copy_gbps=copy_gbps)


if __name__ == "__main__":
    sys.exit(main())
