"""SelfMultiheadAttn (impl="fast" and "default") against torch.nn.MultiheadAttention, eager and under
torch.compile: one forward + backward (gradients of the input and every parameter) per call (CUDA only).

    python packages/apex-contrib-multihead-attn/benchmarks/bench_multihead_attn.py \
        [--out DIR] [--samples N] [--no-compile]

BERT-large and Transformer-big shapes (embed 1024, 16 heads; T x B = 128x32, 256x16, 512x16, 1024x8),
float16 and bfloat16, no mask and a key padding mask, dropout 0.1 in training (both modules). Per
row: ms of ours (fast, default), torch eager, torch compiled and ours compiled (CUDA events, median
of samples, inputs cycling through enough copies to outgrow L2); eager torch / ours and compiled
torch / ours; ours in TFLOP/s (the five GEMMs of the forward, twice that for the backward) and as
a share of a large matmul's rate measured in the same run. Bar: ours (fast) at least
EAGER_RATIO_BAR of torch's eager speed at every shape (same math; ours has no fused in/out
projection bias path and reads upstream's interleaved q/k/v layout).
"""

from __future__ import annotations

import sys

import torch

from apex.contrib.multihead_attn import SelfMultiheadAttn
from apex.core.benchmarking import bench_arguments, copies_for_l2, finish, progress, require_cuda, time_ms, verdict

EMBED, HEADS, DROPOUT = 1024, 16, 0.1
SHAPES = [(128, 32), (256, 16), (512, 16), (1024, 8)]  # (T, B)
DTYPES = [torch.float16, torch.bfloat16]
MASKS = ["none", "padding"]
EAGER_RATIO_BAR = 0.9
HEADER = [
    "T x B",
    "dtype",
    "mask",
    "ours ms",
    "ours default ms",
    "torch eager ms",
    "torch compiled ms",
    "ours compiled ms",
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


def flops(length: int, batch: int) -> float:
    """Forward + backward GEMM flops: projections (3E + E outputs) and the two attention matmuls, x3."""
    tokens = length * batch
    forward = 2 * tokens * EMBED * 4 * EMBED + 2 * 2 * batch * length * length * EMBED
    return 3 * forward


def torch_twin(ours: SelfMultiheadAttn) -> torch.nn.MultiheadAttention:
    """torch's module with our weights (its q, k, v are three [E, E] blocks, ours interleaved per head)."""
    weight = ours.out_proj_weight
    theirs = torch.nn.MultiheadAttention(EMBED, HEADS, dropout=DROPOUT, bias=True, device=weight.device)
    head_dim = EMBED // HEADS
    with torch.no_grad():
        theirs.in_proj_weight.copy_(ours.in_proj_weight.view(HEADS, 3, head_dim, EMBED).transpose(0, 1).flatten(0, 2))
        theirs.in_proj_bias.copy_(ours.in_proj_bias.view(HEADS, 3, head_dim).transpose(0, 1).flatten())
        theirs.out_proj.weight.copy_(ours.out_proj_weight)
        theirs.out_proj.bias.copy_(ours.out_proj_bias)
    return theirs.to(weight.dtype)


def measure(length, batch, dtype, mask_kind, samples, peak, compile_too):
    fast = SelfMultiheadAttn(EMBED, HEADS, dropout=DROPOUT, bias=True, impl="fast").to(device="cuda", dtype=dtype)
    default = SelfMultiheadAttn(EMBED, HEADS, dropout=DROPOUT, bias=True, impl="default").to(device="cuda", dtype=dtype)
    default.load_state_dict(fast.state_dict())
    theirs = torch_twin(fast)
    copies = copies_for_l2(length * batch * EMBED * dtype.itemsize)
    xs = [torch.randn(length, batch, EMBED, device="cuda", dtype=dtype, requires_grad=True) for _ in range(copies)]
    grad = torch.randn(length, batch, EMBED, device="cuda", dtype=dtype)
    mask = None
    if mask_kind == "padding":
        lengths = torch.randint(length // 2, length + 1, (batch,), device="cuda")
        mask = torch.arange(length, device="cuda")[None, :] >= lengths[:, None]

    def ours_step(module):
        def step(x):
            out = module(x, x, x, key_padding_mask=mask)[0]
            return torch.autograd.grad(out, [x, *module.parameters()], grad)

        return step

    def torch_step(x):
        out = theirs(x, x, x, key_padding_mask=mask, need_weights=False)[0]
        return torch.autograd.grad(out, [x, *theirs.parameters()], grad)

    def timed(fn):
        return time_ms([lambda x=x: fn(x) for x in xs], samples)

    ours_ms = timed(ours_step(fast))
    default_ms = timed(ours_step(default))
    eager_ms = timed(torch_step)
    compiled_ms = ours_compiled_ms = float("nan")
    if compile_too:
        torch._dynamo.reset()
        compiled_ms = timed(torch.compile(torch_step))
        ours_compiled_ms = timed(torch.compile(ours_step(fast)))
    tflops = flops(length, batch) / (ours_ms * 1e-3) / 1e12
    cells = [
        f"{ours_ms:.3f}",
        f"{default_ms:.3f}",
        f"{eager_ms:.3f}",
        f"{compiled_ms:.3f}",
        f"{ours_compiled_ms:.3f}",
        f"{eager_ms / ours_ms:.2f}x",
        f"{compiled_ms / ours_ms:.2f}x",
        f"{tflops:.0f}",
        f"{100 * tflops / peak:.0f}%",
    ]
    return cells, eager_ms / ours_ms


def main(argv: list[str] | None = None) -> int:
    args = bench_arguments("bench_multihead_attn", __doc__, no_compile=True).parse_args(argv)
    if not require_cuda("bench_multihead_attn"):
        return 1
    torch.manual_seed(0)
    rows, verdicts = [], []
    for dtype in DTYPES:
        peak = matmul_tflops(dtype, args.samples)
        for length, batch in SHAPES:
            for mask_kind in MASKS:
                cells, ratio = measure(length, batch, dtype, mask_kind, args.samples, peak, not args.no_compile)
                case = [f"{length}x{batch}", str(dtype).removeprefix("torch."), mask_kind]
                rows.append([*case, *cells])
                progress(rows[-1])
                verdicts.append(verdict(f"{' '.join(case)}: torch eager time / ours", ratio, EAGER_RATIO_BAR))
    notes = [f"embed {EMBED}, {HEADS} heads, dropout {DROPOUT}, training; forward + backward of input and parameters"]
    return finish("bench_multihead_attn", HEADER, rows, verdicts, out=args.out, notes=notes)


if __name__ == "__main__":
    sys.exit(main())
