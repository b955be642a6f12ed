"""apex.contrib.fmha's FMHAFun against padded ``scaled_dot_product_attention`` (eager and compiled),
BERT-large attention on packed random-length batches (CUDA only).

    python packages/apex-contrib-fmha/benchmarks/bench_fmha.py [--out DIR] [--samples N] [--no-compile]

Per (batch, max_s), dtype and mode: ``infer`` (forward, ``is_training=False``: our varlen path) and
``train`` (forward + backward with dropout 0.1: our flash path). Sequence lengths are uniform
in ``[max_s / 4, max_s]``; torch's side gets the same sequences already padded to ``max_s`` (its
``[batch, max_s, 3, heads, 64]`` layout, a boolean key-padding mask) and pays nothing for padding
or unpadding; ours takes the packed ``[total_tokens, 3, heads, 64]`` rows and one ``cu_seqlens``
for every call, as the layers of a training step share one (its check reads it once). Times are
ms (CUDA events, median); TFLOP/s counts only the useful (unpadded) matmul work. Bar: ours at
least as fast as padded eager SDPA at every shape.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from apex.contrib.fmha import FMHAFun, _attention
from apex.core.benchmarking import bench_arguments, copies_for_l2, finish, progress, require_cuda, time_ms, verdict

SHAPES = [(64, 128), (64, 256), (32, 384), (32, 512)]  # (batch, max_s)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
MODES = ["infer", "train"]
HEADS, HEAD_DIM, DROPOUT = 16, 64, 0.1
BAR = 1.0
HEADER = [
    "batch x max_s",
    "dtype",
    "mode",
    "our path",
    "ours ms",
    "padded eager ms",
    "padded compiled ms",
    "eager / ours",
    "compiled / ours",
    "ours TFLOP/s",
]


def padded_sdpa(padded, key_valid, dropout_p):
    q, k, v = (x.transpose(1, 2) for x in padded.unbind(2))  # [batch, heads, max_s, d]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_valid[:, None, None, :], dropout_p=dropout_p)


def make_case(batch, max_s, dtype):
    lengths = torch.randint(max_s // 4, max_s + 1, (batch,))
    cu_seqlens = torch.zeros(batch + 1, dtype=torch.int32)
    cu_seqlens[1:] = lengths.cumsum(0)
    total = int(cu_seqlens[-1])
    packed = torch.randn(total, 3, HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    key_valid = torch.arange(max_s)[None, :] < lengths[:, None]
    padded = torch.zeros(batch, max_s, 3, HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    padded[key_valid.cuda()] = packed
    return lengths, cu_seqlens.cuda(), packed, padded, key_valid.cuda()


def step(forward, inputs, grad):
    """A call that runs ``forward(inputs)`` and, with ``grad``, its backward."""

    def call():
        out = forward(inputs)
        if grad is not None:
            torch.autograd.backward(out, grad)

    return call


def measure(batch, max_s, dtype, mode, samples, compile_torch):
    # A fresh compile per case: 16 cases would pass dynamo's recompile limit on one function.
    torch._dynamo.reset()
    compiled = torch.compile(padded_sdpa, dynamic=False) if compile_torch else padded_sdpa
    lengths, cu_seqlens, packed, padded, key_valid = make_case(batch, max_s, dtype)
    train = mode == "train"
    dropout_p = DROPOUT if train else 0.0

    def ours(qkv):
        return FMHAFun.apply(qkv, cu_seqlens, DROPOUT, max_s, train, False)

    def eager(qkv):
        return padded_sdpa(qkv, key_valid, dropout_p)

    def torch_compiled(qkv):
        return compiled(qkv, key_valid, dropout_p)

    with torch.no_grad():  # the two agree on every real token before anything is timed
        reference = padded_sdpa(padded, key_valid, 0.0).transpose(1, 2)[key_valid]
        torch.testing.assert_close(
            FMHAFun.apply(packed, cu_seqlens, 0.0, max_s, False, False), reference, rtol=2e-2, atol=2e-2
        )

    copies = copies_for_l2(packed.numel() * packed.element_size())
    timings = []
    for forward, data in ((ours, packed), (eager, padded), (torch_compiled, padded)):
        inputs = [data.clone().requires_grad_(train) for _ in range(copies)]
        grad = torch.randn_like(forward(inputs[0])) if train else None
        calls = [step(forward, x, grad) for x in inputs]
        if train:
            timings.append(time_ms(calls, samples))
        else:
            with torch.no_grad():
                timings.append(time_ms(calls, samples))
    ours_ms, eager_ms, compiled_ms = timings
    flops = 4 * HEADS * HEAD_DIM * float((lengths.double() ** 2).sum()) * (3.5 if train else 1.0)
    path = _attention.plan(packed, DROPOUT, train)
    row = [
        path,
        f"{ours_ms:.3f}",
        f"{eager_ms:.3f}",
        f"{compiled_ms:.3f}",
        f"{eager_ms / ours_ms:.2f}x",
        f"{compiled_ms / ours_ms:.2f}x",
        f"{flops / (ours_ms * 1e-3) / 1e12:.0f}",
    ]
    return row, eager_ms / ours_ms


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_fmha", __doc__, no_compile=True)
    parser.add_argument(
        "--dtype", nargs="+", choices=list(DTYPES), default=["float16", "bfloat16"],
        help="dtypes (default float16 bfloat16; float32 takes the nested path for inference, the padded one "
        "for training with dropout)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not require_cuda("bench_fmha"):
        return 1
    torch.manual_seed(0)
    rows, verdicts = [], []
    for batch, max_s in SHAPES:
        for dtype in (DTYPES[name] for name in args.dtype):
            for mode in MODES:
                cells, ratio = measure(batch, max_s, dtype, mode, args.samples, not args.no_compile)
                case = [f"{batch}x{max_s}", str(dtype).removeprefix("torch."), mode]
                rows.append([*case, *cells])
                progress(rows[-1])
                verdicts.append(verdict(f"{' '.join(case)}: padded eager SDPA time / ours", ratio, BAR))
    notes = [f"heads {HEADS}, head_dim {HEAD_DIM}, lengths uniform in [max_s/4, max_s], train dropout {DROPOUT}"]
    return finish("bench_fmha", HEADER, rows, verdicts, out=args.out, notes=notes)


if __name__ == "__main__":
    sys.exit(main())
