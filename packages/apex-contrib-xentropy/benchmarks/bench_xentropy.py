"""apex.contrib.xentropy's softmax cross entropy against PyTorch, eager and compiled, in one process.

For each (tokens, vocab) and label smoothing, forward + backward on the same bfloat16 logits:

- ours: ``SoftmaxCrossEntropyLoss.apply(logits, labels, s, -100, True)`` and
  ``torch.autograd.grad`` of its losses (the out-of-place backward; float32 losses);
- ours in place: the forward op and ``softmax_cross_entropy_backward_``, the gradient written over
  the logits (informational, no bar);
- eager: ``F.cross_entropy(logits.float(), labels, label_smoothing=s, reduction="none")`` (Megatron's
  PyTorch path) and ``torch.autograd.grad`` of it;
- compiled: the same expression under ``torch.compile(fullgraph=True)``, forward and its compiled
  backward.

    python packages/apex-contrib-xentropy/benchmarks/bench_xentropy.py [--out DIR] [--samples N]

Bytes model: 6 B per element (bfloat16 logits read by the forward and again by the backward, the
gradient written once); GB/s and % of copy are ours against a device-to-device copy measured in the
same run. Peak memory is the most allocated above the inputs (logits, labels, the incoming loss
gradient) during one forward + backward, in units of one bfloat16 logits tensor. Times are medians
of CUDA-event samples (apex.core.benchmarking.time_ms); the logits outgrow L2 many times over.

Bars (per shape and smoothing): ours >= 2x eager, ours at least as fast as compiled, ours >= 80%
of the copy bandwidth, ours' peak memory above the inputs <= 1.1 logits tensors.
"""

from __future__ import annotations

import sys
import time

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

SHAPES = [(16384, 128256), (8192, 50304)]  # (tokens, vocab): Llama 3, GPT-2 (padded)
SMOOTHINGS = [0.0, 0.1]
DTYPE = torch.bfloat16
IGNORE = -100  # F.cross_entropy's ignore_index; no label equals it here
BARS = {"eager": 2.0, "compiled": 1.0, "copy": 0.80, "memory": 1.1}
BYTES_PER_ELEMENT = 6


def torch_path(logits, labels, smoothing):
    return F.cross_entropy(logits.float(), labels, label_smoothing=smoothing, reduction="none")


def peak_above(fn) -> int:
    """The most bytes allocated above what was allocated before one call of ``fn``."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def memory_verdict(name: str, peak: float) -> str:
    """A PASS/FAIL line of the memory bar, which the peak meets when at most BARS["memory"]."""
    passed = peak <= BARS["memory"]
    return f"{'PASS' if passed else 'FAIL'}: {name} (measured {peak:.2f}, bar at most {BARS['memory']:.2f})"


def time_case(tokens, vocab, smoothing, samples):
    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss

    ops = torch.ops.apex_contrib_xentropy
    torch._dynamo.reset()  # one compiled graph set per case (shapes and smoothing are constants)
    compiled_path = torch.compile(torch_path, fullgraph=True, dynamic=False)

    logits = (3 * torch.randn(tokens, vocab, device="cuda")).to(DTYPE).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    grad_losses = torch.randn(tokens, device="cuda")

    def ours():
        losses = SoftmaxCrossEntropyLoss.apply(logits, labels, smoothing, IGNORE, True)
        return losses, torch.autograd.grad(losses, logits, grad_losses)[0]

    def pytorch(fn):
        def run():
            losses = fn(logits, labels, smoothing)
            return losses, torch.autograd.grad(losses, logits, grad_losses)[0]

        return run

    eager, compiled = pytorch(torch_path), pytorch(compiled_path)
    buffer = logits.detach().clone()  # ours in place: its contents drift (gradients), its cost does not

    def ours_inplace():
        _, lse = ops.softmax_cross_entropy_forward(buffer, labels, smoothing, IGNORE, True)
        ops.softmax_cross_entropy_backward_(grad_losses, buffer, lse, labels, smoothing, IGNORE)

    # The same numbers before timing anything.
    (ours_losses, ours_grad), (eager_losses, eager_grad) = ours(), eager()
    torch.testing.assert_close(ours_losses, eager_losses, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours_grad, eager_grad, rtol=2e-2, atol=1e-5)
    del ours_losses, ours_grad, eager_losses, eager_grad
    compiled()  # compile outside the timed region

    calls = {"ours": ours, "ours in place": ours_inplace, "eager": eager, "compiled": compiled}
    times = {name: time_ms([fn], samples) for name, fn in calls.items()}
    logits_bytes = logits.numel() * logits.element_size()
    peaks = {name: peak_above(calls[name]) / logits_bytes for name in ("ours", "ours in place", "eager", "compiled")}
    return times, peaks


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_xentropy", __doc__, samples=10)
    args = parser.parse_args(argv)
    if not require_cuda("bench_xentropy.py"):
        return 1
    import apex.contrib.xentropy  # noqa: F401  (defines the ops)

    require_kernels("xentropy")
    started = time.perf_counter()
    torch.manual_seed(0)
    copy = copy_bandwidth_gbps(args.samples)
    header = [
        "tokens x vocab",
        "smoothing",
        "ours ms",
        "ours in place ms",
        "eager ms",
        "compiled ms",
        "eager/ours",
        "compiled/ours",
        "GB/s",
        "% of copy",
        "peak ours / in place / eager / compiled (logits)",
    ]
    rows, verdicts = [], []
    for tokens, vocab in SHAPES:
        for smoothing in SMOOTHINGS:
            t, peak = time_case(tokens, vocab, smoothing, args.samples)
            torch.cuda.empty_cache()  # the case's tensors died with it
            gbps = gb_per_s(BYTES_PER_ELEMENT * tokens * vocab, t["ours"])
            vs_eager, vs_compiled = t["eager"] / t["ours"], t["compiled"] / t["ours"]
            shape = f"{tokens} x {vocab}"
            peaks = " / ".join(f"{peak[name]:.2f}" for name in ("ours", "ours in place", "eager", "compiled"))
            rows.append(
                [
                    shape,
                    f"{smoothing}",
                    f"{t['ours']:.3f}",
                    f"{t['ours in place']:.3f}",
                    f"{t['eager']:.3f}",
                    f"{t['compiled']:.3f}",
                    f"{vs_eager:.2f}",
                    f"{vs_compiled:.2f}",
                    f"{gbps:.0f}",
                    f"{100 * gbps / copy:.1f}",
                    peaks,
                ]
            )
            what = f"{shape} smoothing {smoothing} fwd+bwd"
            verdicts.append(verdict(f"{what}: ours vs eager (x)", vs_eager, BARS["eager"]))
            verdicts.append(verdict(f"{what}: ours vs compiled (x)", vs_compiled, BARS["compiled"]))
            verdicts.append(verdict(f"{what}: fraction of copy bandwidth", gbps / copy, BARS["copy"]))
            verdicts.append(
                memory_verdict(f"{what}: ours' peak memory above the inputs (logits tensors)", peak["ours"])
            )
    return finish(
        "bench_xentropy",
        header,
        rows,
        verdicts,
        out=args.out,
        copy_gbps=copy,
        notes=[
            "bfloat16 logits, int64 labels, float32 losses (half_to_float), random float32 loss gradient",
            f"bytes: {BYTES_PER_ELEMENT} B/element (logits read forward and backward, gradient written once)",
            f"run time {time.perf_counter() - started:.0f} s (torch.compile's compilations included)",
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
