"""apex-transformer's fused scale-mask softmax against PyTorch, eager and compiled, in one process.

For each masking (causal, padding) and shape ``[b * np, sq, sk]`` (np = 12 heads, sq = sk), three
implementations are timed on the same bfloat16 data, forward and backward separately:

- ours: ``torch.ops.apex_transformer.scaled_softmax_forward`` and ``scaled_softmax_backward``
  (what the functional API and its autograd call);
- eager: ``torch.softmax(x.float() * scale + mask, -1).to(bfloat16)`` as Megatron's PyTorch path
  computes it, ``mask`` an additive float32 mask (-inf above the diagonal for causal, broadcast
  over batches and heads; -10000 where the bool padding mask is set, [b, 1, sq, sk]); its backward
  is ``torch.autograd.grad`` of that expression;
- compiled: the same expression under ``torch.compile`` (forward, and its compiled backward
  through ``torch.autograd.grad``).

    python packages/apex-transformer/benchmarks/bench_softmax.py [--out DIR] [--samples N] [--quick]

Bytes model (per element, bfloat16): forward 4 (read x, write y; the causal mask is not read, and
a causal row's upper half is not read either, so its figure can exceed the copy rate), backward 6
(read y and dy, write dx); a padding mask adds its own bytes (one per element of [b, 1, sq, sk]).
GB/s and % of copy are ours, against a device-to-device copy measured in the same run. Times
are medians of CUDA-event samples (apex.core.benchmarking.time_ms) over enough copies of the
data to outgrow L2.

Bars (per row and pass): ours >= 1.5x eager, ours at least as fast as compiled, ours >= 80% of
the copy bandwidth.
"""

from __future__ import annotations

import sys

import torch

from apex.core.benchmarking import (
    against_torch,
    bench_arguments,
    copies_for_l2,
    copy_bandwidth_gbps,
    markdown_table,
    report,
    require_cuda,
    require_kernels,
    time_ms,
)

SHAPES = [(96, 1024), (48, 2048), (24, 4096), (12, 8192)]  # (b * np, sq = sk)
HEADS = 12
DTYPE = torch.bfloat16
SCALE = 0.125
BARS = {"eager": 1.5, "compiled": 1.0, "copy": 0.80}
BYTES_PER_ELEMENT = {"fwd": 4, "bwd": 6}


def torch_softmax(x, additive_mask):
    return torch.softmax(x.float() * SCALE + additive_mask, -1).to(x.dtype)


_compiled_softmax = torch.compile(torch_softmax, dynamic=False)
torch._dynamo.config.recompile_limit = 64  # a forward and a requires-grad graph per case


def make_case(batch_heads: int, s: int, masking: str, copies: int):
    """Per data copy: x, dy, our mask (None or bool), the additive float32 mask, ours y."""
    b = batch_heads // HEADS
    data = []
    for _ in range(copies):
        x = torch.randn(b, HEADS, s, s, device="cuda").mul_(3).to(DTYPE)
        dy = torch.randn_like(x)
        if masking == "causal":
            mask = None
            additive = torch.full((s, s), float("-inf"), device="cuda").triu_(1)
        else:
            lengths = torch.randint(s // 2, s + 1, (b,), device="cuda")
            mask = (torch.arange(s, device="cuda") >= lengths.view(b, 1, 1, 1)).expand(b, 1, s, s).contiguous()
            additive = torch.zeros(b, 1, s, s, device="cuda").masked_fill_(mask, -10000.0)
        data.append((x, dy, mask, additive))
    return data


def ours_forward(x, mask, causal):
    return torch.ops.apex_transformer.scaled_softmax_forward(x, mask, SCALE, causal)


def time_case(batch_heads, s, masking, samples):
    causal = masking == "causal"
    # One compiled graph set per case: the shapes and requires_grad differ from case to case, and
    # past dynamo's recompile limit (8) the compiled function silently runs eagerly.
    torch._dynamo.reset()
    elements = batch_heads * s * s
    copies = copies_for_l2(elements * 2 * 3)
    data = make_case(batch_heads, s, masking, copies)
    mask_bytes = 0 if causal else data[0][2].numel()
    results = {}
    # forward
    fwd = {
        "ours": [lambda d=d: ours_forward(d[0], d[2], causal) for d in data],
        "eager": [lambda d=d: torch_softmax(d[0], d[3]) for d in data],
        "compiled": [lambda d=d: _compiled_softmax(d[0], d[3]) for d in data],
    }
    results["fwd"] = {name: time_ms(calls, samples) for name, calls in fwd.items()}
    # backward: ours from its own forward output; PyTorch's through autograd of its graphs
    bwd_calls = {"ours": [], "eager": [], "compiled": []}
    keep = []
    for x, dy, mask, additive in data:
        y = ours_forward(x, mask, causal)
        bwd_calls["ours"].append(
            lambda y=y, dy=dy: torch.ops.apex_transformer.scaled_softmax_backward(dy, y, SCALE, causal)
        )
        for name, fn in (("eager", torch_softmax), ("compiled", _compiled_softmax)):
            xr = x.detach().requires_grad_()
            out = fn(xr, additive)
            keep.append(out)
            bwd_calls[name].append(lambda out=out, xr=xr, dy=dy: torch.autograd.grad(out, xr, dy, retain_graph=True))
    results["bwd"] = {name: time_ms(calls, samples) for name, calls in bwd_calls.items()}
    del keep
    return results, elements, mask_bytes


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_softmax", __doc__)
    parser.add_argument("--quick", action="store_true", help="the first two shapes only")
    args, _ = parser.parse_known_args(argv)
    if not require_cuda("bench_softmax.py"):
        return 1
    import apex.transformer._softmax_ops  # noqa: F401  (defines the ops)

    require_kernels("transformer")

    copy = copy_bandwidth_gbps(args.samples)
    header = [
        "masking",
        "pass",
        "[b*np, sq, sk]",
        "ours ms",
        "eager ms",
        "compiled ms",
        "eager/ours",
        "compiled/ours",
        "GB/s",
        "% of copy",
    ]
    rows, verdicts = [], []
    shapes = SHAPES[:2] if args.quick else SHAPES
    for masking in ("causal", "padding"):
        for batch_heads, s in shapes:
            results, elements, mask_bytes = time_case(batch_heads, s, masking, args.samples)
            for pass_ in ("fwd", "bwd"):
                t = results[pass_]
                bytes_moved = BYTES_PER_ELEMENT[pass_] * elements + (mask_bytes if pass_ == "fwd" else 0)
                shape = f"[{batch_heads}, {s}, {s}]"
                cells, case_verdicts = against_torch(f"{masking} {pass_} {shape}", t, bytes_moved, copy, BARS)
                rows.append([masking, pass_, shape, *cells])
                verdicts += case_verdicts
            torch.cuda.empty_cache()
    failed = sum(v.startswith("FAIL") for v in verdicts)
    body = [*markdown_table(header, rows), "", *verdicts, "", f"{len(verdicts) - failed} PASS, {failed} FAIL"]
    report(
        "bench_softmax",
        body,
        out=args.out,
        copy_gbps=copy,
        notes=[
            "bfloat16, scale 0.125, np = 12 heads; causal: sq == sk, no mask read; padding: bool mask [b, 1, sq, sk]",
            "bytes: fwd 4 B/element (+1 B/mask element for padding), bwd 6 B/element",
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
