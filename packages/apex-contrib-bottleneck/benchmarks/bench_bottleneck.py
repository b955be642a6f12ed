"""apex.contrib.bottleneck.Bottleneck (use_cudnn=True: apex-contrib-conv-bias-relu's fused convolutions)
against the same block written in plain ``nn.Conv2d`` / ``FrozenBatchNorm2d`` / ReLU modules, eager and
under torch.compile (CUDA only), at ResNet-50's bottleneck shapes, N=64, channels-last.

    python packages/apex-contrib-bottleneck/benchmarks/bench_bottleneck.py [--out DIR] [--samples N]
        [--batch 64] [--dtype bfloat16 float16]

Per shape and dtype, one forward+backward (gradients of x and every convolution weight): ours, eager torch
and compiled torch in ms (CUDA events, median of samples, inputs cycling through enough copies to outgrow
L2), eager / ours and compiled / ours, ours in TFLOP/s (the convolutions' 2 * MACs, three times for
forward+backward) and as a share of the dense matmul rate measured in the same run. Ours has no kernel of
its own (cuDNN's convolutions), so the bar is parity with eager torch: eager / ours at least EAGER_BAR.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from apex.contrib.bottleneck import Bottleneck, FrozenBatchNorm2d
from apex.core.benchmarking import (
    bench_arguments,
    compare_ms,
    copies_for_l2,
    finish,
    progress,
    require_cuda,
    time_ms,
    verdict,
)

# ResNet-50 bottlenecks (stride on the first 1x1, as upstream): (name, in, bottleneck, out, H=W, stride)
SHAPES = [
    ("layer1.0 (downsample)", 64, 64, 256, 56, 1),
    ("layer1.1", 256, 64, 256, 56, 1),
    ("layer2.0 (stride 2)", 256, 128, 512, 56, 2),
    ("layer2.1", 512, 128, 512, 28, 1),
    ("layer3.1", 1024, 256, 1024, 14, 1),
    ("layer4.1", 2048, 512, 2048, 7, 1),
]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
EAGER_BAR = 0.95
HEADER = [
    "block",
    "N",
    "dtype",
    "ours ms",
    "eager ms",
    "compiled ms",
    "eager / ours",
    "compiled / ours",
    "ours TFLOP/s",
    "% of matmul",
]


class PlainBottleneck(nn.Module):
    """The block in plain modules: what a user writes without apex (torchvision-style, frozen BN)."""

    def __init__(self, cin, mid, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, mid, 1, stride=stride, bias=False)
        self.bn1 = FrozenBatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, padding=1, bias=False)
        self.bn2 = FrozenBatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, cout, 1, bias=False)
        self.bn3 = FrozenBatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), FrozenBatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


def matmul_tflops(dtype: torch.dtype, samples: int) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    b = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    ms = time_ms([lambda: a @ b], samples, min_calls=5)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def measure(shape, batch: int, dtype: torch.dtype, samples: int, peak: float):
    name, cin, mid, cout, size, stride = shape
    ours = Bottleneck(cin, mid, cout, stride, use_cudnn=True).to(device="cuda", dtype=dtype)
    ours = ours.to(memory_format=torch.channels_last)
    plain = PlainBottleneck(cin, mid, cout, stride).to(device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
    plain.load_state_dict(ours.state_dict())
    copies = copies_for_l2(batch * cin * size * size * dtype.itemsize)
    xs = [
        torch.randn(batch, cin, size, size, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
        for _ in range(copies)
    ]
    out_size = (size - 1) // stride + 1
    grad = torch.randn(batch, cout, out_size, out_size, device="cuda", dtype=dtype)
    grad = grad.to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = torch.compile(plain, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(ours(xs[0]), plain(xs[0]), rtol=5e-2, atol=5e-2)

    def timed(module):
        params = list(module.parameters()) if module is not compiled else list(plain.parameters())

        def run(x):
            x = x.detach().requires_grad_()
            torch.autograd.grad(module(x), [x, *params], grad)

        return [lambda x=x: run(x) for x in xs]

    ms = compare_ms({"ours": timed(ours), "eager": timed(plain), "compiled": timed(compiled)}, samples)
    ours_ms, eager_ms, compiled_ms = ms["ours"], ms["eager"], ms["compiled"]
    macs = batch * out_size * out_size * (cin * mid + mid * mid * 9 + mid * cout)
    if plain.downsample is not None:
        macs += batch * out_size * out_size * cin * cout
    tflops = 6 * macs / (ours_ms * 1e-3) / 1e12
    case = [name, str(batch), str(dtype).removeprefix("torch.")]
    row = [
        *case,
        f"{ours_ms:.3f}",
        f"{eager_ms:.3f}",
        f"{compiled_ms:.3f}",
        f"{eager_ms / ours_ms:.2f}x",
        f"{compiled_ms / ours_ms:.2f}x",
        f"{tflops:.0f}",
        f"{100 * tflops / peak:.0f}%",
    ]
    return row, verdict(f"{' '.join(case)}: eager / ours", eager_ms / ours_ms, EAGER_BAR)


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_bottleneck", __doc__, samples=11)
    parser.add_argument("--batch", type=int, nargs="+", default=[64], help="batch sizes (default 64)")
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES), help="dtypes")
    args = parser.parse_args(argv)
    if not require_cuda("bench_bottleneck"):
        return 1
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    rows, verdicts = [], []
    notes = ["ours: conv-bias-relu's fused conv + frozen scale/bias + ReLU (cuDNN), residual in PyTorch"]
    for dtype_name in args.dtype:
        dtype = DTYPES[dtype_name]
        peak = matmul_tflops(dtype, args.samples)
        notes.append(f"dense matmul rate, {dtype_name} 8192^3: {peak:.0f} TFLOP/s")
        for batch in args.batch:
            for shape in SHAPES:
                row, v = measure(shape, batch, dtype, args.samples, peak)
                rows.append(row)
                progress(row)
                verdicts.append(v)
    return finish("bench_bottleneck", HEADER, rows, verdicts, out=args.out, notes=notes)


if __name__ == "__main__":
    sys.exit(main())
