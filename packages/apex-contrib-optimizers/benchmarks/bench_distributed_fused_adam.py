"""DistributedFusedAdam, one step on a GPT-like ~354M-parameter set on one GPU (a one-rank NCCL
group), against ``torch.optim.AdamW(fused=True)`` (CUDA only).

    python packages/apex-contrib-optimizers/benchmarks/bench_distributed_fused_adam.py [--out DIR] [--samples N]

Cases (GPU time, CUDA events, median of samples after warm-up; random data):
- ``step fp32``: ``step()`` with the reduced gradients in place: Adam on the shards (apex-optimizers'
  ``fused_adam`` kernel), the all-gather of each bucket and the copy back into the parameters,
  against torch's fused AdamW on the same parameters (``.grad`` set);
- ``step bf16 params, fp32 master``: bf16 parameters, fp32 state and masters, bf16 all-gather;
- ``step bf16 params, remainders``: ``store_param_remainders`` (this package's PyTorch op, no kernel);
- ``gradients fp32``: the backward-side work for one step: the hooks' copies of ``.grad`` into the
  buckets and the reduce-scatters (no torch counterpart: reported only).
Ratios are torch / ours (> 1: ours faster). At one rank ZeRO-2 only adds work (the bucket copies);
the bar asks the fp32 step to stay within 2x of torch's fused AdamW. GB/s counts the bytes a step
moves: Adam's 28 per parameter plus the all-gather and the copy into the parameters (16 in fp32).
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist

from apex.core.benchmarking import (
    bench_arguments,
    copy_bandwidth_gbps,
    finish,
    gb_per_s,
    require_cuda,
    time_ms,
    verdict,
)

LR = 1e-3
DEVICE = "cuda"
HEADER = ["case", "params", "ours ms", "torch AdamW(fused) ms", "torch / ours", "ours GB/s", "% of copy"]


def gpt_shapes(layers: int = 24, hidden: int = 1024, vocab: int = 50304) -> list[tuple]:
    """~354M parameters: the token embedding, then per layer qkv, projection, MLP weights and biases
    and two LayerNorms."""
    shapes: list[tuple] = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,)]
        shapes += [(4 * hidden, hidden), (4 * hidden,), (hidden, 4 * hidden), (hidden,)]
        shapes += [(hidden,)] * 4
    return shapes


def make_params(shapes, dtype=torch.float32):
    return [torch.nn.Parameter(torch.randn(s, device=DEVICE, dtype=dtype) * 0.02) for s in shapes]


def feed_gradients(optimizer, params):
    """What backward does for the optimizer: each parameter's hook takes its ``.grad``."""
    for p in reversed(params):
        p.grad = torch.randn_like(p) * 1e-3
        optimizer._post_accumulate_grad_hook(p)


def distributed_step_ms(shapes, samples, dtype=torch.float32, **options) -> float:
    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam

    params = make_params(shapes, dtype)
    optimizer = DistributedFusedAdam(params, lr=LR, weight_decay=0.01, device=DEVICE, **options)
    feed_gradients(optimizer, params)
    optimizer.grad_sync()  # the reduced gradients stay in place: every timed step reuses them
    return time_ms([optimizer.step], samples)


def gradient_path_ms(shapes, samples) -> float:
    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam

    params = make_params(shapes)
    optimizer = DistributedFusedAdam(params, lr=LR, device=DEVICE)
    grads = [torch.randn_like(p) * 1e-3 for p in params]

    def backward_side():
        optimizer.zero_grad()
        for p, g in zip(reversed(params), reversed(grads)):
            p.grad = g
            optimizer._post_accumulate_grad_hook(p)
        optimizer.grad_sync()

    return time_ms([backward_side], samples)


def torch_step_ms(shapes, samples) -> float:
    params = make_params(shapes)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return time_ms([torch.optim.AdamW(params, lr=LR, weight_decay=0.01, fused=True).step], samples)


def row(case, n, ours_ms, torch_ms, bytes_per_param, copy_gbps):
    gbps = gb_per_s(bytes_per_param * n, ours_ms)
    ratio = "" if torch_ms is None else f"{torch_ms / ours_ms:.2f}x"
    torch_cell = "" if torch_ms is None else f"{torch_ms:.3f}"
    return [
        case,
        f"{n / 1e6:.0f}M",
        f"{ours_ms:.3f}",
        torch_cell,
        ratio,
        f"{gbps:.0f}",
        f"{100 * gbps / copy_gbps:.0f}%",
    ]


def main(argv: list[str] | None = None) -> int:
    args = bench_arguments("bench_distributed_fused_adam", __doc__).parse_args(argv)
    if not require_cuda("bench_distributed_fused_adam"):
        return 1
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group(
            "nccl", init_method=f"file://{folder}/store", rank=0, world_size=1, device_id=torch.device("cuda", 0)
        )
        try:
            samples = args.samples
            copy_gbps = copy_bandwidth_gbps(samples)
            shapes = gpt_shapes()
            n = sum(torch.Size(s).numel() for s in shapes)
            torch_ms = torch_step_ms(shapes, samples)
            fp32 = distributed_step_ms(shapes, samples)
            bf16 = distributed_step_ms(shapes, samples, torch.bfloat16, param_sync_dtype=torch.bfloat16)
            remainders = distributed_step_ms(
                shapes,
                max(3, samples // 4),
                torch.bfloat16,
                param_sync_dtype=torch.bfloat16,
                store_params=False,
                store_param_remainders=True,
            )
            grads = gradient_path_ms(shapes, samples)
        finally:
            dist.destroy_process_group()
    rows = [
        row("step fp32", n, fp32, torch_ms, 28 + 16, copy_gbps),
        row("step bf16 params, fp32 master", n, bf16, torch_ms, 28 + 8, copy_gbps),
        row("step bf16 params, remainders", n, remainders, torch_ms, 24 + 8, copy_gbps),
        row("gradients fp32 (hooks + reduce-scatter)", n, grads, None, 12, copy_gbps),
    ]
    verdicts = [verdict("DistributedFusedAdam step vs torch AdamW(fused), 354M fp32, 1 GPU", torch_ms / fp32, 0.5)]
    return finish("bench_distributed_fused_adam", HEADER, rows, verdicts, out=args.out, copy_gbps=copy_gbps)


if __name__ == "__main__":
    sys.exit(main())
