"""apex-optimizers' fused optimizer kernels against PyTorch's fused optimizers, in one process.

Workloads: a GPT-like set of ~354M fp32 parameters (bandwidth-bound), the same as bf16 params
with fp32 master weights, and a ~1M-parameter model of ~100 small tensors (launch-bound).
Ours calls ``torch.ops.apex_optimizers.*`` on pre-built lists (step incremented every call);
PyTorch's side calls ``torch.optim.<X>(fused=True).step()`` on the same shapes. Times are GPU
time per step from CUDA events (median of samples after warm-up, random data, grads set once);
GB/s counts the bytes each step must read and write (models in BYTES_PER_PARAM), against a
device-to-device copy measured in the same run.

    python packages/apex-optimizers/benchmarks/bench_optimizers.py [--out DIR] [--chunk-size N]

Timing: a sample is a run of back-to-back steps started behind a short GPU sleep, so that the
host queues work ahead; host overhead therefore shows only where it exceeds the GPU time (the
small model). The small model cycles through enough copies of its data to outgrow L2.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from apex.core.benchmarking import (
    bench_arguments,
    copies_for_l2,
    copy_bandwidth_gbps,
    gb_per_s,
    markdown_table,
    report,
    require_cuda,
    require_kernels,
    time_ms,
    verdict,
)

CHUNK_SIZE = 65536
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01

# Bytes each step must move per parameter (reads + writes), by case.
BYTES_PER_PARAM = {
    # read p, g, m, v; write p, m, v (fp32)
    "adam fp32": 28,
    # read g (2), master (4), m, v (4 + 4); write master, m, v (12), p (2)
    "adam bf16+master": 28,
    # read p, g, momentum buffer; write p, buffer (fp32)
    "sgd fp32": 20,
    # read p, g, state sum; write p, state sum (fp32)
    "adagrad fp32": 20,
    # pass 1: read p, g, m, v, write m, v, u (28); pass 2: read p, u, write p (12)
    "lamb fp32": 40,
}

BYTES_NOTE = (
    "bytes/param: adam 28 (fp32: read p,g,m,v, write p,m,v; bf16+master: read g 2, master, m, v 12, "
    "write master, m, v 12, p 2); sgd with momentum 20 (read p,g,buf, write p,buf); adagrad 20 (read p,g,sum, "
    "write p,sum); lamb 40 (read p,g,m,v, write m,v,u; then read p,u, write p)"
)


@dataclass
class Row:
    case: str
    dtype: str
    n_params: int
    ours_ms: float
    torch_ms: float | None
    torch_side: str

    @property
    def bytes_moved(self) -> int:
        return BYTES_PER_PARAM[self.case.split(": ", 1)[1]] * self.n_params

    def gbps(self) -> float:
        return gb_per_s(self.bytes_moved, self.ours_ms)

    def cells(self, copy_gbps: float) -> list[str]:
        speedup = f"{self.torch_ms / self.ours_ms:.2f}x" if self.torch_ms else "-"
        torch_ms = f"{self.torch_ms:.3f}" if self.torch_ms else "-"
        return [
            self.case,
            self.dtype,
            f"{self.n_params / 1e6:.1f}M",
            f"{self.ours_ms:.3f}",
            torch_ms,
            speedup,
            f"{self.gbps():.0f}",
            f"{100 * self.gbps() / copy_gbps:.0f}%",
            self.torch_side,
        ]


HEADER = ["case", "dtype", "params", "ours ms", "torch ms", "speedup", "ours GB/s", "% of copy", "torch side"]


def gpt_shapes(layers: int = 24, hidden: int = 1024, vocab: int = 50304) -> list[tuple]:
    """~354M parameters: token embedding, then per layer qkv, projection, MLP fc and projection
    (weights and biases) and two LayerNorms (weight and bias)."""
    shapes: list[tuple] = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,)]
        shapes += [(4 * hidden, hidden), (4 * hidden,), (hidden, 4 * hidden), (hidden,)]
        shapes += [(hidden,), (hidden,), (hidden,), (hidden,)]
    return shapes


def small_shapes() -> list[tuple]:
    """~1M parameters in 100 tensors: 50 weights of 128x150 and 50 vectors of 1,000 to 1,490."""
    return [(128, 150)] * 50 + [(1000 + 10 * i,) for i in range(50)]


def randn_list(shapes, dtype, device="cuda") -> list[torch.Tensor]:
    return [torch.randn(s, dtype=dtype, device=device) for s in shapes]


def positive_list(shapes, device="cuda") -> list[torch.Tensor]:
    """Second-moment style state: random, positive."""
    return [torch.rand(s, device=device) + 0.01 for s in shapes]


class Model:
    """One copy of a workload: params with grads set once, and our optimizer state."""

    def __init__(self, shapes, param_dtype, master: bool):
        self.params = [torch.nn.Parameter(t) for t in randn_list(shapes, param_dtype)]
        for p in self.params:
            p.grad = torch.randn_like(p) * 0.1
        self.grads = [p.grad for p in self.params]
        self.master = [p.detach().float() for p in self.params] if master else []
        self.exp_avgs = randn_list(shapes, torch.float32)
        self.exp_avg_sqs = positive_list(shapes)
        self.step = 0
        self.n_params = sum(p.numel() for p in self.params)

    def adam_lists(self) -> tuple[list[torch.Tensor], ...]:
        """The tensor lists of fused_adam and fused_lamb: params, grads, exp_avgs, exp_avg_sqs, master_params."""
        return self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.master


def ours_adam(model: Model, chunk_size: int) -> Callable[[], None]:
    lists = model.adam_lists()

    def step():
        model.step += 1
        # ..., lr, step, beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction
        torch.ops.apex_optimizers.fused_adam(chunk_size, *lists, LR, model.step, *BETAS, EPS, WEIGHT_DECAY, True, True)

    return step


def ours_sgd(model: Model, chunk_size: int) -> Callable[[], None]:
    buffers = model.exp_avgs

    def step():
        # ..., lr, weight_decay, momentum, dampening, nesterov, first_run, wd_after_momentum
        torch.ops.apex_optimizers.fused_sgd(
            chunk_size,
            model.params,
            model.grads,
            buffers,
            model.master,
            LR,
            WEIGHT_DECAY,
            0.9,
            0.0,
            False,
            False,
            False,
        )

    return step


def ours_adagrad(model: Model, chunk_size: int) -> Callable[[], None]:
    def step():
        torch.ops.apex_optimizers.fused_adagrad(
            chunk_size, model.params, model.grads, model.exp_avg_sqs, model.master, LR, 1e-10, WEIGHT_DECAY, False
        )

    return step


def ours_lamb(model: Model, chunk_size: int) -> Callable[[], None]:
    grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in model.grads]))
    lists = model.adam_lists()
    # adam_w_mode, bias_correction, grad_averaging, max_grad_norm, use_nvlamb
    options = (True, True, True, 1.0, False)

    def step():
        model.step += 1
        # ..., global_grad_norm, lr, step, beta1, beta2, eps, weight_decay, options
        torch.ops.apex_optimizers.fused_lamb(
            chunk_size, *lists, grad_norm.reshape(1), LR, model.step, *BETAS, 1e-6, WEIGHT_DECAY, *options
        )

    return step


def torch_step(optimizer: torch.optim.Optimizer, after: Callable[[], object] | None = None) -> Callable[[], None]:
    def step():
        optimizer.step()
        if after is not None:
            after()

    return step


def torch_adam(model: Model) -> Callable[[], None]:
    if not model.master:
        return torch_step(torch.optim.AdamW(model.params, LR, BETAS, EPS, WEIGHT_DECAY, fused=True))
    # bf16 params with fp32 masters: AdamW(fused) on fp32 master copies holding fp32 grads,
    # then the masters copied back into the bf16 params.
    masters = [torch.nn.Parameter(m.clone()) for m in model.master]
    for m, g in zip(masters, model.grads):
        m.grad = g.float()
    optimizer = torch.optim.AdamW(masters, LR, BETAS, EPS, WEIGHT_DECAY, fused=True)
    params = [p.detach() for p in model.params]
    return torch_step(optimizer, lambda: torch._foreach_copy_(params, [m.detach() for m in masters]))


def torch_sgd(model: Model) -> Callable[[], None]:
    return torch_step(torch.optim.SGD(model.params, LR, momentum=0.9, weight_decay=WEIGHT_DECAY, fused=True))


def torch_adagrad(model: Model) -> Callable[[], None]:
    return torch_step(native_adagrad(model.params))


def adagrad_fused_on_cuda() -> bool:
    """Whether this torch's Adagrad supports fused=True on CUDA (torch 2.11 does not)."""
    p = torch.nn.Parameter(torch.zeros(1, device="cuda"))
    p.grad = torch.ones(1, device="cuda")
    try:
        torch.optim.Adagrad([p], fused=True).step()
    except RuntimeError:
        return False
    return True


def native_adagrad(params) -> torch.optim.Optimizer:
    mode = {"fused": True} if ADAGRAD_FUSED else {"foreach": True}
    return torch.optim.Adagrad(params, LR, weight_decay=WEIGHT_DECAY, eps=1e-10, **mode)


ADAGRAD_FUSED = True

TORCH_SIDE = {
    "adam fp32": "AdamW(fused=True).step()",
    "adam bf16+master": "AdamW(fused=True) on fp32 masters (fp32 grads) + _foreach_copy_ to bf16 params",
    "sgd fp32": "SGD(momentum=0.9, fused=True).step()",
    "adagrad fp32": "Adagrad(fused=True).step()",
    "lamb fp32": "none (no PyTorch LAMB)",
}


def check_against_torch(chunk_size: int) -> None:
    """One step of ours and of PyTorch's fused optimizer from the same (fresh) state must agree."""
    shapes = small_shapes()[::10]
    for name in ("adam", "sgd", "adagrad"):
        ours = Model(shapes, torch.float32, False)
        for t in ours.exp_avgs + ours.exp_avg_sqs:
            t.zero_()  # PyTorch's optimizers start from zero state
        params = [torch.nn.Parameter(p.detach().clone()) for p in ours.params]
        for p, g in zip(params, ours.grads):
            p.grad = g.clone()
        if name == "adam":
            ours_adam(ours, chunk_size)()
            native = torch.optim.AdamW(params, LR, BETAS, EPS, WEIGHT_DECAY, fused=True)
        elif name == "sgd":
            torch.ops.apex_optimizers.fused_sgd(
                chunk_size, ours.params, ours.grads, ours.exp_avgs, [], LR, WEIGHT_DECAY, 0.9, 0.0, False, True, False
            )
            native = torch.optim.SGD(params, LR, momentum=0.9, weight_decay=WEIGHT_DECAY, fused=True)
        else:
            ours_adagrad(ours, chunk_size)()
            native = native_adagrad(params)
        native.step()
        for mine, theirs in zip(ours.params, params):
            torch.testing.assert_close(
                mine.data, theirs.data, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
            )


def bench(
    case: str, shapes, param_dtype, master: bool, samples: int, chunk_size: int, ours_factory, torch_factory
) -> Row:
    probe_bytes = sum(math.prod(s) for s in shapes) * 16
    copies = copies_for_l2(probe_bytes)
    models = [Model(shapes, param_dtype, master) for _ in range(copies)]
    ours_ms = time_ms([ours_factory(m, chunk_size) for m in models], samples)
    torch_ms = None
    if torch_factory is not None:
        torch_ms = time_ms([torch_factory(m) for m in models], samples)
    label = "bf16" if param_dtype == torch.bfloat16 else "fp32"
    row = Row(case, label, models[0].n_params, ours_ms, torch_ms, TORCH_SIDE[case.split(": ", 1)[1]])
    del models
    torch.cuda.empty_cache()
    return row


def verdicts(rows: dict[str, Row], copy_gbps: float) -> list[str]:
    def speedup(key):
        return rows[key].torch_ms / rows[key].ours_ms

    lamb = rows["gpt-354M: lamb fp32"]
    bars = [
        ("FusedAdam >= 1.10x AdamW(fused) on 354M fp32", speedup("gpt-354M: adam fp32"), 1.10),
        ("FusedAdam not slower than AdamW(fused) on 1M fp32", speedup("small-1M: adam fp32"), 1.0),
        ("FusedSGD >= 1.05x SGD(fused) on 354M fp32", speedup("gpt-354M: sgd fp32"), 1.05),
        (
            f"FusedAdagrad >= 1.05x Adagrad({'fused' if ADAGRAD_FUSED else 'foreach'}) on 354M fp32",
            speedup("gpt-354M: adagrad fp32"),
            1.05,
        ),
        ("FusedLAMB >= 75% of copy bandwidth (40 B/param) on 354M fp32", lamb.gbps() / copy_gbps, 0.75),
    ]
    lines = [verdict(name, value, bar) for name, value, bar in bars]
    lines.append(
        f"info: fused_lamb takes {lamb.ours_ms / rows['gpt-354M: adam fp32'].ours_ms:.2f}x "
        "the time of fused_adam on 354M fp32"
    )
    return lines


def grad_scale_cost(samples: int, chunk_size: int) -> list[str]:
    """What writing the unscaled gradients back costs (a step given a GradScaler's scale): one
    more store of the gradient, 4 of 32 bytes per fp32 parameter."""
    model = Model(gpt_shapes(), torch.float32, False)
    lists = model.adam_lists()
    scale = torch.ones(1, device="cuda")  # 1.0: the gradients keep their values from sample to sample
    found_inf = torch.zeros(1, device="cuda")

    def scaled():
        model.step += 1
        torch.ops.apex_optimizers.fused_adam(
            chunk_size,
            *lists,
            LR,
            model.step,
            *BETAS,
            EPS,
            WEIGHT_DECAY,
            True,
            True,
            grad_scale=scale,
            found_inf=found_inf,
        )

    plain_ms = time_ms([ours_adam(model, chunk_size)], samples)
    scaled_ms = time_ms([scaled], samples)
    return [
        "",
        f"fused_adam fp32 354M with grad_scale (writes the unscaled gradients back): {scaled_ms:.3f} ms, "
        f"without: {plain_ms:.3f} ms, {100 * (scaled_ms / plain_ms - 1):+.1f}% (bytes +{100 * 4 / 28:.1f}%)",
    ]


def chunk_sweep(samples: int, sizes: list[int]) -> list[str]:
    model = Model(gpt_shapes(), torch.float32, False)
    lines = ["", "fused_adam fp32 354M by chunk_size:"]
    for size in sizes:
        ms = time_ms([ours_adam(model, size)], samples)
        gbps = gb_per_s(BYTES_PER_PARAM["adam fp32"] * model.n_params, ms)
        lines.append(f"  chunk_size {size:>8}: {ms:.3f} ms, {gbps:.0f} GB/s")
    del model
    torch.cuda.empty_cache()
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = bench_arguments("bench_optimizers", __doc__, samples=10)
    parser.add_argument("--chunk-size", type=int, default=CHUNK_SIZE, help="chunk_size passed to our ops")
    parser.add_argument(
        "--chunk-sweep", type=str, default="", help="comma-separated chunk sizes to also time fused_adam fp32 354M with"
    )
    args = parser.parse_args(argv)
    if not require_cuda("bench_optimizers"):
        return 1
    require_kernels("optimizers")
    global ADAGRAD_FUSED
    ADAGRAD_FUSED = adagrad_fused_on_cuda()
    if not ADAGRAD_FUSED:
        TORCH_SIDE["adagrad fp32"] = "Adagrad(foreach=True).step() (this torch has no fused Adagrad on CUDA)"
    torch.manual_seed(0)
    chunk = args.chunk_size
    check_against_torch(chunk)

    copy_gbps = copy_bandwidth_gbps(args.samples)
    gpt, small = gpt_shapes(), small_shapes()
    s = args.samples
    rows: dict[str, Row] = {}
    for case, shapes, dtype, master, ours, native in [
        ("gpt-354M: adam fp32", gpt, torch.float32, False, ours_adam, torch_adam),
        ("gpt-354M: adam bf16+master", gpt, torch.bfloat16, True, ours_adam, torch_adam),
        ("gpt-354M: sgd fp32", gpt, torch.float32, False, ours_sgd, torch_sgd),
        ("gpt-354M: adagrad fp32", gpt, torch.float32, False, ours_adagrad, torch_adagrad),
        ("gpt-354M: lamb fp32", gpt, torch.float32, False, ours_lamb, None),
        ("small-1M: adam fp32", small, torch.float32, False, ours_adam, torch_adam),
        ("small-1M: sgd fp32", small, torch.float32, False, ours_sgd, torch_sgd),
        ("small-1M: adagrad fp32", small, torch.float32, False, ours_adagrad, torch_adagrad),
    ]:
        rows[case] = bench(case, shapes, dtype, master, s, chunk, ours, native)

    sweep = grad_scale_cost(s, chunk)
    sweep += chunk_sweep(s, [int(x) for x in args.chunk_sweep.split(",") if x]) if args.chunk_sweep else []
    notes = [
        f"chunk_size {chunk}; lr {LR}, betas {BETAS}, weight_decay {WEIGHT_DECAY}; speedup = torch ms / ours ms",
        BYTES_NOTE,
    ]
    table = markdown_table(HEADER, [row.cells(copy_gbps) for row in rows.values()])
    body = [*table, *sweep, "", *verdicts(rows, copy_gbps)]
    report("bench_optimizers", body, out=args.out, copy_gbps=copy_gbps, notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
