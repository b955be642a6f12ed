"""Host time per eager call of apex.normalization's Python API against F.layer_norm / F.rms_norm.

Small problems are decided by the host: dispatcher, autograd and Python wrapping around each
kernel. Two modes:

- ``--device cpu`` (default; no GPU needed): the ops' CPU kernels are replaced by trivial ones
  that only allocate the outputs, on tiny tensors (2 x 8). The trivial kernels are Python
  functions called through the dispatcher, which costs more than the C++ kernels on CUDA, and
  the autograd is the Python registration (CUDA has the C++ one): compare "ours" between two
  versions of the code, not with PyTorch.
- ``--device cuda``: the real kernels on 1024 x 1024 bf16 (a few microseconds of device time
  each); calls back to back, one synchronize per run.

Best of 7 runs of 3000 calls.

    python packages/apex-normalization/benchmarks/host_overhead.py [--device cuda]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from apex.normalization.functional import fused_layer_norm_affine, fused_rms_norm_affine


def _forward(input, weight, bias, normalized_shape, eps, rms, memory_efficient=False, output_dtype=None):
    lead = input.shape[: input.dim() - len(normalized_shape)]
    return (
        torch.empty_like(input),
        input.new_empty(lead, dtype=torch.float32),
        input.new_empty(lead, dtype=torch.float32),
    )


def _backward(grad_output, saved, weight, bias, mean, rstd, *rest):
    return (
        torch.empty_like(saved),
        torch.empty_like(weight),
        saved.new_empty((0,)) if bias is None else torch.empty_like(bias),
    )


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def us_per_call(fn, calls: int = 3000, runs: int = 7) -> float:
    for _ in range(300):
        fn()
    best = float("inf")
    for _ in range(runs):
        synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.device == "cpu":
        library = torch.library.Library("apex_normalization", "IMPL")  # registrations live as long as it does
        library.impl("norm_forward", _forward, "CPU")
        library.impl("norm_backward", _backward, "CPU")
        rows, hidden, dtype = 2, 8, torch.float32
        kernels = "trivial kernels, 2x8 fp32"
    else:
        rows, hidden, dtype = 1024, 1024, torch.bfloat16
        kernels = "CUDA kernels, 1024x1024 bf16"
    x = torch.randn(rows, hidden, device=args.device, dtype=dtype, requires_grad=True)
    w = torch.ones(hidden, device=args.device, dtype=dtype, requires_grad=True)
    b = torch.zeros(hidden, device=args.device, dtype=dtype, requires_grad=True)
    dy = torch.ones_like(x)
    cases = {
        "layer norm forward": (
            lambda: F.layer_norm(x, (hidden,), w, b, 1e-5),
            lambda: fused_layer_norm_affine(x, w, b, hidden, 1e-5),
        ),
        "layer norm forward+backward": (
            lambda: torch.autograd.grad(F.layer_norm(x, (hidden,), w, b, 1e-5), (x, w, b), dy),
            lambda: torch.autograd.grad(fused_layer_norm_affine(x, w, b, hidden, 1e-5), (x, w, b), dy),
        ),
        "rms norm forward": (
            lambda: F.rms_norm(x, (hidden,), w, 1e-5),
            lambda: fused_rms_norm_affine(x, w, hidden, 1e-5),
        ),
        "rms norm forward+backward": (
            lambda: torch.autograd.grad(F.rms_norm(x, (hidden,), w, 1e-5), (x, w), dy),
            lambda: torch.autograd.grad(fused_rms_norm_affine(x, w, hidden, 1e-5), (x, w), dy),
        ),
    }
    print(f"torch {torch.__version__}; {args.device}; host us per call ({kernels})")
    print("| call | torch us | ours us |\n|---|---|---|")
    for name, (theirs, ours) in cases.items():
        print(f"| {name} | {us_per_call(theirs):.1f} | {us_per_call(ours):.1f} |")
        with torch.no_grad():
            if "backward" not in name:
                print(f"| {name}, no grad | {us_per_call(theirs):.1f} | {us_per_call(ours):.1f} |")


if __name__ == "__main__":
    main()
