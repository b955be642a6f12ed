"""apex.contrib.focal_loss against ``torchvision.ops.sigmoid_focal_loss(..., reduction="sum")``, eager and
under torch.compile, in one process (CUDA only).

    python packages/apex-contrib-focal-loss/benchmarks/bench_focal_loss.py [--out DIR] [--samples N]

RetinaNet's shape, 120000 anchors x 91 classes, in float16 and float32 (bfloat16 is in the tests):
targets one class per anchor, 90% background (-1), the rest positives; the normaliser is the
positives' count, a one-element device tensor. torchvision gets the one-hot targets (built once,
outside the timing) and its sum is divided by the same normaliser. Where torchvision is not
installed, the same formula written here stands in for it (the report says so).

Two passes per dtype: fwd (the loss alone) and fwd+bwd (the loss and ``torch.autograd.grad`` of
the logits). Times are medians of CUDA-event samples of back-to-back calls
(apex.core.benchmarking.time_ms). Bytes model of ours, fwd+bwd: read the logits and the targets,
write the partial gradient, read it back, write the gradient. Before timing, ours and torchvision
are compared with each other and with float64 (relative differences of the loss, and of the
gradient scaled by its largest element, in the table).

Bars: fwd+bwd torchvision eager / ours >= 2 in float16 and float32, and ours matching torchvision
(loss and gradient within 1e-4 in float32, 2e-2 in float16, relative).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from apex.core.benchmarking import (
    bench_arguments,
    copy_bandwidth_gbps,
    finish,
    gb_per_s,
    require_cuda,
    require_kernels,
    time_ms,
    verdict,
)

ANCHORS, CLASSES = 120_000, 91
ALPHA, GAMMA = 0.25, 2.0
DTYPES = [torch.float16, torch.float32]
SPEEDUP_BAR = 2.0
MATCH_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2}
HEADER = [
    "dtype",
    "pass",
    "ours ms",
    "torchvision ms",
    "compiled ms",
    "torchvision/ours",
    "compiled/ours",
    "ours GB/s",
    "% of copy",
    "loss rel. diff vs f64 (ours / tv)",
    "grad diff vs f64 (ours / tv)",
]


def formula(inputs, targets, alpha, gamma):
    """torchvision.ops.sigmoid_focal_loss's formula with reduction "sum" (our writing of it)."""
    p = torch.sigmoid(inputs)
    ce = F.binary_cross_entropy_with_logits(inputs, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    loss = ce * ((1 - p_t) ** gamma)
    alpha_t = alpha * targets + (1 - alpha) * (1 - targets)
    return (alpha_t * loss).sum()


def torchvision_loss():
    """(the sum-reduced focal loss of torchvision, or the formula above where torchvision is missing; its name)."""
    try:
        from torchvision.ops import sigmoid_focal_loss
    except ImportError:
        return formula, "bench_focal_loss.formula (torchvision not installed)"

    def loss(inputs, targets, alpha, gamma):
        return sigmoid_focal_loss(inputs, targets, alpha=alpha, gamma=gamma, reduction="sum")

    return loss, "torchvision.ops.sigmoid_focal_loss"


def loss_and_grad(fn, x):
    leaf = x.detach().requires_grad_()
    loss = fn(leaf)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach().double(), grad.double()


def differences(got, expected):
    loss_diff = abs((got[0] - expected[0]) / expected[0]).item()
    grad_diff = ((got[1] - expected[1]).abs().max() / expected[1].abs().max()).item()
    return loss_diff, grad_diff


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_focal_loss", __doc__)
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not require_cuda("bench_focal_loss.py"):
        return 1
    from apex.contrib.focal_loss.focal_loss import focal_loss

    require_kernels("focal_loss")
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps(args.samples)
    reference, reference_name = torchvision_loss()
    targets = torch.randint(0, CLASSES, (ANCHORS,), device="cuda")
    targets[torch.rand(ANCHORS, device="cuda") < 0.9] = -1
    num_pos = (targets >= 0).sum().float().reshape(1)
    one_hot = (targets.unsqueeze(1) == torch.arange(CLASSES, device="cuda")).float()

    def theirs_with(targets_one_hot):
        def theirs(x):
            return reference(x, targets_one_hot, ALPHA, GAMMA) / num_pos.reshape(())

        return theirs

    def ours(x):
        return focal_loss(x, targets, num_pos, CLASSES, ALPHA, GAMMA)

    rows, verdicts = [], []
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        theirs = theirs_with(one_hot.to(dtype))  # built once, outside the timing
        compiled = torch.compile(theirs, fullgraph=True, dynamic=False)
        x = (torch.randn(ANCHORS, CLASSES, device="cuda") * 2).to(dtype)
        exact = loss_and_grad(lambda t: formula(t, one_hot.double(), ALPHA, GAMMA) / num_pos.double()[0], x.double())
        got, tv = loss_and_grad(ours, x), loss_and_grad(theirs, x)
        ours_err, tv_err = differences(got, exact), differences(tv, exact)
        # The match is against torchvision on the float32 upcast of the same logits: in float16
        # its sum over 120000 x 91 terms overflows to inf (the "tv vs f64" column shows it).
        upcast = x.float() if dtype != torch.float32 else x
        match = differences(got, loss_and_grad(theirs_with(one_hot), upcast))
        ok = max(match) <= MATCH_TOLERANCE[dtype]
        how = " on the float32 upcast" if dtype != torch.float32 else ""
        verdicts.append(
            f"{'PASS' if ok else 'FAIL'}: {name} ours matches {reference_name}{how} "
            f"(loss {match[0]:.1e}, gradient {match[1]:.1e}, bar {MATCH_TOLERANCE[dtype]:.0e})"
        )
        impls = {"ours": ours, "theirs": theirs, "compiled": compiled}
        for pass_name in ("fwd", "fwd+bwd"):
            if pass_name == "fwd":
                calls = {k: (lambda fn=fn, t=x: fn(t)) for k, fn in impls.items()}
            else:
                leaf = x.detach().requires_grad_()
                calls = {k: (lambda fn=fn, t=leaf: torch.autograd.grad(fn(t), t)) for k, fn in impls.items()}
            ms = {k: time_ms([call], args.samples) for k, call in calls.items()}
            speedup, vs_compiled = ms["theirs"] / ms["ours"], ms["compiled"] / ms["ours"]
            elements = x.numel() * x.element_size()
            bytes_moved = (2 if pass_name == "fwd" else 4) * elements + targets.numel() * targets.element_size()
            gbps = gb_per_s(bytes_moved, ms["ours"])
            rows.append(
                [
                    name,
                    pass_name,
                    f"{ms['ours']:.3f}",
                    f"{ms['theirs']:.3f}",
                    f"{ms['compiled']:.3f}",
                    f"{speedup:.2f}",
                    f"{vs_compiled:.2f}",
                    f"{gbps:.0f}",
                    f"{100 * gbps / copy_gbps:.1f}",
                    f"{ours_err[0]:.1e} / {tv_err[0]:.1e}",
                    f"{ours_err[1]:.1e} / {tv_err[1]:.1e}",
                ]
            )
            if pass_name == "fwd+bwd":
                label = f"{name} fwd+bwd: torchvision eager / ours >= {SPEEDUP_BAR}"
                verdicts.append(verdict(label, speedup, SPEEDUP_BAR))
    notes = [
        f"{ANCHORS} anchors x {CLASSES} classes, 90% background; normaliser = positives ({int(num_pos.item())})",
        f"reference: {reference_name}, reduction sum, one-hot targets in the logits' dtype; "
        "compiled: the same under torch.compile(fullgraph=True)",
        "bytes model (ours): fwd reads logits + targets, writes the partial gradient; fwd+bwd also reads it "
        "back and writes the gradient",
        "differences: |loss - float64| / |float64|, and max |grad - float64| / max |float64 grad|",
    ]
    return finish("bench_focal_loss", HEADER, rows, verdicts, out=args.out, copy_gbps=copy_gbps, notes=notes)


if __name__ == "__main__":
    sys.exit(main())
