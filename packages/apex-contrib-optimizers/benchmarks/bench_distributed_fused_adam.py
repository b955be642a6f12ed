"""DistributedFusedAdam, one step on a GPT-like ~354M-parameter set on one GPU (a one-rank NCCL
group), against ``torch.optim.AdamW(fused=True)`` (CUDA only).

    python packages/apex-contrib-optimizers/benchmarks/bench_distributed_fused_adam.py [--out DIR] [--samples N]

Cases (GPU time, CUDA events, median of samples after warm-up; random data):
- ``step fp32``: ``step()`` with the reduced gradients in place: Adam on the shards (apex-optimizers'
  ``fused_adam`` kernel), the all-gather of each bucket and the copy back into the parameters,
  against torch's fused AdamW on the same parameters (``.grad`` set);
- ``step bf16 params, fp32 master``: bf16 parameters, fp32 state and masters, bf16 all-gather;
- ``step bf16 params, remainders``: ``store_param_remainders`` (this package's remainder kernel);
- ``step bf16 params, scaled fp16 state``: ``with_scaled_states`` with fp16 masters and moments
  (reported only: unscaled fp32 copies per bucket, the fp32 step, new factors and the scaled writes);
- ``gradients fp32``: the backward-side work for one step: the hooks' copies of ``.grad`` into the
  buckets and the reduce-scatters (no torch counterpart: reported only).
- the shard-step ops alone on flat shards of the same sizes (chunk_size 65536), this package's CUDA
  kernels against their PyTorch references (timed in a child process with ``APEX_OPS=reference``)
  and torch's fused AdamW: ``distributed_adam`` with bf16 state, gradients and output copy (against
  AdamW(fused) on bf16 parameters, whose state is bf16 too), ``distributed_adam_with_param_remainders``
  (bf16 params + int16 remainders, fp32 moments, bf16 gradients, the output in place: against
  AdamW(fused) on fp32 parameters, the same fp32 master arithmetic), and DistributedFusedLAMB's two
  stages ``lamb_compute_update_term`` (fp32) and ``lamb_update_weights`` (fp32 p, bf16 copy).
Ratios are other / ours (> 1: ours faster). At one rank ZeRO-2 only adds work (the bucket copies);
the bar asks the fp32 step to stay within 2x of torch's fused AdamW. GB/s counts the bytes a step
moves: Adam's 28 per parameter plus the all-gather and the copy into the parameters (16 in fp32);
the ops as their docstrings in ``csrc/`` count them (16, 26, 28 and 14 bytes per element).
Bars for the ops: each kernel at least 2x faster than its reference; ``distributed_adam`` bf16 within
0.8x of torch's bf16 AdamW (it also writes the 2-byte output copy: 16 bytes against 14); the
remainder kernel at least as fast as torch's fp32 AdamW (26 bytes against 28).
"""

from __future__ import annotations

import json
import os
import subprocess
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
    require_kernels,
    time_ms,
    verdict,
)

LR = 1e-3
DEVICE = "cuda"
HEADER = ["case", "params", "ours ms", "other", "other ms", "other / ours", "ours GB/s", "% of copy"]
CHUNK = 65536
OPS_JSON_FLAG = "--time-ops-json"  # the child that times the references (APEX_OPS=reference)


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


def distributed_step_ms(shapes, samples, param_dtype=torch.float32, **options) -> float:
    """``options``: DistributedFusedAdam's keywords (``dtype`` is the optimizer state's)."""
    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam

    params = make_params(shapes, param_dtype)
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


def torch_step_ms(shapes, samples, dtype=torch.float32) -> float:
    params = make_params(shapes, dtype)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return time_ms([torch.optim.AdamW(params, lr=LR, weight_decay=0.01, fused=True).step], samples)


def row(case, n, ours_ms, other, other_ms, bytes_per_param, copy_gbps):
    gbps = gb_per_s(bytes_per_param * n, ours_ms)
    ratio = "" if other_ms is None else f"{other_ms / ours_ms:.2f}x"
    other_cell = "" if other_ms is None else f"{other_ms:.3f}"
    return [
        case,
        f"{n / 1e6:.0f}M",
        f"{ours_ms:.3f}",
        other if other_ms is not None else "",
        other_cell,
        ratio,
        f"{gbps:.0f}",
        f"{100 * gbps / copy_gbps:.0f}%",
    ]


# the ops alone ------------------------------------------------------------------------------------

OP_BYTES = {"distributed_adam": 16, "remainders": 26, "lamb_update_term": 28, "lamb_update_weights": 14}


def op_calls(shapes) -> dict:
    """One call per op on flat shards of ``shapes``' sizes (random data; state that stays finite)."""
    sizes = [torch.Size(s).numel() for s in shapes]
    ops = torch.ops.apex_contrib_optimizers

    def lists(dtype, scale=1.0, positive=False):
        out = [torch.randn(n, device=DEVICE, dtype=torch.float32) * scale for n in sizes]
        return [(t.abs() if positive else t).to(dtype) for t in out]

    noop = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    hyper = dict(lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, step=10, adam_mode=1, bias_correction=True, weight_decay=0.01)
    bf16 = torch.bfloat16
    adam = dict(params=lists(bf16, 0.02), exp_avgs=lists(bf16, 1e-3), exp_avg_sqs=lists(bf16, 1e-6, True),
                grads=lists(bf16, 1e-3), params_out=lists(bf16))  # fmt: skip
    high = lists(bf16, 0.02)
    remainders = dict(params=high, param_remainders=[torch.zeros(n, dtype=torch.int16, device=DEVICE) for n in sizes],
                      exp_avgs=lists(torch.float32, 1e-3), exp_avg_sqs=lists(torch.float32, 1e-6, True),
                      grads=lists(bf16, 1e-3), params_out=high)  # fmt: skip
    k = len(sizes)
    per = lambda value, dtype=torch.float32: torch.full((k,), value, dtype=dtype, device=DEVICE)  # noqa: E731
    term = dict(g=lists(torch.float32, 1e-3), p=lists(torch.float32, 0.02), m=lists(torch.float32, 1e-3),
                v=lists(torch.float32, 1e-6, True), u=lists(torch.float32))  # fmt: skip
    term_hyper = dict(beta1=per(0.9), beta2=per(0.999), beta3=per(0.1), bias_correction=per(1, torch.int32),
                      step=torch.tensor([10], dtype=torch.int32, device=DEVICE), epsilon=per(1e-6), moment_mode=1,
                      decay=per(0.01), global_scale=one, global_grad_norm=one, max_grad_norm=1.0)  # fmt: skip
    weights = dict(u=lists(torch.float32, 1e-3), p=lists(torch.float32, 0.02), p_copy=lists(bf16))
    weights_hyper = dict(param_norm=per(1.0), update_norm=per(2.0),
                         update_norm_offset=torch.arange(k, device=DEVICE), learning_rate=one * LR, decay=per(0.01),
                         global_grad_norm=one, use_nvlamb=False)  # fmt: skip
    return {
        "distributed_adam": lambda: ops.distributed_adam(CHUNK, noop, **adam, grad_scale=one, **hyper),
        "remainders": lambda: ops.distributed_adam_with_param_remainders(
            CHUNK, noop, **remainders, grad_scale=one, **hyper
        ),
        "lamb_update_term": lambda: ops.lamb_compute_update_term(noop, **term, **term_hyper),
        "lamb_update_weights": lambda: ops.lamb_update_weights(noop, **weights, **weights_hyper),
    }


def time_ops(shapes, samples) -> dict:
    # The distributed ops register with their module (not with apex.contrib.optimizers alone).
    from apex.contrib.optimizers import _distributed_adam_ops  # noqa: F401

    result = {}
    for name, call in op_calls(shapes).items():  # one op's data at a time
        result[name] = time_ms([call], samples)
        torch.cuda.empty_cache()
    return result


def reference_ops_ms(samples) -> dict:
    """time_ops in a child process whose ops run their PyTorch references on CUDA."""
    env = {**os.environ, "APEX_OPS": "reference"}
    command = [sys.executable, __file__, OPS_JSON_FLAG, "--samples", str(samples)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the reference timing child failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def torch_adamw_ms(shapes, samples, dtype) -> float:
    return torch_step_ms(shapes, samples, dtype)


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_distributed_fused_adam", __doc__)
    parser.add_argument(OPS_JSON_FLAG, action="store_true", help="(internal) print the ops' timings as JSON")
    args = parser.parse_args(argv)
    if not require_cuda("bench_distributed_fused_adam"):
        return 1
    torch.manual_seed(0)
    if args.time_ops_json:
        print(json.dumps(time_ops(gpt_shapes(), args.samples)))
        return 0
    require_kernels("contrib_optimizers")
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
            scaled = distributed_step_ms(
                shapes,
                max(3, samples // 4),
                torch.bfloat16,
                dtype=torch.float16,
                param_sync_dtype=torch.bfloat16,
                with_scaled_states=True,
            )
            grads = gradient_path_ms(shapes, samples)
        finally:
            dist.destroy_process_group()
    torch.cuda.empty_cache()
    ours_ops = time_ops(shapes, samples)
    reference = reference_ops_ms(max(3, samples // 4))
    torch_bf16 = torch_adamw_ms(shapes, samples, torch.bfloat16)
    adamw = "torch AdamW(fused)"
    rows = [
        row("step fp32", n, fp32, adamw, torch_ms, 28 + 16, copy_gbps),
        row("step bf16 params, fp32 master", n, bf16, adamw, torch_ms, 28 + 8, copy_gbps),
        row("step bf16 params, remainders", n, remainders, adamw, torch_ms, 24 + 8, copy_gbps),
        # scaled fp16 state: 6 bytes read and written, 3 fp32 copies written and read twice, 2 x 4 of
        # the gradient's fp32 copy, the output copy and gather (reported only: no bar, no torch twin)
        row("step bf16 params, scaled fp16 state", n, scaled, adamw, torch_ms, 12 + 24 + 24 + 8 + 8, copy_gbps),
        row("gradients fp32 (hooks + reduce-scatter)", n, grads, "", None, 12, copy_gbps),
    ]
    op_rows = {
        "distributed_adam": ("op distributed_adam, bf16 state", adamw + " bf16", torch_bf16),
        "remainders": ("op distributed_adam_with_param_remainders", adamw + " fp32", torch_ms),
        "lamb_update_term": ("op lamb_compute_update_term, fp32", None, None),
        "lamb_update_weights": ("op lamb_update_weights, fp32 p, bf16 copy", None, None),
    }
    for key, (case, other, other_ms) in op_rows.items():
        rows.append(row(case, n, ours_ops[key], "PyTorch reference", reference[key], OP_BYTES[key], copy_gbps))
        if other is not None:
            rows.append(row(case, n, ours_ops[key], other, other_ms, OP_BYTES[key], copy_gbps))
    verdicts = [verdict("DistributedFusedAdam step vs torch AdamW(fused), 354M fp32, 1 GPU", torch_ms / fp32, 0.5)]
    verdicts += [verdict(f"{op_rows[k][0]} vs its PyTorch reference", reference[k] / ours_ops[k], 2.0) for k in op_rows]
    verdicts += [
        verdict("op distributed_adam bf16 vs torch AdamW(fused) bf16", torch_bf16 / ours_ops["distributed_adam"], 0.8),
        verdict("op distributed_adam_with_param_remainders vs torch AdamW(fused) fp32",
                torch_ms / ours_ops["remainders"], 1.0),
    ]  # fmt: skip
    return finish("bench_distributed_fused_adam", HEADER, rows, verdicts, out=args.out, copy_gbps=copy_gbps)


if __name__ == "__main__":
    sys.exit(main())
