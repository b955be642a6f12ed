"""apex-transformer's fused rotary embeddings against Megatron's unfused PyTorch expression, eager
and under torch.compile, in one process (CUDA only).

    python packages/apex-transformer/benchmarks/bench_rope.py [--out DIR] [--samples N]

Cases (bfloat16, the bars of issue 19): ``[s, b, h, d] = (4096, 8, 32, 128)`` with ``d2 = 128``
and ``d2 = 64``, and the packed layout ``[t, h, d] = (32768, 32, 128)`` of eight uneven sequences
(one of length 1, one empty) with ``d2 = 128``. For each, forward and backward:

- ours: ``fused_apply_rotary_pos_emb`` / ``_thd`` (the backward: ``torch.autograd.grad`` through it);
- eager: Megatron's unfused rotate-half path in the input dtype,
  ``cat((x * cos(f).to(dt) + rotate_half(x) * sin(f).to(dt), x_pass), -1)``; for thd the angles
  of each token gathered by position from ``cos(f)``/``sin(f)`` on the device (Megatron loops
  over the sequences on the host instead, which is slower; the positions themselves are computed
  once, outside the timing);
- compiled: the same function under ``torch.compile``, its backward the compiled one.

Times are medians of CUDA-event samples of back-to-back calls (apex.core.benchmarking.time_ms).
Bytes model (bfloat16): 4 bytes per element (read the input or the gradient, write the result)
plus the angle table (float32 ``freqs``). Bars, each row: ours >= 2x eager, ours at least as fast
as compiled, ours >= 80% of the device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import sys

import torch

from apex.core.benchmarking import (
    against_torch,
    bench_arguments,
    copy_bandwidth_gbps,
    markdown_table,
    report,
    require_cuda,
    require_kernels,
    time_ms,
)

DTYPE = torch.bfloat16
SBHD = (4096, 8, 32, 128)
THD_LENGTHS = [5000, 3000, 1, 0, 8192, 4500, 7000, 5075]  # 32768 tokens
THD_HEADS, THD_DIM = 32, 128
BARS = {"eager": 2.0, "compiled": 1.0, "copy": 0.8}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def megatron_rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Megatron-Core's unfused bshd/sbhd path (non-interleaved, mscale 1)."""
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos_ = torch.cos(freqs).to(t.dtype)
    sin_ = torch.sin(freqs).to(t.dtype)
    t_rot = (t_rot * cos_) + (rotate_half(t_rot) * sin_)
    return torch.cat((t_rot, t_pass), dim=-1)


def megatron_rope_packed(t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The same per token of packed sequences: each token's angles gathered by its position."""
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos_ = torch.cos(freqs).to(t.dtype)[positions, 0]  # [t, 1, d2]
    sin_ = torch.sin(freqs).to(t.dtype)[positions, 0]
    t_rot = (t_rot * cos_) + (rotate_half(t_rot) * sin_)
    return torch.cat((t_rot, t_pass), dim=-1)


def megatron_freqs(positions: int, d2: int) -> torch.Tensor:
    inv = 1.0 / 10000 ** (torch.arange(0, d2, 2, device="cuda", dtype=torch.float32) / d2)
    angles = torch.arange(positions, device="cuda", dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat((angles, angles), dim=-1).reshape(positions, 1, 1, d2)


def cases():
    """(name, input, ours(x), eager(x), freqs) per case."""
    from apex.transformer.functional import fused_rope

    s, b, h, d = SBHD
    x = torch.randn(s, b, h, d, device="cuda", dtype=DTYPE)
    for d2 in (128, 64):
        f = megatron_freqs(s, d2)
        yield (
            f"sbhd {s}x{b}x{h}x{d} d2={d2}",
            x,
            lambda t, f=f: fused_rope.fused_apply_rotary_pos_emb(t, f),
            lambda t, f=f: megatron_rope(t, f),
            f,
        )
    lengths = torch.tensor(THD_LENGTHS)
    tokens = int(lengths.sum())
    cu = torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0))).to(torch.int32).cuda()
    positions = torch.cat([torch.arange(n) for n in THD_LENGTHS]).cuda()
    f = megatron_freqs(max(THD_LENGTHS), THD_DIM)
    packed = torch.randn(tokens, THD_HEADS, THD_DIM, device="cuda", dtype=DTYPE)
    yield (
        f"thd {tokens}x{THD_HEADS}x{THD_DIM} d2={THD_DIM} ({len(THD_LENGTHS)} seqs)",
        packed,
        lambda t: fused_rope.fused_apply_rotary_pos_emb_thd(t, cu, f),
        lambda t: megatron_rope_packed(t, f, positions),
        f,
    )


def backward_call(fn, x: torch.Tensor, grad: torch.Tensor):
    leaf = x.detach().requires_grad_()
    out = fn(leaf)
    return lambda: torch.autograd.grad(out, leaf, grad, retain_graph=True)


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_rope", __doc__)
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not require_cuda("bench_rope.py"):
        return 1
    import apex.transformer._rope_ops  # noqa: F401  (registers the ops)

    require_kernels("transformer")
    copy_gbps = copy_bandwidth_gbps(args.samples)
    header = ["case", "pass", "ours ms", "eager ms", "compiled ms", "eager/ours", "compiled/ours", "GB/s", "% of copy"]
    rows, verdicts = [], []
    for name, x, ours, eager, freqs in cases():
        compiled = torch.compile(eager)
        bytes_moved = 2 * x.numel() * x.element_size() + freqs.numel() * freqs.element_size()
        grad = torch.randn_like(x)
        # the results agree before anything is timed
        torch.testing.assert_close(ours(x), eager(x), atol=3e-2, rtol=3e-2)
        for pass_name in ("fwd", "bwd"):
            if pass_name == "fwd":
                calls = {
                    impl: (lambda fn=fn, x=x: fn(x))
                    for impl, fn in (("ours", ours), ("eager", eager), ("compiled", compiled))
                }
            else:
                calls = {
                    impl: backward_call(fn, x, grad)
                    for impl, fn in (("ours", ours), ("eager", eager), ("compiled", compiled))
                }
            ms = {impl: time_ms([call], args.samples) for impl, call in calls.items()}
            cells, case_verdicts = against_torch(f"{name} {pass_name}", ms, bytes_moved, copy_gbps, BARS)
            rows.append([name, pass_name, *cells])
            verdicts += case_verdicts
    notes = [
        "bytes model: 4 B per bf16 element (read input or gradient, write result) + the float32 freqs table",
        "eager: Megatron's unfused rotate-half expression in bf16; compiled: the same under torch.compile",
    ]
    report("bench_rope", [*markdown_table(header, rows), "", *verdicts], out=args.out, copy_gbps=copy_gbps, notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
