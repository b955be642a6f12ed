"""The deprecated contrib optimizers, one step on a GPT-like ~354M-parameter set, against
``torch.optim.Adam(fused=True)`` / ``SGD(fused=True)`` and apex.optimizers' FusedAdam/FusedLAMB (CUDA only).

    python packages/apex-contrib-optimizers/benchmarks/bench_optimizers.py [--out DIR] [--samples N]

Cases (GPU time per step, CUDA events, median of samples after warm-up; random data, grads set once):
- ``contrib FusedAdam fp32``: ``step()`` from ``.grad`` on fp32 parameters (runs apex-optimizers'
  Adam kernel), against torch's fused Adam and apex.optimizers.FusedAdam on the same shapes
  (weight decay 0 everywhere, so the three compute the same update);
- ``contrib FusedAdam fp16 out``: the legacy step as FP16_Optimizer calls it (fp16 gradients,
  fp32 masters, fp16 output params, a loss scale), against torch's fused Adam on fp32;
- ``contrib FusedAdam eps_inside_sqrt``: this package's ``adam`` kernel (eps under the square root),
  against the same step on its PyTorch reference (timed in a child process with ``APEX_OPS=reference``)
  and against torch's fused Adam;
- ``contrib FusedSGD fp16 out`` (momentum 0.9, legacy step) against torch's fused SGD on fp32;
- ``contrib FusedLAMB fp32`` against apex.optimizers.FusedLAMB (the same kernel underneath).
Ratios are the other / ours (> 1: ours faster). Bars: contrib FusedAdam at least as fast as torch's
fused Adam and within 5% of apex.optimizers.FusedAdam; contrib FusedLAMB within 5% of
apex.optimizers'; the eps_inside_sqrt kernel at least 2x faster than its reference and within 0.9x of
torch's fused Adam (the same 28 bytes). GB/s counts the bytes a step must move.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from apex.contrib.optimizers import FusedAdam, FusedLAMB, FusedSGD
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

LR = 1e-3
HEADER = ["case", "params", "ours ms", "other", "other ms", "other / ours", "ours GB/s", "% of copy"]
# Bytes a step must move per parameter: Adam fp32 reads p, g, m, v and writes p, m, v (28); with
# fp16 gradients and outputs it reads g (2) and writes the fp16 copy (2) besides (28 - 4 + 4); SGD with
# momentum and an fp16 copy reads g (2), master, buffer and writes them and the copy (20 - 4 + 2);
# LAMB reads p, g, m, v, writes m, v, u, then reads p, u and writes p (40).
BYTES_PER_PARAM = {"adam": 28, "adam16": 28, "sgd16": 18, "lamb": 40}


def gpt_shapes(layers: int = 24, hidden: int = 1024, vocab: int = 50304) -> list[tuple]:
    """~354M parameters: the token embedding, then per layer qkv, projection, MLP weights and biases
    and two LayerNorms."""
    shapes: list[tuple] = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,)]
        shapes += [(4 * hidden, hidden), (4 * hidden,), (hidden, 4 * hidden), (hidden,)]
        shapes += [(hidden,)] * 4
    return shapes


def make_params(shapes, dtype=torch.float32, grad_dtype=None):
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype) * 0.02)
        p.grad = torch.randn(s, device="cuda", dtype=grad_dtype or dtype) * 1e-3
        params.append(p)
    return params


def step_ms(step, samples: int) -> float:
    return time_ms([step], samples)


def row(case, n, ours_ms, other, other_ms, key, copy_gbps):
    gbps = gb_per_s(BYTES_PER_PARAM[key] * n, ours_ms)
    ratio = "" if other_ms is None else f"{other_ms / ours_ms:.2f}x"
    other_cell = "" if other_ms is None else f"{other_ms:.3f}"
    cells = [case, f"{n / 1e6:.0f}M", f"{ours_ms:.3f}", other, other_cell, ratio, f"{gbps:.0f}"]
    return [*cells, f"{100 * gbps / copy_gbps:.0f}%"]


def legacy_step_ms(optimizer_class, shapes, samples: int, **kwargs) -> float:
    """The legacy step as FP16_Optimizer calls it: fp16 gradients, fp32 masters, fp16 output params."""
    masters = make_params(shapes)
    for m in masters:
        m.grad = None
    grads = [torch.randn(s, device="cuda", dtype=torch.float16) for s in shapes]
    outputs = [torch.empty(s, device="cuda", dtype=torch.float16) for s in shapes]
    opt = optimizer_class(masters, lr=LR, **kwargs)
    return step_ms(lambda: opt.step(grads=grads, output_params=outputs, scale=128.0), samples)


INSIDE_JSON_FLAG = "--time-inside-json"  # the child that times the eps_inside_sqrt step on the reference


def inside_sqrt_ms(shapes, samples: int) -> float:
    return step_ms(FusedAdam(make_params(shapes), lr=LR, eps_inside_sqrt=True).step, samples)


def reference_inside_sqrt_ms(samples: int) -> float:
    env = {**os.environ, "APEX_OPS": "reference"}
    command = [sys.executable, __file__, INSIDE_JSON_FLAG, "--samples", str(samples)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_optimizers", __doc__)
    parser.add_argument(INSIDE_JSON_FLAG, action="store_true", help="(internal) time the eps_inside_sqrt step")
    args = parser.parse_args(argv)
    if not require_cuda("bench_optimizers"):
        return 1
    if args.time_inside_json:
        torch.manual_seed(0)
        print(json.dumps(inside_sqrt_ms(gpt_shapes(), args.samples)))
        return 0
    require_kernels("contrib_optimizers")
    from apex.optimizers import FusedAdam as ApexFusedAdam
    from apex.optimizers import FusedLAMB as ApexFusedLAMB

    torch.manual_seed(0)
    samples = args.samples
    copy_gbps = copy_bandwidth_gbps(samples)
    shapes = gpt_shapes()
    n = sum(torch.Size(s).numel() for s in shapes)

    # Adam fp32 from .grad: ours, torch fused, apex.optimizers (weight decay 0: the same update).
    ours = step_ms(FusedAdam(make_params(shapes), lr=LR).step, samples)
    torch_ms = step_ms(torch.optim.Adam(make_params(shapes), lr=LR, fused=True).step, samples)
    apex_ms = step_ms(ApexFusedAdam(make_params(shapes), lr=LR, adam_w_mode=True).step, samples)
    ours16 = legacy_step_ms(FusedAdam, shapes, samples)
    # eps inside the square root: this package's adam kernel, and its reference (fewer samples)
    inside = inside_sqrt_ms(shapes, samples)
    inside_reference = reference_inside_sqrt_ms(max(3, samples // 4))
    sgd_ms = legacy_step_ms(FusedSGD, shapes, samples, momentum=0.9)
    torch_sgd = step_ms(torch.optim.SGD(make_params(shapes), lr=LR, momentum=0.9, fused=True).step, samples)
    lamb = step_ms(FusedLAMB(make_params(shapes), lr=LR).step, samples)
    apex_lamb = step_ms(ApexFusedLAMB(make_params(shapes), lr=LR).step, samples)

    rows = [
        row("contrib FusedAdam fp32", n, ours, "torch Adam(fused)", torch_ms, "adam", copy_gbps),
        row("contrib FusedAdam fp32", n, ours, "apex.optimizers.FusedAdam", apex_ms, "adam", copy_gbps),
        row("contrib FusedAdam fp16 out", n, ours16, "torch Adam(fused) fp32", torch_ms, "adam16", copy_gbps),
        row("contrib FusedAdam eps_inside_sqrt", n, inside, "PyTorch reference", inside_reference, "adam", copy_gbps),
        row("contrib FusedAdam eps_inside_sqrt", n, inside, "torch Adam(fused)", torch_ms, "adam", copy_gbps),
        row("contrib FusedSGD fp16 out", n, sgd_ms, "torch SGD(fused) fp32", torch_sgd, "sgd16", copy_gbps),
        row("contrib FusedLAMB fp32", n, lamb, "apex.optimizers.FusedLAMB", apex_lamb, "lamb", copy_gbps),
    ]
    verdicts = [
        verdict("contrib FusedAdam vs torch Adam(fused), 354M fp32", torch_ms / ours, 1.0),
        verdict("contrib FusedAdam vs apex.optimizers.FusedAdam, 354M fp32", apex_ms / ours, 0.95),
        verdict("contrib FusedLAMB vs apex.optimizers.FusedLAMB, 354M fp32", apex_lamb / lamb, 0.95),
        verdict("adam kernel (eps_inside_sqrt) vs its PyTorch reference, 354M fp32", inside_reference / inside, 2.0),
        verdict("adam kernel (eps_inside_sqrt) vs torch Adam(fused), 354M fp32", torch_ms / inside, 0.9),
    ]
    return finish("bench_optimizers", HEADER, rows, verdicts, out=args.out, copy_gbps=copy_gbps)


if __name__ == "__main__":
    sys.exit(main())
