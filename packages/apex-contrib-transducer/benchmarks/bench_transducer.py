"""apex.contrib.transducer's joint and loss, forward + backward, against PyTorch and torchaudio (CUDA only).

    python packages/apex-contrib-transducer/benchmarks/bench_transducer.py [--out DIR] [--samples N]

Joint, (B, T, U, H) = (32, 256, 64, 512) float16, full lengths, padded output: ours
(``TransducerJoint``, then ``torch.autograd.grad`` for f and g) against PyTorch eager
(``f[:, :, None] + g[:, None]``, its autograd backward) and the same under torch.compile. Bytes
model: the output written and its gradient read (``2 * B*T*U*H * 2`` bytes) plus f, g and their
gradients. Bar (issue 21): ours >= 80% of the device copy bandwidth measured in the same run.
Also reported, without a bar: ReLU + dropout (p = 0.1) and the packed layout with random lengths.

Loss, (B, T, U, V) = (32, 256, 64, 1024) float32, full lengths: ours (``TransducerLoss``, softmax
backward fused: logits in, gradient w.r.t. the logits out) against torchaudio's
``rnnt_loss(reduction="none")`` (its log-softmax fused too), forward + backward of the summed loss.
Bars (issue 21): every loss within 1e-5 relative of torchaudio's; ours at least as fast. Bytes model
(shown, no bar): x read twice (row normalisers, then the gradient) and the gradient written.
"""

from __future__ import annotations

import sys

import torch

from apex.core.benchmarking import (
    bench_arguments,
    copy_bandwidth_gbps,
    finish,
    gb_per_s,
    nbytes,
    require_cuda,
    require_kernels,
    time_ms,
    verdict,
)

JOINT = (32, 256, 64, 512)
LOSS = (32, 256, 64, 1024)
COPY_BAR = 0.8
LOSS_RTOL_BAR = 1e-5
HEADER = ["case", "ours ms", "baseline ms", "compiled ms", "baseline/ours", "compiled/ours", "ours GB/s", "% of copy"]


def joint_cases():
    from apex.contrib.transducer import TransducerJoint

    B, T, U, H = JOINT
    f = torch.randn(B, T, H, device="cuda", dtype=torch.float16, requires_grad=True)
    g = torch.randn(B, U, H, device="cuda", dtype=torch.float16, requires_grad=True)
    full_f = torch.full((B,), T, dtype=torch.int32, device="cuda")
    full_g = torch.full((B,), U, dtype=torch.int32, device="cuda")
    rand_f = torch.randint(T // 2, T + 1, (B,), dtype=torch.int32, device="cuda")
    rand_g = torch.randint(U // 2, U + 1, (B,), dtype=torch.int32, device="cuda")
    offsets = torch.cumsum(rand_f.long() * rand_g.long(), 0)
    rows = int(offsets[-1])

    def eager(f, g):
        return f[:, :, None] + g[:, None]

    def eager_masked(f, g):
        return torch.nn.functional.dropout(torch.relu(f[:, :, None] + g[:, None]), 0.1)

    plain = TransducerJoint()
    masked = TransducerJoint(relu=True, dropout=True, dropout_prob=0.1)
    packed = TransducerJoint(pack_output=True)
    yield "joint fp16 padded", (f, g), lambda f, g: plain(f, g, full_f, full_g), eager, B * T * U * H, True
    yield (
        "joint fp16 ReLU+dropout",
        (f, g),
        lambda f, g: masked(f, g, full_f, full_g),
        eager_masked,
        B * T * U * H,
        False,
    )
    yield (
        "joint fp16 packed (random lengths)",
        (f, g),
        lambda f, g: packed(f, g, rand_f, rand_g, offsets, rows),
        eager,  # the padded PyTorch joint: what packing saves is part of the comparison
        rows * H,
        False,
    )


def forward_backward(fn, inputs):
    out = fn(*inputs)
    grad = torch.randn_like(out)

    def call():
        result = fn(*inputs)
        return torch.autograd.grad(result, inputs, grad)

    return call


def joint_row(name: str, ms: dict, bytes_moved: int, copy_gbps: float) -> tuple[list[str], float]:
    """A table row from ours/eager/compiled times; and ours' fraction of the copy bandwidth."""
    gbps = gb_per_s(bytes_moved, ms["ours"])
    row = [
        name,
        f"{ms['ours']:.3f}",
        f"{ms['eager']:.3f}",
        f"{ms['compiled']:.3f}",
        f"{ms['eager'] / ms['ours']:.2f}",
        f"{ms['compiled'] / ms['ours']:.2f}",
        f"{gbps:.0f}",
        f"{100 * gbps / copy_gbps:.0f}%",
    ]
    return row, gbps / copy_gbps


def bench_joint(samples: int, copy_gbps: float):
    rows, verdicts, compiled_of = [], [], {}
    for name, inputs, ours, eager, elements, has_bar in joint_cases():
        with torch.no_grad():
            if has_bar:
                torch.testing.assert_close(ours(*inputs), eager(*inputs))
        compiled = compiled_of.setdefault(eager, torch.compile(eager))  # one compilation per function
        impls = (("ours", ours), ("eager", eager), ("compiled", compiled))
        ms = {impl: time_ms([forward_backward(fn, inputs)], samples) for impl, fn in impls}
        # output written, its gradient read; f, g and grads
        row, fraction = joint_row(name, ms, 2 * elements * 2 + 2 * nbytes(inputs), copy_gbps)
        rows.append(row)
        if has_bar:
            verdicts.append(verdict(f"{name} fwd+bwd: fraction of copy bandwidth", fraction, COPY_BAR))
            # The forward alone (no bar): where the fwd+bwd time goes, for tuning.
            with torch.no_grad():
                fwd = {impl: time_ms([lambda fn=fn, inputs=inputs: fn(*inputs)], samples) for impl, fn in impls}
            rows.append(joint_row(f"{name} (forward only)", fwd, elements * 2 + nbytes(inputs), copy_gbps)[0])
    return rows, verdicts


def bench_loss(samples: int, copy_gbps: float):
    from apex.contrib.transducer import TransducerLoss

    B, T, U, V = LOSS
    x = torch.randn(B, T, U, V, device="cuda", requires_grad=True)
    label = torch.randint(1, V, (B, U - 1), dtype=torch.int32, device="cuda")
    f_len = torch.full((B,), T, dtype=torch.int32, device="cuda")
    y_len = torch.full((B,), U - 1, dtype=torch.int32, device="cuda")
    criterion = TransducerLoss()

    def ours():
        return criterion(x, label, f_len, y_len, 0)

    try:
        import torchaudio.functional
    except ImportError:
        return [], ["FAIL: loss bars: torchaudio is not installed, nothing to compare with"]

    def theirs():
        return torchaudio.functional.rnnt_loss(x, label, f_len, y_len, blank=0, reduction="none")

    ours_loss, theirs_loss = ours().detach(), theirs().detach()
    rel = float(((ours_loss - theirs_loss).abs() / theirs_loss.abs()).max())
    (ours_grad,) = torch.autograd.grad(ours().sum(), x)
    (theirs_grad,) = torch.autograd.grad(theirs().sum(), x)
    grad_diff = float((ours_grad - theirs_grad).abs().max())
    del ours_grad, theirs_grad

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn().sum(), x)

    ms_ours = time_ms([fwd_bwd(ours)], samples, min_calls=3)
    ms_theirs = time_ms([fwd_bwd(theirs)], samples, min_calls=3)
    gbps = gb_per_s(3 * nbytes([x]), ms_ours)
    rows = [
        [
            f"loss fp32 {B}x{T}x{U}x{V}",
            f"{ms_ours:.3f}",
            f"{ms_theirs:.3f} (torchaudio)",
            "-",
            f"{ms_theirs / ms_ours:.2f}",
            "-",
            f"{gbps:.0f}",
            f"{100 * gbps / copy_gbps:.0f}%",
        ]
    ]
    verdicts = [
        f"{'PASS' if rel <= LOSS_RTOL_BAR else 'FAIL'}: loss max relative difference to torchaudio "
        f"<= {LOSS_RTOL_BAR:g} (measured {rel:.2e}; gradient max abs difference {grad_diff:.2e})",
        verdict("loss fwd+bwd: torchaudio ms / ours ms", ms_theirs / ms_ours, 1.0),
    ]
    return rows, verdicts


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_transducer", __doc__, samples=10)
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not require_cuda("bench_transducer.py"):
        return 1
    import apex.contrib.transducer  # noqa: F401  (registers the ops)

    require_kernels("transducer")
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps(args.samples)
    joint_rows, joint_verdicts = bench_joint(args.samples, copy_gbps)
    torch.cuda.empty_cache()
    loss_rows, loss_verdicts = bench_loss(args.samples, copy_gbps)
    verdicts = joint_verdicts + loss_verdicts
    notes = [
        "joint baseline: PyTorch eager f[:, :, None] + g[:, None] (ReLU + dropout row: relu, then F.dropout); "
        "compiled: the same under torch.compile; all times forward + backward",
        "loss baseline: torchaudio.functional.rnnt_loss (fused log-softmax), forward + backward",
        "bytes model: joint 2 B per output element written + 2 B per gradient element read (+ f, g, grads); "
        "loss 3 x the logits' bytes (read twice, gradient written)",
    ]
    rows = joint_rows + loss_rows
    return finish("bench_transducer", HEADER, rows, verdicts, out=args.out, copy_gbps=copy_gbps, notes=notes)


if __name__ == "__main__":
    sys.exit(main())
