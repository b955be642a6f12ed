"""Host time per eager call of apex.normalization's Python API against F.layer_norm / F.rms_norm.

Small problems are decided by the host: dispatcher, autograd and Python wrapping around each
kernel. Two modes:

- ``--device cpu`` (default; no GPU needed): the ops' CPU kernels are replaced by trivial ones
  that only allocate the outputs, on tiny tensors (2 x 8). With ``--native``,
  csrc/norm_autograd.cpp is compiled for AutogradCPU (as the CUDA library registers it for
  AutogradCUDA) and loaded first, so that "ours" goes through the C++ autograd; without it,
  through the Python autograd.Function. The trivial kernels are Python functions called through
  the dispatcher, which costs more than the C++ kernels on CUDA: compare the two modes of "ours"
  with each other, not with PyTorch.
- ``--device cuda``: the real kernels on 1024 x 1024 bf16 (a few microseconds of device time
  each); calls back to back, one synchronize per run. ``--python-autograd`` forces the Python
  autograd.Function instead of the compiled AutogradCUDA kernels.

Best of 7 runs of 3000 calls.

    python packages/apex-normalization/benchmarks/host_overhead.py [--native]
    python packages/apex-normalization/benchmarks/host_overhead.py --device cuda [--python-autograd]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import apex.core.library
import apex.normalization._ops  # (defines the op schemas)
from apex.normalization.functional import fused_layer_norm_affine, fused_rms_norm_affine


def _forward(input, weight, bias, shape, eps, rms, memory_efficient=False, output_dtype=None):
    lead = input.shape[: input.dim() - len(shape)]
    return (
        torch.empty_like(input),
        input.new_empty(lead, dtype=torch.float32),
        input.new_empty(lead, dtype=torch.float32),
    )


def _backward(grad_output, saved, weight, bias, mean, rstd, shape, rms, memory_efficient, input_dtype, *rest):
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


def load_native_autograd(build: str) -> None:
    from torch.utils import cpp_extension

    source = Path(__file__).resolve().parents[1] / "src" / "apex" / "normalization" / "csrc" / "norm_autograd.cpp"
    cpp_extension.load(
        name="apex_norm_autograd_cpu",
        sources=[str(source)],
        extra_cflags=["-O2", "-DAPEX_NORM_AUTOGRAD_KEY=AutogradCPU"],
        build_directory=build,
        is_python_module=False,
    )
    torch.ops.load_library(str(Path(build) / "apex_norm_autograd_cpu.so"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--native", action="store_true", help="cpu: time the C++ autograd (compiled here)")
    parser.add_argument("--python-autograd", action="store_true", help="cuda: time the Python autograd.Function")
    args = parser.parse_args()
    if args.device == "cpu":
        if args.native:
            load_native_autograd(tempfile.mkdtemp(prefix="apex-norm-autograd-"))
        library = torch.library.Library("apex_normalization", "IMPL")
        library.impl("norm_forward", _forward, "CPU")
        library.impl("norm_backward", _backward, "CPU")
        rows, hidden, dtype = 2, 8, torch.float32
        autograd = "C++ (AutogradCPU build of norm_autograd.cpp)" if args.native else "Python autograd.Function"
    else:
        if args.python_autograd:
            apex.core.library._has_native_autograd = lambda *_: False
        rows, hidden, dtype = 1024, 1024, torch.bfloat16
        autograd = "Python autograd.Function" if args.python_autograd else "C++ (AutogradCUDA)"
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
    kernels = "trivial kernels" if args.device == "cpu" else "CUDA kernels, 1024x1024 bf16"
    print(f"torch {torch.__version__}; {args.device}; host us per call ({kernels}); ours with {autograd}")
    print("| call | torch us | ours us |\n|---|---|---|")
    for name, (theirs, ours) in cases.items():
        print(f"| {name} | {us_per_call(theirs):.1f} | {us_per_call(ours):.1f} |")
        with torch.no_grad():
            if "backward" not in name:
                print(f"| {name}, no grad | {us_per_call(theirs):.1f} | {us_per_call(ours):.1f} |")


if __name__ == "__main__":
    main()
