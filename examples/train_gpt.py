"""Train a small character-level GPT with the apex packages that are installed.

The model is a few pre-norm transformer blocks (causal self-attention through
``torch.nn.functional.scaled_dot_product_attention``, a norm layer, an MLP) trained on
``examples/data/tiny_corpus.txt``. Apex pieces are used where they exist and plain PyTorch
stands in where they do not, so the script runs with apex-core alone and picks up more
fused kernels as packages are installed:

- loss: ``apex.contrib.xentropy.SoftmaxCrossEntropyLoss`` (float32 losses straight from 16-bit
  logits, no float32 copy of them) if installed, else ``F.cross_entropy`` on float32 logits;
- gradient-norm clipping: ``apex.contrib.clip_grad.clip_grad_norm_`` (apex-core's multi-tensor
  ops, no host sync) if installed, else ``torch.nn.utils.clip_grad_norm_(foreach=True)``;
- optimizer: ``apex.optimizers.FusedAdam`` if installed, else ``torch.optim.AdamW``;
- norm layer: ``apex.normalization.FusedLayerNorm`` if installed, else ``torch.nn.LayerNorm``;
- dense layers: ``apex.fused_dense.FusedDense`` (the attention projections) and
  ``FusedDenseGeluDense`` (the MLP: bias, GELU and their gradients in cuBLASLt's epilogues) if
  installed, else ``torch.nn.Linear`` and ``Linear -> GELU(tanh) -> Linear``;
- mixed precision: ``apex.amp`` at ``--opt-level`` (O2 by default on a GPU) if installed, else
  ``torch.autocast`` (``--precision``).

``--stack native`` trains the same model with PyTorch's pieces only, for comparison:
``F.cross_entropy``, ``torch.nn.utils.clip_grad_norm_(foreach=True)``, ``torch.optim.AdamW(fused=True)``,
``torch.nn.LayerNorm``, ``torch.nn.Linear`` and ``torch.autocast`` (``--precision``). ``--stack apex``
(the default) is the list above.

It prints, per apex op family, the kernel tier that ran (aot, jit or reference and why), then
the train and validation loss and throughput every ``--eval-interval`` steps, and finally a
text sample. The exit status is 0 only if the validation loss went down.

    python examples/train_gpt.py                  # CPU, or the GPU when there is one
    python examples/train_gpt.py --device cpu --steps 100 --eval-interval 25
    python examples/train_gpt.py --opt-level O2 --precision bf16   # apex.amp, bf16 model
    python examples/train_gpt.py --stack native                     # PyTorch's pieces only
    python examples/train_gpt.py --nproc 2 --steps 100              # data parallel on 2 processes

With ``--nproc N`` (N > 1) the script starts N processes (NCCL with one GPU each when there are N
GPUs, gloo on the CPU otherwise), wraps the model in ``apex.parallel.DistributedDataParallel``
(after ``convert_syncbn_model`` where the model has batch norm; this GPT has none), gives each
rank ``--batch-size / N`` of every batch, and prints from rank 0 only.

The corpus is small (24 KB): much longer or larger runs memorize it, and the validation loss
turns back up. Give ``--corpus`` a bigger text for those.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import apex.core

DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"
builtins_print = print


# Pluggable pieces --------------------------------------------------------------------------


@dataclass
class Choice:
    """One pluggable piece of the training loop: what was picked and, if apex, its kernels."""

    role: str
    name: str
    kernels: str | None = None  # the apex package whose kernels it runs (apex.core.status)
    note: str = ""


def pick_optimizer(param_groups: list[dict], lr: float, stack: str = "apex") -> tuple[torch.optim.Optimizer, Choice]:
    """FusedAdam (decoupled weight decay) when apex-optimizers is installed, else AdamW; AdamW(fused=True)
    in the native stack."""
    betas = (0.9, 0.95)
    if stack == "native":
        optimizer = torch.optim.AdamW(param_groups, lr=lr, betas=betas, fused=True)
        return optimizer, Choice("optimizer", "torch.optim.AdamW(fused=True)", note="--stack native")
    try:
        from apex.optimizers import FusedAdam
    except ImportError as exc:
        optimizer = torch.optim.AdamW(param_groups, lr=lr, betas=betas)
        return optimizer, Choice("optimizer", "torch.optim.AdamW", note=f"apex.optimizers unavailable: {exc}")
    optimizer = FusedAdam(param_groups, lr=lr, betas=betas, adam_w_mode=True)
    return optimizer, Choice("optimizer", "apex.optimizers.FusedAdam", "optimizers")


def pick_norm(stack: str = "apex") -> tuple[type[nn.Module], Choice]:
    """FusedLayerNorm when apex-normalization is installed, else torch.nn.LayerNorm (always in the
    native stack)."""
    if stack == "native":
        return nn.LayerNorm, Choice("norm", "torch.nn.LayerNorm", note="--stack native")
    try:
        from apex.normalization import FusedLayerNorm
    except ImportError as exc:
        return nn.LayerNorm, Choice("norm", "torch.nn.LayerNorm", note=f"apex.normalization unavailable: {exc}")
    return FusedLayerNorm, Choice("norm", "apex.normalization.FusedLayerNorm", "normalization")


def pick_dense(stack: str = "apex") -> tuple[type[nn.Module], type[nn.Module], Choice]:
    """``(linear, mlp)`` classes: ``linear(in, out)`` for the attention projections, ``mlp(width,
    hidden, width)`` for the MLP. apex.fused_dense's FusedDense and FusedDenseGeluDense when installed,
    else torch.nn.Linear and GeluMLP (always in the native stack); the same parameter names either way."""
    if stack == "native":
        return nn.Linear, GeluMLP, Choice("dense", "torch.nn.Linear", note="--stack native")
    try:
        from apex.fused_dense import FusedDense, FusedDenseGeluDense
    except ImportError as exc:
        return nn.Linear, GeluMLP, Choice("dense", "torch.nn.Linear", note=f"apex.fused_dense unavailable: {exc}")
    return FusedDense, FusedDenseGeluDense, Choice("dense", "apex.fused_dense.FusedDense[GeluDense]", "fused_dense")


def pick_amp(opt_level: str, precision: str, use_cuda: bool, stack: str = "apex"):
    """apex.amp and the opt level to run it at (None: plain torch.autocast), and why."""
    if stack == "native":
        return None, None, Choice("amp", "off", note="--stack native: torch.autocast per --precision")
    if opt_level == "auto" and precision == "fp32":
        return None, None, Choice("amp", "off", note="--precision fp32")
    if opt_level == "none":
        return None, None, Choice("amp", "off", note="--opt-level none: torch.autocast per --precision")
    try:
        from apex import amp
    except ImportError as exc:
        if opt_level != "auto":
            raise SystemExit(f"--opt-level {opt_level}, but apex.amp is not installed: {exc}") from exc
        return None, None, Choice("amp", "off", note=f"apex.amp unavailable: {exc}")
    if opt_level == "auto":
        if not use_cuda:
            return None, None, Choice("amp", "off", note="--opt-level auto: apex.amp on a GPU only (CPU stays fp32)")
        opt_level = "O2"
    return amp, opt_level, Choice("amp", f"apex.amp {opt_level}", "core")


def torch_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def pick_loss(stack: str = "apex"):
    """The training loss (mean over tokens of ``[batch, block, vocab]`` logits): apex.contrib.xentropy's
    SoftmaxCrossEntropyLoss when installed, else F.cross_entropy on float32 logits (always in the
    native stack)."""
    if stack == "native":
        return torch_cross_entropy, Choice("loss", "F.cross_entropy", note="--stack native")
    try:
        from apex.contrib.xentropy import SoftmaxCrossEntropyLoss
    except ImportError as exc:
        return torch_cross_entropy, Choice("loss", "F.cross_entropy", note=f"apex.contrib.xentropy unavailable: {exc}")

    def apex_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # float32 losses from the logits as they are (bf16 under amp O2); no smoothing, and no
        # padding_idx (upstream's default 0 would drop every token of character 0)
        losses = SoftmaxCrossEntropyLoss.apply(logits.flatten(0, 1), targets.flatten(), 0.0, None, True)
        return losses.mean()

    return apex_cross_entropy, Choice("loss", "apex.contrib.xentropy.SoftmaxCrossEntropyLoss", "xentropy")


def pick_clip(stack: str = "apex"):
    """``clip(parameters, max_norm) -> total norm``: apex.contrib.clip_grad's clip_grad_norm_ (the
    norm and the scale on the device, no host sync) when installed, else PyTorch's foreach one
    (always in the native stack)."""

    def torch_clip(parameters, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)

    if stack == "native":
        return torch_clip, Choice("grad clip", "torch clip_grad_norm_(foreach=True)", note="--stack native")
    try:
        from apex.contrib.clip_grad import clip_grad_norm_
    except ImportError as exc:
        note = f"apex.contrib.clip_grad unavailable: {exc}"
        return torch_clip, Choice("grad clip", "torch clip_grad_norm_(foreach=True)", note=note)
    return clip_grad_norm_, Choice("grad clip", "apex.contrib.clip_grad.clip_grad_norm_", "core")


def describe_kernels(choice: Choice, device: torch.device) -> str:
    if device.type == "cpu":
        # CPU tensors always take the PyTorch reference; the loader is only asked for CUDA.
        tier, reason = "reference", "CPU tensors use the PyTorch reference"
    else:
        status = apex.core.status(choice.kernels)
        tier, reason = status.tier, status.reason
    return f"  {choice.role:<10} {choice.name:<46} tier={tier} ({reason})"


# Model -------------------------------------------------------------------------------------


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 3
    n_head: int = 4
    n_embd: int = 128


class GeluMLP(nn.Module):
    """``Linear -> GELU(tanh) -> Linear`` with FusedDenseGeluDense's parameter names (weight1, bias1,
    weight2, bias2), so a checkpoint loads into either stack."""

    def __init__(self, width: int, hidden: int, out: int):
        super().__init__()
        self.weight1 = nn.Parameter(torch.empty(hidden, width))
        self.bias1 = nn.Parameter(torch.zeros(hidden))
        self.weight2 = nn.Parameter(torch.empty(out, hidden))
        self.bias2 = nn.Parameter(torch.zeros(out))
        for w in (self.weight1, self.weight2):
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.gelu(F.linear(x, self.weight1, self.bias1), approximate="tanh"), self.weight2, self.bias2)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, linear: type[nn.Module] = nn.Linear):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        heads = [
            t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2)
            for t in self.qkv(x).split(width, dim=2)
        ]
        y = F.scaled_dot_product_attention(*heads, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, norm: type[nn.Module], linear: type[nn.Module], mlp: type[nn.Module]):
        super().__init__()
        self.norm1 = norm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg, linear)
        self.norm2 = norm(cfg.n_embd)
        self.mlp = mlp(cfg.n_embd, 4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(
        self,
        cfg: GPTConfig,
        norm: type[nn.Module],
        linear: type[nn.Module] = nn.Linear,
        mlp: type[nn.Module] = GeluMLP,
    ):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, norm, linear, mlp) for _ in range(cfg.n_layer))
        self.norm_f = norm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied input/output embeddings
        # Matrices (embeddings, dense weights) N(0, 0.02), the dense layers' biases zero, the norms'
        # parameters as built; residual projections smaller, so the residual stream grows evenly with
        # depth. By name, the same whichever dense layers were picked.
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                residual = name.endswith(("attn.proj.weight", "mlp.weight2"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer) if residual else 0.02)
            elif ".attn." in name or ".mlp." in name:
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm_f(x))

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Decay matrices only; biases, norm weights and position embeddings are left alone."""
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            (decay if p.dim() >= 2 and "pos_emb" not in name else no_decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# Data --------------------------------------------------------------------------------------


class CharData:
    """The corpus as character ids, split 90/10 into train and validation."""

    def __init__(self, text: str, device: torch.device):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.index[c] for c in text], dtype=torch.long)
        split = int(0.9 * len(ids))
        self.splits = {"train": ids[:split].to(device), "val": ids[split:].to(device)}

    def encode(self, text: str) -> list[int]:
        return [self.index[c] for c in text if c in self.index]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def batch(self, split: str, starts: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.splits[split]
        offsets = starts.to(data.device)[:, None] + torch.arange(block_size + 1, device=data.device)
        window = data[offsets]
        return window[:, :-1], window[:, 1:]

    def random_starts(self, split: str, batch_size: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randint(len(self.splits[split]) - block_size - 1, (batch_size,), generator=gen)

    def eval_starts(self, split: str, block_size: int, max_windows: int) -> torch.Tensor:
        """Fixed, evenly spaced windows, so evaluations at different steps are comparable."""
        last = len(self.splits[split]) - block_size - 1
        count = min(max_windows, last // block_size + 1)
        return torch.linspace(0, last, count).long()


@torch.no_grad()
def evaluate(model, data: CharData, eval_windows: dict, block_size: int, batch_size: int, autocast) -> dict:
    model.eval()
    losses = {}
    for split, starts in eval_windows.items():
        total, count = 0.0, 0
        for chunk in starts.split(batch_size):
            x, y = data.batch(split, chunk, block_size)
            with autocast():
                logits = model(x)
            total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
            count += y.numel()
        losses[split] = total / count
    model.train()
    return losses


@torch.no_grad()
def sample(model, data: CharData, prompt: str, length: int, temperature: float, gen: torch.Generator, autocast):
    model.eval()
    device = next(model.parameters()).device
    ids = data.encode(prompt) or [0]
    for _ in range(length):
        context = torch.tensor([ids[-model.cfg.block_size :]], device=device)
        with autocast():
            logits = model(context)[0, -1].float().cpu()
        if temperature <= 0:
            ids.append(int(logits.argmax()))
        else:
            ids.append(int(torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=gen)))
    model.train()
    return data.decode(ids)


# Training ----------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--stack",
        choices=("apex", "native"),
        default="apex",
        help="apex: the apex pieces that are installed (PyTorch's stand in for the others); native: PyTorch's "
        "pieces only (AdamW(fused=True), nn.LayerNorm, torch.autocast, clip_grad_norm_(foreach=True))",
    )
    p.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16", "fp16"),
        default="auto",
        help="reduced-precision dtype (torch.autocast, or apex.amp's with --opt-level); auto = bf16 on a GPU "
        "that supports it (and with apex.amp on the CPU), fp16 on other GPUs with apex.amp, else fp32",
    )
    p.add_argument(
        "--opt-level",
        choices=("auto", "none", "O0", "O1", "O2", "O3"),
        default="auto",
        help="apex.amp optimization level; auto = O2 on a GPU when apex.amp is installed, none (torch.autocast "
        "per --precision) otherwise",
    )
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--lr", type=float, default=6e-3, help="peak learning rate (linear warm-up, cosine decay)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=3)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=64, help="validation/train windows per evaluation")
    p.add_argument("--sample-chars", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 samples greedily")
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="data-parallel processes with apex.parallel.DistributedDataParallel (NCCL with N GPUs, else gloo)",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch.cuda.is_available() is False")
    if args.nproc < 1 or args.batch_size % args.nproc:
        p.error(f"--batch-size {args.batch_size} must be a positive multiple of --nproc {args.nproc}")
    if args.device == "cuda" and args.nproc > 1 and torch.cuda.device_count() < args.nproc:
        p.error(f"--device cuda --nproc {args.nproc}, but only {torch.cuda.device_count()} GPUs are visible")
    if args.steps < 1 or args.eval_interval < 1:
        p.error("--steps and --eval-interval must be positive")
    if args.stack == "native" and args.opt_level not in ("auto", "none"):
        p.error(f"--opt-level {args.opt_level} is apex.amp's: use it with --stack apex")
    if args.precision == "fp16" and (args.opt_level == "none" or args.stack == "native"):
        p.error("--precision fp16 needs loss scaling: use it with --stack apex and an --opt-level")
    if args.precision == "fp32" and args.opt_level in ("O1", "O2", "O3"):
        p.error(f"--opt-level {args.opt_level} computes in reduced precision: use --precision bf16/fp16, or O0")
    return args


def lr_lambda(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def wants_cuda(args: argparse.Namespace) -> bool:
    if args.nproc > 1 and args.device == "auto":  # one GPU per process, or all on the CPU
        return torch.cuda.device_count() >= args.nproc
    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())


def wrap_data_parallel(model: nn.Module, stack: str = "apex") -> nn.Module:
    """apex.parallel.DistributedDataParallel, after converting any batch norm to SyncBatchNorm
    (torch's DistributedDataParallel in the native stack)."""
    if stack == "native":
        device = next(model.parameters()).device
        device_ids = [device] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    from apex.parallel import DistributedDataParallel, convert_syncbn_model

    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        model = convert_syncbn_model(model)
    # Reduced-precision parameters (apex.amp O2/O3) are summed in fp32.
    reduced = any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters())
    return DistributedDataParallel(model, allreduce_always_fp32=reduced)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.nproc == 1:
        return train(args)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    context = torch.multiprocessing.get_context("spawn")
    status = context.Value("i", 1)
    # A rank that raises makes spawn terminate the others, and the process group's timeout bounds
    # every collective, so a failure ends the run instead of hanging it.
    torch.multiprocessing.start_processes(
        run_rank, args=(args, status), nprocs=args.nproc, join=True, start_method="spawn"
    )
    return status.value


def run_rank(rank: int, args: argparse.Namespace, status) -> None:
    backend = "nccl" if wants_cuda(args) else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc))
    torch.distributed.init_process_group(
        backend, rank=rank, world_size=args.nproc, timeout=datetime.timedelta(minutes=5)
    )
    try:
        code = train(args, rank, args.nproc)
        if rank == 0:
            status.value = code
    finally:
        torch.distributed.destroy_process_group()


def train(args: argparse.Namespace, rank: int = 0, world: int = 1) -> int:
    print = builtins_print if rank == 0 else lambda *_, **__: None  # only rank 0 reports
    wall_start = time.perf_counter()
    torch.manual_seed(args.seed)
    use_cuda = wants_cuda(args)
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    amp, opt_level, amp_choice = pick_amp(args.opt_level, args.precision, use_cuda, args.stack)
    bf16_ok = not use_cuda or torch.cuda.is_bf16_supported()
    if amp is not None:  # amp casts inside the model: no autocast around it
        half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
        if args.precision == "auto":
            half = torch.bfloat16 if bf16_ok else torch.float16
        precision = "fp32" if half is None or opt_level == "O0" else {torch.bfloat16: "bf16"}.get(half, "fp16")
        autocast = contextlib.nullcontext
    else:
        bf16 = args.precision == "bf16" or (args.precision == "auto" and use_cuda and bf16_ok)
        precision = "bf16" if bf16 else "fp32"
        autocast = (
            functools.partial(torch.autocast, device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext
        )

    data = CharData(args.corpus.read_text(encoding="utf-8"), device)
    cfg = GPTConfig(len(data.chars), args.block_size, args.n_layer, args.n_head, args.n_embd)
    norm, norm_choice = pick_norm(args.stack)
    linear, mlp, dense_choice = pick_dense(args.stack)
    model = GPT(cfg, norm, linear, mlp).to(device)
    optimizer, opt_choice = pick_optimizer(model.param_groups(args.weight_decay), args.lr, args.stack)
    if amp is not None:
        dtype_args = {}
        if half is not None and opt_level in ("O2", "O3"):
            dtype_args["cast_model_type"] = half
        elif half is not None and opt_level == "O1":
            dtype_args["autocast_dtype"] = half
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0, **dtype_args)
        amp_choice.name += f" ({precision}, loss scale {amp._amp_state.opt_properties.loss_scale})"
    net = wrap_data_parallel(model, args.stack) if world > 1 else model  # trains; model evaluates and samples
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(max(1, args.steps // 20), args.steps))
    loss_fn, loss_choice = pick_loss(args.stack)
    clip, clip_choice = pick_clip(args.stack)
    params = [p for p in model.parameters() if p.requires_grad]
    # What the optimizer steps, whose gradients are clipped: amp's fp32 masters where it keeps them.
    clip_params = params if amp is None else list(amp.master_params(optimizer))

    n_params = sum(p.numel() for p in params)
    device_name = torch.cuda.get_device_name(device) if use_cuda else "cpu"
    mixed = f"apex.amp {opt_level}" if amp is not None else "torch.autocast" if precision != "fp32" else "none"
    print(
        f"torch {torch.__version__} | device {device} ({device_name}) | precision {precision} ({mixed}) | "
        f"stack {args.stack}"
    )
    if world > 1:
        print(
            f"data parallel: {world} processes ({torch.distributed.get_backend()}), "
            f"{'torch.nn.parallel' if args.stack == 'native' else 'apex.parallel'}.DistributedDataParallel, "
            f"{args.batch_size // world} sequences per rank"
        )
    print(
        f"corpus {args.corpus.name}: {sum(len(s) for s in data.splits.values())} chars, vocab {cfg.vocab_size}, "
        f"train {len(data.splits['train'])} / val {len(data.splits['val'])}"
    )
    print(
        f"model: {cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}, context {cfg.block_size}, "
        f"{n_params / 1e6:.2f}M parameters; batch {args.batch_size}, {args.steps} steps, peak lr {args.lr:g}"
    )

    gen = torch.Generator().manual_seed(args.seed)
    eval_windows = {split: data.eval_starts(split, cfg.block_size, args.eval_windows) for split in ("train", "val")}

    def run_eval() -> dict:
        return evaluate(model, data, eval_windows, cfg.block_size, args.batch_size, autocast)

    def train_step() -> torch.Tensor:
        # Every rank draws the same global batch (same generator) and keeps its shard.
        starts = data.random_starts("train", args.batch_size, cfg.block_size, gen).chunk(world)[rank]
        x, y = data.batch("train", starts, cfg.block_size)
        with autocast():
            logits = net(x)
        loss = loss_fn(logits, y)
        optimizer.zero_grad(set_to_none=True)
        if amp is None:
            loss.backward()
        else:
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()  # leaves unscaled gradients on clip_params
        grad_norm = clip(clip_params, args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        return grad_norm

    def sync() -> None:
        if use_cuda:
            torch.cuda.synchronize(device)

    initial = latest = run_eval()
    tokens_per_step = args.batch_size * cfg.block_size
    for step in range(1, args.steps + 1):
        grad_norm = train_step()
        if step == 1:
            # The first step may have loaded or JIT-compiled kernels: report the tiers it ran
            # with, and leave it out of the throughput.
            sync()
            print(f"{args.stack} pieces (kernel tier after the first step):")
            for choice in (loss_choice, clip_choice, opt_choice, norm_choice, dense_choice, amp_choice):
                if choice.kernels is not None:
                    print(describe_kernels(choice, device))
                else:
                    print(f"  {choice.role:<10} {choice.name:<46} ({choice.note})")
            print(f"{'step':>6} {'train loss':>11} {'val loss':>9} {'grad norm':>10} {'lr':>9} {'tokens/s':>10}")
            print(f"{0:>6} {initial['train']:>11.4f} {initial['val']:>9.4f} {'-':>10} {'-':>9} {'-':>10}")
            interval_start, interval_steps = time.perf_counter(), 0
        else:
            interval_steps += 1
        if step % args.eval_interval == 0 or step == args.steps:
            sync()
            elapsed = time.perf_counter() - interval_start
            throughput = f"{interval_steps * tokens_per_step / elapsed:.0f}" if interval_steps else "-"
            latest = run_eval()
            lr = scheduler.get_last_lr()[0]
            print(
                f"{step:>6} {latest['train']:>11.4f} {latest['val']:>9.4f} {grad_norm.item():>10.3f} {lr:>9.2e} "
                f"{throughput:>10}"
            )
            interval_start, interval_steps = time.perf_counter(), 0

    text = sample(model, data, "The ", args.sample_chars, args.temperature, gen, autocast)
    print(f"\nsample ({args.sample_chars} chars, temperature {args.temperature:g}):\n{text}\n")
    improved = latest["val"] < initial["val"]
    print(
        f"final loss: train {latest['train']:.4f}, val {latest['val']:.4f} "
        f"(initial val {initial['val']:.4f}, {'improved' if improved else 'NOT improved'}); "
        f"{time.perf_counter() - wall_start:.1f} s"
    )
    return 0 if improved else 1


if __name__ == "__main__":
    sys.exit(main())
