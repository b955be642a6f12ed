"""A GPT training step (~125M parameters) with apex.amp against PyTorch's native mixed precision.

Same process, same model and data, one variant at a time:

- native fp16: ``torch.autocast(fp16)`` + ``torch.amp.GradScaler`` + ``torch.optim.AdamW(fused=True)``;
- native bf16: ``torch.autocast(bf16)`` + ``AdamW(fused=True)`` (a GradScaler, disabled: bf16 needs no scaling);
- amp O1 fp16 / bf16: ``amp.initialize(opt_level="O1")`` (autocast inside each forward);
- amp O2 fp16 / bf16: ``amp.initialize(opt_level="O2")`` (the model itself in half precision).

The amp variants use ``apex.optimizers.FusedAdam`` when apex-optimizers is installed, else
``AdamW(fused=True)``. A step is zero_grad, forward, cross-entropy, backward (through
``amp.scale_loss`` or the GradScaler) and the optimizer step; its time is the median over samples
of back-to-back steps (CUDA events). PASS when amp O2 is at least as fast as the native step of
the same dtype (within ``--tolerance``, timing noise).

    python packages/apex-amp/benchmarks/bench_amp.py [--batch 8] [--seq 1024] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from apex import amp
from apex.amp._amp_state import _amp_state
from apex.core.benchmarking import markdown_table, report, require_cuda, require_kernels, time_ms

LR, BETAS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 0.1


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(w, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, w)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2 small: 12 layers, width 768, 12 heads, vocabulary 50304, tied embeddings (~124M parameters)."""

    def __init__(self, vocab: int = 50304, context: int = 1024, layers: int = 12, width: int = 768, heads: int = 12):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def fused_adam_or_adamw(params):
    try:
        from apex.optimizers import FusedAdam
    except ImportError:
        return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=True), "AdamW(fused)"
    require_kernels("optimizers")
    return FusedAdam(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, adam_w_mode=True), "FusedAdam"


def native_variant(base, dtype, idx, targets):
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=True)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype):
            logits = model(idx)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return step, "AdamW(fused)"


def amp_variant(base, dtype, idx, targets, level):
    model = copy.deepcopy(base)
    opt, opt_name = fused_adam_or_adamw(model.parameters())
    dtype_arg = {"cast_model_type": dtype} if level == "O2" else {"autocast_dtype": dtype}
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **dtype_arg)
    # amp's options and loss scalers are process-wide (as upstream's): each variant puts back its
    # own before a step, since the variants are timed in turns.
    state = dict(vars(_amp_state))

    def step():
        vars(_amp_state).update(state)
        opt.zero_grad(set_to_none=True)
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        return loss.detach()

    stash = opt._amp_stash
    masters = "own masters" if stash.own_masters else "amp masters" if stash.amp_masters else "no masters"
    return step, f"{opt_name}, {masters}"


def measure_all(makers: dict, samples: int, steps_per_sample: int) -> dict:
    """name -> (ms per step, peak GiB, first loss, optimizer note) for every variant.

    All variants are built first, then timed in turns, one sample of each per round: a drift
    of the clock or of a neighbour's load during the run hits every variant alike (timing one
    variant after the other let it decide a 2% bar).
    """
    built, results = {}, {}
    for name, make in makers.items():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step, note = make()
        first_loss = float(step())
        time_ms([step], 1, min_calls=1, warmup=2)
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30
        built[name] = (step, note, first_loss, peak)
    per_sample: dict[str, list[float]] = {name: [] for name in built}
    for _ in range(samples):
        for name, (step, *_rest) in built.items():
            per_sample[name].append(time_ms([step], 1, min_calls=steps_per_sample, warmup=0))
    for name, (_step, note, first_loss, peak) in built.items():
        results[name] = (statistics.median(per_sample[name]), peak, first_loss, note)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=10, help="timed samples per variant (median)")
    parser.add_argument("--steps-per-sample", type=int, default=5)
    parser.add_argument("--tolerance", type=float, default=0.02, help="O2 passes if ms <= native ms * (1 + this)")
    parser.add_argument("--out", type=Path, help="also write the table to DIR/bench_amp.md")
    args = parser.parse_args(argv)
    if not require_cuda("bench_amp"):
        return 1
    require_kernels("core")

    torch.manual_seed(0)
    base = GPT(context=args.seq).cuda()
    n_params = sum(p.numel() for p in base.parameters())
    vocab = base.head.weight.shape[0]
    tokens = torch.randint(vocab, (args.batch, args.seq + 1), device="cuda")
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    bf16_ok = torch.cuda.is_bf16_supported()

    variants = []
    for dtype, dname in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
        if dtype == torch.bfloat16 and not bf16_ok:
            continue
        variants += [
            (f"native {dname}", dname, lambda d=dtype: native_variant(base, d, idx, targets)),
            (f"amp O1 {dname}", dname, lambda d=dtype: amp_variant(base, d, idx, targets, "O1")),
            (f"amp O2 {dname}", dname, lambda d=dtype: amp_variant(base, d, idx, targets, "O2")),
        ]
    measured = measure_all({name: make for name, _, make in variants}, args.samples, args.steps_per_sample)
    results = {}
    for name, dname, _ in variants:
        results[name] = (dname, *measured[name])
        print(f"{name}: {results[name][1]:.2f} ms/step", flush=True)

    tokens_per_step = args.batch * args.seq
    rows, verdicts = [], []
    for name, (dname, ms, peak, loss, note) in results.items():
        native_ms = results[f"native {dname}"][1]
        rows.append(
            [
                name,
                f"{ms:.2f}",
                f"{tokens_per_step / (ms * 1e-3):,.0f}",
                f"{native_ms / ms:.3f}x",
                f"{peak:.1f}",
                f"{loss:.3f}",
                note,
            ]
        )
        if name.startswith("amp O2"):
            ok = ms <= native_ms * (1 + args.tolerance)
            verdicts.append(ok)
            print(f"{'PASS' if ok else 'FAIL'}: {name} {ms:.2f} ms vs native {dname} {native_ms:.2f} ms")
    notes = [
        f"model: GPT, {n_params / 1e6:.1f}M parameters; batch {args.batch} x {args.seq} tokens; "
        f"median of {args.samples} samples of {args.steps_per_sample} steps",
        "variants timed in turns (one sample of each per round); speedup = native ms / this variant's ms "
        "(same dtype); peak = GiB allocated at the peak of its first steps, beyond what was allocated before",
    ]
    table = markdown_table(["variant", "ms/step", "tokens/s", "speedup", "peak GiB", "first loss", "optimizer"], rows)
    report("bench_amp", table, out=args.out, notes=notes)
    return 0 if verdicts and all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
