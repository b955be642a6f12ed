"""apex.parallel against PyTorch on 2 GPUs (NCCL): SyncBatchNorm, and a DDP training step.

    python packages/apex-parallel/benchmarks/bench_parallel.py [--out DIR] [--samples N] [--steps N]

The script starts two processes itself (one per GPU, NCCL) and prints from rank 0.

(a) SyncBatchNorm forward + backward (input, weight and bias gradients through
``torch.autograd.grad``), ``apex.parallel.SyncBatchNorm`` against ``torch.nn.SyncBatchNorm`` on
ResNet-50 shapes, N=64 per rank, bfloat16 input, fp32 weight; NCHW and NHWC (the same
channels_last tensor for both: ours runs its channels-last kernels on it without a copy). Device
time per call with CUDA events (apex.core.benchmarking.time_ms: median over samples, data rotated
through enough copies to outgrow L2), ours and torch's alternated. Bar: torch/ours >= 1.3 on every
shape.

(b) DDP training step (forward, backward with the gradient all-reduce, fused AdamW step;
bfloat16 autocast, fp32 parameters): a ResNet-50 (bottlenecks [3, 4, 6, 3], plain BatchNorm,
channels_last, 224x224, 64 images per rank) and a GPT (12 layers, width 768, 12 heads, context
1024, vocabulary 50304, tied embeddings: 124M parameters, 8 sequences per rank).
``apex.parallel.DistributedDataParallel`` (defaults: message_size 1e7) against
``torch.nn.parallel.DistributedDataParallel`` (defaults: 25 MB buckets, except
``broadcast_buffers=False``: Apex's DDP does not re-broadcast buffers every forward, so both do the
same work). Two copies of each model, one per wrapper, stepped in alternating rounds; the time per
step is the median over rounds of CUDA-event time over ``--steps`` steps (the ranks start each round
together); the ranges show the spread over rounds. Bar: torch/ours >= 0.98.

The exit status is 0 when the benchmark ran (FAIL lines mark missed bars), nonzero on errors.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from apex.core.benchmarking import copies_for_l2, markdown_table, report, require_cuda, require_kernels, time_ms

WORLD = 2  # the bars are defined for two ranks; --world 1 times the kernels on one GPU
SYNCBN_SHAPES = [(64, 56, 56), (256, 56, 56), (128, 28, 28), (512, 28, 28), (1024, 14, 14), (2048, 7, 7)]
SYNCBN_BATCH = 64
SYNCBN_BAR = 1.3
DDP_BAR = 0.98


# (a) SyncBatchNorm -------------------------------------------------------------------------


def syncbn_case(channels: int, height: int, width: int, layout: str, samples: int) -> tuple[float, float, float]:
    """(torch ms, ours ms, max |output difference|) for one shape and layout."""
    from apex.parallel import SyncBatchNorm

    device = torch.device("cuda", torch.cuda.current_device())
    fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
    shape = (SYNCBN_BATCH, channels, height, width)
    copies = copies_for_l2(2 * math.prod(shape) * 2)
    data = [
        (
            torch.randn(shape, device=device, dtype=torch.bfloat16).contiguous(memory_format=fmt).requires_grad_(),
            torch.randn(shape, device=device, dtype=torch.bfloat16).contiguous(memory_format=fmt),
        )
        for _ in range(copies)
    ]
    theirs = nn.SyncBatchNorm(channels).to(device)
    ours = SyncBatchNorm(channels).to(device)

    def call(bn, x, dy):
        return lambda: torch.autograd.grad(bn(x), (x, bn.weight, bn.bias), dy)

    with torch.no_grad():
        diff = (theirs(data[0][0]).float() - ours(data[0][0]).float()).abs().max().item()
    torch_ms, ours_ms = [], []
    for _ in range(2):  # alternate, so clock or thermal drift hits both
        torch_ms.append(time_ms([call(theirs, x, dy) for x, dy in data], samples))
        ours_ms.append(time_ms([call(ours, x, dy) for x, dy in data], samples))
    return statistics.median(torch_ms), statistics.median(ours_ms), diff


def bench_syncbn(samples: int) -> list[str]:
    try:
        require_kernels("parallel")
    except Exception as exc:  # reported as a missed bar; part (b) still runs
        return [f"SyncBatchNorm: FAIL (apex_parallel kernels not loaded: {exc})"]
    rows, ratios = [], []
    for layout in ("NCHW", "NHWC"):
        for c, h, w in SYNCBN_SHAPES:
            torch_ms, ours_ms, diff = syncbn_case(c, h, w, layout, samples)
            ratio = torch_ms / ours_ms
            ratios.append(((layout, c, h, w), ratio))
            rows.append(
                [
                    layout,
                    f"{SYNCBN_BATCH}x{c}x{h}x{w}",
                    f"{torch_ms:.3f}",
                    f"{ours_ms:.3f}",
                    f"{ratio:.2f}",
                    f"{diff:.1e}",
                ]
            )
    header = ["layout", "shape per rank", "torch ms", "ours ms", "torch/ours", "max |y diff|"]
    lines = [
        f"## (a) SyncBatchNorm forward + backward, bf16, {dist.get_world_size()} ranks",
        "",
        *markdown_table(header, rows),
        "",
    ]
    below = [f"{layout} {c}x{h}x{w} ({r:.2f}x)" for (layout, c, h, w), r in ratios if r < SYNCBN_BAR]
    geomean = math.exp(statistics.fmean(math.log(r) for _, r in ratios))
    verdict = "PASS" if not below else "FAIL"
    lines.append(
        f"SyncBatchNorm: {verdict} (bar torch/ours >= {SYNCBN_BAR} on every shape; geomean {geomean:.2f}x, "
        f"min {min(r for _, r in ratios):.2f}x" + (f"; below: {', '.join(below)})" if below else ")")
    )
    return lines


# (b) DDP training step ---------------------------------------------------------------------


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        blocks, cin = [], 64
        for width, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(count):
                blocks.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = 4 * width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


class GPTBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 50304, context: int = 1024, width: int = 768, layers: int = 12, heads: int = 12):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def model_case(name: str, device: torch.device):
    """A model factory, one batch for this rank, and the loss."""
    gen = torch.Generator(device=device).manual_seed(1234 + dist.get_rank())
    if name == "ResNet-50":
        images = torch.randn(64, 3, 224, 224, device=device, generator=gen).contiguous(
            memory_format=torch.channels_last
        )
        labels = torch.randint(0, 1000, (64,), device=device, generator=gen)
        return (lambda: ResNet50().to(device, memory_format=torch.channels_last)), (images, labels), F.cross_entropy
    tokens = torch.randint(0, 50304, (8, 1025), device=device, generator=gen)

    def loss(logits, targets):
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return (lambda: GPT().to(device)), (tokens[:, :-1], tokens[:, 1:]), loss


def timed_steps(net, optimizer, inputs, targets, loss_fn, count: int) -> float:
    """Milliseconds per training step over ``count`` steps (CUDA events); the ranks start together."""
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net(inputs)
        loss_fn(out, targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / count


def bench_ddp(steps: int, rounds: int) -> list[str]:
    from apex.parallel import DistributedDataParallel

    device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cudnn.benchmark = True
    rows, verdicts = [], []
    for name in ("ResNet-50", "GPT-124M"):
        factory, (inputs, targets), loss_fn = model_case(name, device)
        torch.manual_seed(0)
        model_ours = factory()
        model_torch = factory()
        model_torch.load_state_dict(model_ours.state_dict())
        n_params = sum(p.numel() for p in model_ours.parameters())
        wrapped = {
            "ours": DistributedDataParallel(model_ours),
            "torch": nn.parallel.DistributedDataParallel(
                model_torch, device_ids=[device.index], broadcast_buffers=False
            ),
        }
        optimizers = {
            "ours": torch.optim.AdamW(model_ours.parameters(), lr=1e-4, fused=True),
            "torch": torch.optim.AdamW(model_torch.parameters(), lr=1e-4, fused=True),
        }

        def run(which: str, count: int, wrapped=wrapped, optimizers=optimizers, batch=(inputs, targets, loss_fn)):
            return timed_steps(wrapped[which], optimizers[which], *batch, count)

        for which in ("ours", "torch"):  # warm-up: our learning pass, torch's bucket rebuild, cudnn autotune
            run(which, 5)
        times = {"ours": [], "torch": []}
        for r in range(rounds):
            for which in ("ours", "torch") if r % 2 == 0 else ("torch", "ours"):
                times[which].append(run(which, steps))
        ours_ms, torch_ms = statistics.median(times["ours"]), statistics.median(times["torch"])
        ratio = torch_ms / ours_ms
        spread = [f"{min(times[w]):.1f}-{max(times[w]):.1f}" for w in ("torch", "ours")]
        rows.append([name, f"{n_params / 1e6:.1f}M", f"{torch_ms:.2f}", f"{ours_ms:.2f}", f"{ratio:.3f}", *spread])
        verdict = "PASS" if ratio >= DDP_BAR else "FAIL"
        verdicts.append(f"DDP {name}: {verdict} (torch/ours {ratio:.3f}, bar >= {DDP_BAR})")
        del run, wrapped, optimizers, model_ours, model_torch
        torch.cuda.empty_cache()
    header = ["model", "params", "torch ms/step", "ours ms/step", "torch/ours", "torch range", "ours range"]
    return [
        f"## (b) DDP training step, bf16 autocast, {dist.get_world_size()} ranks",
        "",
        *markdown_table(header, rows),
        "",
        *verdicts,
    ]


# Driver ------------------------------------------------------------------------------------


def worker(rank: int, args: argparse.Namespace, store: str, results) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{store}",
        rank=rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=300),
        device_id=torch.device("cuda", rank),
    )
    try:
        torch.manual_seed(rank)
        lines = []
        if "syncbn" in args.parts:
            lines += [*bench_syncbn(args.samples), ""]
        if "ddp" in args.parts:
            lines += bench_ddp(args.steps, args.rounds)
        if rank == 0:
            results.put(lines)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="also write the report to DIR/bench_parallel.md")
    parser.add_argument("--samples", type=int, default=20, help="timed samples per SyncBatchNorm measurement")
    parser.add_argument("--steps", type=int, default=5, help="training steps per DDP timing round")
    parser.add_argument("--rounds", type=int, default=20, help="DDP timing rounds per wrapper (median)")
    parser.add_argument("--parts", default="syncbn,ddp", help="comma-separated: syncbn, ddp")
    parser.add_argument("--world", type=int, default=WORLD, help="ranks, one GPU each (the bars assume 2)")
    args = parser.parse_args(argv)
    args.parts = set(args.parts.split(","))
    if not require_cuda("bench_parallel", args.world):
        return 1
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    store = os.path.join(tempfile.mkdtemp(), "store")
    mp.start_processes(worker, args=(args, store, results), nprocs=args.world, join=True, start_method="spawn")
    notes = ["ms: device time from CUDA events (median); ratios above 1 mean ours is faster"]
    report("bench_parallel", results.get(), out=args.out, notes=notes, devices=args.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
