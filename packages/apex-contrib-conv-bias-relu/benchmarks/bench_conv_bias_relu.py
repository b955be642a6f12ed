"""apex.contrib.conv_bias_relu.ConvBiasReLU against ``F.relu(nn.Conv2d(x))``, eager and under torch.compile
(CUDA only), on ResNet-50's convolution shapes, channels-last.

    python packages/apex-contrib-conv-bias-relu/benchmarks/bench_conv_bias_relu.py [--out DIR] [--samples N]
        [--batch 64 256] [--dtype float16 bfloat16]

Per shape, batch and dtype, forward (under no_grad) and forward+backward (gradients of x, weight and
bias): ours, eager torch and compiled torch in ms (CUDA events, median of samples, inputs cycling through
enough copies to outgrow L2), eager / ours and compiled / ours, ours in TFLOP/s (the convolutions' 2 * MACs:
one for the forward, three for forward+backward) and as a share of the dense matmul rate measured in the
same run. Ours has no kernel of its own (cuDNN's convolution and PyTorch's element-wise kernels), so the
bar is parity with eager torch: eager / ours at least EAGER_BAR everywhere. The full run compiles 2 graphs
per row (88 in all); ``--batch``/``--dtype`` split it.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from apex.contrib.conv_bias_relu import ConvBiasReLU
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

# ResNet-50 (torchvision v1.5: the stride in the 3x3): (name, C, K, H=W, kernel, stride, padding)
SHAPES = [
    ("conv1 7x7/2", 3, 64, 224, 7, 2, 3),
    ("layer1 1x1 64-64", 64, 64, 56, 1, 1, 0),
    ("layer1 3x3 64-64", 64, 64, 56, 3, 1, 1),
    ("layer1 1x1 64-256", 64, 256, 56, 1, 1, 0),
    ("layer1 1x1 256-64", 256, 64, 56, 1, 1, 0),
    ("layer2 3x3/2 128-128", 128, 128, 56, 3, 2, 1),
    ("layer2 1x1 128-512", 128, 512, 28, 1, 1, 0),
    ("layer3 3x3 256-256", 256, 256, 14, 3, 1, 1),
    ("layer3 1x1 1024-256", 1024, 256, 14, 1, 1, 0),
    ("layer4 3x3 512-512", 512, 512, 7, 3, 1, 1),
    ("layer4 1x1 512-2048", 512, 2048, 7, 1, 1, 0),
]
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
EAGER_BAR = 0.95
HEADER = [
    "shape",
    "N",
    "dtype",
    "pass",
    "ours ms",
    "eager ms",
    "compiled ms",
    "eager / ours",
    "compiled / ours",
    "ours TFLOP/s",
    "% of matmul",
]


def matmul_tflops(dtype: torch.dtype, samples: int) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    b = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    ms = time_ms([lambda: a @ b], samples, min_calls=5)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def measure(shape, batch: int, dtype: torch.dtype, samples: int, peak: float) -> tuple[list[list[str]], list[str]]:
    name, c, k, size, kernel, stride, padding = shape
    conv = torch.nn.Conv2d(c, k, kernel, stride=stride, padding=padding, device="cuda", dtype=dtype)
    conv = conv.to(memory_format=torch.channels_last)
    copies = copies_for_l2(batch * c * size * size * dtype.itemsize)
    xs = [
        torch.randn(batch, c, size, size, device="cuda", dtype=dtype)
        .to(memory_format=torch.channels_last)
        .requires_grad_()
        for _ in range(copies)
    ]
    out_size = (size + 2 * padding - kernel) // stride + 1
    grad = torch.randn(batch, k, out_size, out_size, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)

    def ours(x):
        return ConvBiasReLU(x, conv.weight, conv.bias.reshape(1, -1, 1, 1), padding, stride)

    def eager(x):
        return F.relu(conv(x))

    torch._dynamo.reset()  # one graph per shape: never past Dynamo's recompile limit into silent eager
    compiled = torch.compile(eager, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(ours(xs[0]), eager(xs[0]), rtol=2e-2, atol=2e-2)

    def forward(fn):
        def run(x):
            with torch.no_grad():
                fn(x)

        return [lambda x=x: run(x) for x in xs]

    def forward_backward(fn):
        def run(x):
            torch.autograd.grad(fn(x), [x, conv.weight, conv.bias], grad)

        return [lambda x=x: run(x) for x in xs]

    macs = batch * k * out_size * out_size * c * kernel * kernel
    rows, verdicts = [], []
    for label, timer, flops in (("fwd", forward, 2 * macs), ("fwd+bwd", forward_backward, 6 * macs)):
        ms = compare_ms({"ours": timer(ours), "eager": timer(eager), "compiled": timer(compiled)}, samples)
        ours_ms, eager_ms, compiled_ms = ms["ours"], ms["eager"], ms["compiled"]
        tflops = flops / (ours_ms * 1e-3) / 1e12
        case = [name, str(batch), str(dtype).removeprefix("torch."), label]
        rows.append(
            [
                *case,
                f"{ours_ms:.3f}",
                f"{eager_ms:.3f}",
                f"{compiled_ms:.3f}",
                f"{eager_ms / ours_ms:.2f}x",
                f"{compiled_ms / ours_ms:.2f}x",
                f"{tflops:.0f}",
                f"{100 * tflops / peak:.0f}%",
            ]
        )
        verdicts.append(verdict(f"{' '.join(case)}: eager / ours", eager_ms / ours_ms, EAGER_BAR))
    return rows, verdicts


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_conv_bias_relu", __doc__, samples=11)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="batch sizes (default 64 256)")
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES), help="dtypes")
    args = parser.parse_args(argv)
    if not require_cuda("bench_conv_bias_relu"):
        return 1
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True  # both sides: cuDNN picks its fastest algorithm per shape
    rows, verdicts, notes = [], [], ["ours: cuDNN's convolution (bias added by it) + an in-place ReLU; no kernel"]
    for dtype_name in args.dtype:
        dtype = DTYPES[dtype_name]
        peak = matmul_tflops(dtype, args.samples)
        notes.append(f"dense matmul rate, {dtype_name} 8192^3: {peak:.0f} TFLOP/s")
        for batch in args.batch:
            for shape in SHAPES:
                shape_rows, shape_verdicts = measure(shape, batch, dtype, args.samples, peak)
                rows += shape_rows
                for row in shape_rows:
                    progress(row)
                verdicts += shape_verdicts
    return finish("bench_conv_bias_relu", HEADER, rows, verdicts, out=args.out, notes=notes)


if __name__ == "__main__":
    sys.exit(main())
