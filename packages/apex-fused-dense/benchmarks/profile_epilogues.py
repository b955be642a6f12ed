"""What each cuBLASLt epilogue is worth: apex-fused-dense's and apex-mlp's forward+backward with the
default epilogues, with some of them switched off ("-name": APEX_CUBLASLT_DISABLE; a plain GEMM and
ATen ops or apex-core's passes instead) or default-off ones switched on ("+name":
APEX_CUBLASLT_ENABLE), or the backward's weight gradients on the caller's stream instead of the side
stream ("one_stream": APEX_SIDE_STREAM=0), or the GELU_AUX_BIAS GEMM's algorithm measured in the first
calls instead of the heuristic's first ("tune": APEX_CUBLASLT_TUNE=gelu_aux), against eager PyTorch, in one
process (CUDA only). The variables are read on every call; the variants' samples are interleaved in rotating
order (apex-core's compare_ms), so a drift over the run does not fall on whichever variant came last.

    python packages/apex-fused-dense/benchmarks/profile_epilogues.py [--samples N] [--kernels]
        [--shapes 8192x1024,16384x768] [--variants default,one_stream,tune]

--shapes: tokens x hidden (the layers are hidden -> 4*hidden [-> hidden]); --variants: only these
(of each case's list; "default" is the defaults).

--kernels also prints the CUDA kernels (name, total ms over 5 steps) of ours and of eager at the
first shape, from torch.profiler: which GEMM kernels cuBLASLt picked with each epilogue.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from apex.core.benchmarking import compare_ms, environment, require_cuda
from apex.fused_dense import FusedDense, FusedDenseGeluDense

DTYPE = torch.bfloat16
SHAPES = [(8192, 1024), (8192, 4096)]
GELU_VARIANTS = ["", "-gelu_aux", "+dgelu_only", "+dgelu", "+bgradb", "-bias", "-all", "one_stream", "tune"]
DENSE_VARIANTS = ["", "-bias", "+bgradb", "-all", "one_stream"]
MLP_VARIANTS = ["", "-relu_aux", "+drelu", "+bgradb", "-relu", "-all", "one_stream"]


def step(module: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    params = list(module.parameters())
    return lambda: torch.autograd.grad(module(x), [x, *params], dy)


def settings(variant: str) -> dict[str, str | None]:
    """The environment of a variant: "" the defaults, "-a,b" those switched off, "+a,b" switched on,
    "one_stream" the side stream off, "tune" the GELU_AUX_BIAS GEMM's algorithm measured in the first calls
    (APEX_CUBLASLT_TUNE=gelu_aux) instead of the heuristic's first."""
    return {
        "APEX_CUBLASLT_DISABLE": variant[1:] if variant.startswith("-") else None,
        "APEX_CUBLASLT_ENABLE": variant[1:] if variant.startswith("+") else None,
        "APEX_SIDE_STREAM": "0" if variant == "one_stream" else None,
        "APEX_CUBLASLT_TUNE": "gelu_aux" if variant == "tune" else None,
    }


def compare(label: str, ours, eager, variants: list[str], samples: int, only: list[str] | None) -> None:
    """Prints eager's time and each variant's (those of ``only``, if given), sampled in turns."""
    variants = [v for v in variants if only is None or (v or "default") in only]
    ms = compare_ms(
        {"eager": [eager], **{v: [ours] for v in variants}},
        samples,
        settings={"eager": settings(""), **{v: settings(v) for v in variants}},
    )
    base = ms["eager"]
    print(f"== {label}: eager {base:.3f} ms")
    for v in variants:
        print(f"   {v or 'default':16s} {ms[v]:8.3f} ms  eager/ours {base / ms[v]:.3f}")


def kernels(fn, label: str, variant: str = "") -> None:
    with environment(**settings(variant)):
        fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time_total / 1e3
    print(f"-- kernels of {label} ({variant or 'default'}), ms over 5 steps")
    for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:12]:
        print(f"   {ms:8.3f}  {name[:150]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--kernels", action="store_true")
    parser.add_argument(
        "--shapes", help=f"tokens x hidden, comma-separated (default: {','.join(f'{t}x{h}' for t, h in SHAPES)})"
    )
    parser.add_argument("--variants", help="comma-separated; 'default' for the defaults (default: all)")
    args = parser.parse_args()
    if not require_cuda("profile_epilogues"):
        return 1
    s, only = args.samples, args.variants.split(",") if args.variants else None
    shapes = [tuple(map(int, shape.split("x"))) for shape in args.shapes.split(",")] if args.shapes else SHAPES
    for tokens, hidden in shapes:
        torch.manual_seed(0)
        x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE, requires_grad=True)
        ours = FusedDenseGeluDense(hidden, 4 * hidden, hidden).to("cuda", DTYPE)
        eager = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(approximate="tanh"), nn.Linear(4 * hidden, hidden))
        eager = eager.to("cuda", DTYPE)
        dy = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE)
        label = f"FusedDenseGeluDense {tokens}x{hidden}x{4 * hidden}"
        compare(label, step(ours, x, dy), step(eager, x, dy), GELU_VARIANTS, s, only)
        if args.kernels and (tokens, hidden) == shapes[0]:
            kernels(step(ours, x, dy), "FusedDenseGeluDense")
            kernels(step(ours, x, dy), "FusedDenseGeluDense", "+dgelu_only")
            kernels(step(ours, x, dy), "FusedDenseGeluDense", "-all")
            kernels(step(eager, x, dy), "eager Linear-GELU-Linear")

        ours = FusedDense(hidden, 4 * hidden).to("cuda", DTYPE)
        eager = nn.Linear(hidden, 4 * hidden).to("cuda", DTYPE)
        dy = torch.randn(tokens, 4 * hidden, device="cuda", dtype=DTYPE)
        compare(
            f"FusedDense {tokens}x{hidden}x{4 * hidden}", step(ours, x, dy), step(eager, x, dy), DENSE_VARIANTS, s, only
        )
        if args.kernels and (tokens, hidden) == shapes[0]:
            kernels(step(ours, x, dy), "FusedDense")
            kernels(step(ours, x, dy), "FusedDense", "+bgradb")
            kernels(step(ours, x, dy), "FusedDense", "-bias")
            kernels(step(eager, x, dy), "eager Linear")
        del ours, eager, x, dy

    try:
        from apex.mlp import MLP
    except ImportError:
        return 0
    sizes, batch = [1024, 4096, 4096, 1024], 8192
    torch.manual_seed(0)
    ours = MLP(sizes).to("cuda", DTYPE)
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers += [nn.Linear(sizes[i], sizes[i + 1]), nn.ReLU()]
    eager = nn.Sequential(*layers).to("cuda", DTYPE)
    x = torch.randn(batch, sizes[0], device="cuda", dtype=DTYPE, requires_grad=True)
    dy = torch.randn(batch, sizes[-1], device="cuda", dtype=DTYPE)
    compare(f"MLP {batch} {'-'.join(map(str, sizes))}", step(ours, x, dy), step(eager, x, dy), MLP_VARIANTS, s, only)
    if args.kernels:
        kernels(step(ours, x, dy), "MLP")
        kernels(step(eager, x, dy), "eager MLP")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
