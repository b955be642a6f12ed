"""End to end: one training step with the whole apex stack against the best PyTorch-native stack.

Models (written here; no downloads; data is the repository's corpus as byte tokens, or random images):

- ``gpt2``: GPT-2 small, 124M (LayerNorm, GELU MLP, learned positions, tied embeddings, vocabulary
  50304), batch 16 x 1024;
- ``llama1b``: a Llama-style decoder of 1.24B (16 layers, width 2048, 32 query / 8 key-value heads,
  RMSNorm, rotary embeddings, SwiGLU MLP 8192, tied embeddings, vocabulary 128256), batch 8 x 2048;
- ``resnet50``: torchvision's ResNet-50 (imported only when selected), channels-last, batch 256 at
  224 x 224, random images and labels.

Stacks, each a full step (zero_grad, forward, loss, backward, clip to norm 1, optimizer step):

- ``native-eager``: ``torch.autocast(bf16)``, ``nn.LayerNorm`` / ``nn.RMSNorm``, PyTorch's rotary
  expression, ``F.cross_entropy``, ``clip_grad_norm_(foreach=True)``, ``AdamW(fused=True)``
  (``SGD(fused=True, momentum=0.9)`` for ResNet-50);
- ``native-compiled``: the same with the model and its loss under ``torch.compile`` (default mode);
- ``apex-eager``: ``amp.initialize(opt_level="O2", cast_model_type=torch.bfloat16)``,
  ``FusedLayerNorm`` / ``FusedRMSNorm`` in their fused residual-add form with ``memory_efficient=True``
  (each saves its output, which the next linear layer holds anyway, instead of the residual stream),
  ``fused_apply_rotary_pos_emb``, ``fused_swiglu`` (Llama's MLP; ours, not in upstream Apex),
  ``FusedDense`` (GPT-2's attention projections; Llama's bias-free projections stay ``nn.Linear``
  unless ``--llama-linear apex``),
  ``FusedDenseGeluDense`` (GPT-2's MLP), ``SoftmaxCrossEntropyLoss`` (float32 losses, in-place
  backward), apex's ``clip_grad_norm_``, ``FusedAdam`` (``FusedSGD`` for ResNet-50); ResNet-50 keeps
  torchvision's ``nn.BatchNorm2d`` and ReLUs (``--resnet-bn apex``: ``apex.parallel.SyncBatchNorm``,
  one process, with the ReLU after each norm fused and each bottleneck's residual add too; faster
  eager, slower compiled: BENCHMARKS.md);
- ``apex-compiled``: the apex stack with the model and its loss under ``torch.compile``.

Attention is ``F.scaled_dot_product_attention(is_causal=True)`` in every stack. Clipping and the
optimizer step run eagerly in the compiled stacks (both are fused kernels already). All stacks start
from the same weights (one seeded initialisation, loaded into each) and see the same batches.

Timing: every variant is built and warmed up in turn (its peak memory is measured then, while only
the variants before it are resident), one step after warm-up runs under
``torch.cuda.set_sync_debug_mode("error")`` (host syncs: pass or the error), then ``--rounds``
rounds in which each variant in turn (rotating order) runs ``--steps`` back-to-back steps timed with
CUDA events; ms/step is the median over rounds. MFU is the model FLOPs per step (counted by
``torch.utils.flop_counter.FlopCounterMode`` on one native forward and backward: matmuls,
convolutions and attention, causal attention counted as full) against the bf16 matmul rate measured
in the same run. The losses of the first step and the 50th step (or the last, when fewer run) are
printed; the stacks should agree to within bf16 noise. Host ms/step is one step's host time with the
GPU kept busy by a spin kernel queued ahead of it (median of 5): where it nears ms/step, the GPU waits
on the host.

    python benchmarks/bench_e2e.py                         # every model and stack, on the GPU
    python benchmarks/bench_e2e.py --models gpt2 --stacks native-compiled,apex-eager,apex-compiled
    python benchmarks/bench_e2e.py --out DIR --plot DIR/bench_e2e.png
    python benchmarks/bench_e2e.py --plot out.png --plot-from A/bench_e2e.md B/bench_e2e.md  # draw saved runs
    python benchmarks/bench_e2e.py --models gpt2 --profile 25 --trace DIR  # then benchmarks/trace_gaps.py DIR/*
    python benchmarks/bench_e2e.py --models gpt2 --profile 25 --trace DIR --trace-steps 5  # + 5 steps in a row
    python benchmarks/bench_e2e.py --smoke --stacks native-eager,apex-eager   # tiny models, CPU is fine
    python benchmarks/bench_e2e.py --models gpt2 --stacks native-compiled,apex-eager,apex-eager+APEX_SIDE_STREAM=0

A stack named ``STACK+VAR=VALUE[+VAR=VALUE...]`` is one more variant of STACK that runs its steps
with those environment variables set (switches apex's kernels read on every call, such as
``APEX_SIDE_STREAM`` or ``APEX_CUBLASLT_DISABLE``), timed in turns with the others: an A/B of a
kernel choice under a training step's sustained load. The bars count the plain stacks only.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function
from torch.utils.flop_counter import FlopCounterMode

from apex import amp
from apex.contrib.clip_grad import clip_grad_norm_ as apex_clip_grad_norm_
from apex.contrib.xentropy import SoftmaxCrossEntropyLoss
from apex.core.benchmarking import (
    ClockSummary,
    environment,
    markdown_table,
    report,
    require_cuda,
    time_ms,
    verdict,
    watch_clocks,
)
from apex.fused_dense import FusedDense, FusedDenseGeluDense
from apex.normalization import FusedLayerNorm, FusedRMSNorm
from apex.optimizers import FusedAdam, FusedSGD
from apex.parallel import SyncBatchNorm
from apex.transformer.functional import fused_apply_rotary_pos_emb, fused_swiglu

NAME = "bench_e2e"
CORPUS = Path(__file__).resolve().parents[1] / "examples" / "data" / "tiny_corpus.txt"
STACKS = ("native-eager", "native-compiled", "apex-eager", "apex-compiled")
MAX_GRAD_NORM = 1.0
NORM_EPS = 1e-5
PHASE = "e2e step: "  # the profiler ranges of a step's phases
# GPU clock cycles of the spin kernel queued before a profiled step (~5 ms at H100/H200 clocks: about
# as far as the host runs ahead of the GPU between timed steps); its kernel is not counted.
QUEUED_AHEAD_CYCLES = 10_000_000
SPIN_KERNEL = "spin_kernel"  # torch.cuda._sleep's kernel
# The spin ahead of a host-time probe (~200 ms): longer than any step's host time here, so the host
# never waits on the device while it is timed.
HOST_PROBE_CYCLES = 400_000_000
HOST_PROBE_STEPS = 5
LATE_STEP = 50  # the step whose loss is compared across stacks (or the last step, if fewer run)
# The bars: apex's faster stack against native compiled, per model.
SPEEDUP_BAR = {"gpt2": 1.2, "llama1b": 1.2, "resnet50": 1.05}
EAGER_BAR = {"gpt2": 1.0, "llama1b": 1.0}  # apex eager against native compiled


# The building blocks of one stack ----------------------------------------------------------


@dataclass(frozen=True)
class Kit:
    """What a model is built from in one stack: PyTorch's modules and expressions, or apex's."""

    apex: bool
    # Key and value heads repeated for the query heads before attention: only for counting FLOPs, as
    # older FlopCounterModes refuse grouped-query shapes (the count is the same).
    expand_kv: bool = False
    # Llama's bias-free projections as apex's FusedDense (bias=False) in the apex stacks
    # (``--llama-linear apex``); nn.Linear otherwise.
    fused_projections: bool = False

    def layer_norm(self, width: int) -> nn.Module:
        if self.apex:
            return FusedLayerNorm(width, eps=NORM_EPS, memory_efficient=True)
        return nn.LayerNorm(width, eps=NORM_EPS)

    def rms_norm(self, width: int) -> nn.Module:
        if self.apex:
            return FusedRMSNorm(width, eps=NORM_EPS, memory_efficient=True)
        return nn.RMSNorm(width, eps=NORM_EPS)

    def add_norm(self, norm: nn.Module, x: torch.Tensor, pending: torch.Tensor | None):
        """``(norm(x + pending), x + pending)``: the residual add before a pre-norm, fused in apex."""
        if pending is None:
            return norm(x), x
        if self.apex:
            return norm(pending, x)
        x = x + pending
        return norm(x), x

    def linear(self, width: int, out: int) -> nn.Module:
        """A projection with a bias: apex's FusedDense computes the bias gradient in one pass over the
        output gradient (ATen's ``AddmmBackward0`` sums it with a generic reduction)."""
        return FusedDense(width, out) if self.apex else nn.Linear(width, out)

    def projection(self, width: int, out: int) -> nn.Module:
        """A projection without a bias: FusedDense's backward computes the weight gradient on a second
        stream beside the input gradient (apex-core's apex/side_stream.h)."""
        if self.apex and self.fused_projections:
            return FusedDense(width, out, bias=False)
        return nn.Linear(width, out, bias=False)

    def gelu_mlp(self, width: int, hidden: int) -> nn.Module:
        return FusedDenseGeluDense(width, hidden, width) if self.apex else GeluMLP(width, hidden)

    def rope_table(self, freqs: torch.Tensor):
        """From float32 angles ``[s, d]``: apex's ``[s, 1, 1, d]``, or native ``(cos, sin)`` ``[s, 1, d]``."""
        if self.apex:
            return freqs[:, None, None, :]
        return freqs.cos()[:, None, :], freqs.sin()[:, None, :]

    def rope(self, t: torch.Tensor, table) -> torch.Tensor:
        """Rotate-half RoPE of ``t`` ``[b, s, h, d]``; returns ``[b, s, h, d]``."""
        if self.apex:  # the op takes [s, b, h, d]; its output laid out [b, s, h, d] in memory
            return fused_apply_rotary_pos_emb(t.transpose(0, 1), table, transpose_output_memory=True).transpose(0, 1)
        cos, sin = (c.to(t.dtype) for c in table)
        t1, t2 = t.chunk(2, dim=-1)
        return t * cos + torch.cat((-t2, t1), dim=-1) * sin

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the gate and up projections' output ``[..., 2 * ffn]`` (halves in that order)."""
        if self.apex:  # one kernel each way; autograd keeps only gate_up
            return fused_swiglu(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy of ``logits [n, classes]``."""
        if self.apex:  # per-row float32 losses; the gradient overwrites the logits (the head's output)
            return SoftmaxCrossEntropyLoss.apply(logits, targets, 0.0, None, True, True).mean()
        return F.cross_entropy(logits, targets)


class GeluMLP(nn.Module):
    """``Linear -> GELU(tanh) -> Linear`` with FusedDenseGeluDense's parameter names, so one state
    dict loads into both stacks."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.weight1 = nn.Parameter(torch.empty(hidden, width))
        self.bias1 = nn.Parameter(torch.zeros(hidden))
        self.weight2 = nn.Parameter(torch.empty(width, hidden))
        self.bias2 = nn.Parameter(torch.zeros(width))
        nn.init.normal_(self.weight1, std=0.02)
        nn.init.normal_(self.weight2, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.gelu(F.linear(x, self.weight1, self.bias1), approximate="tanh"), self.weight2, self.bias2)


# Models ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransformerConfig:
    vocab: int
    seq: int
    batch: int
    layers: int
    width: int
    heads: int
    kv_heads: int = 0  # Llama: grouped-query attention
    ffn: int = 0  # Llama: SwiGLU hidden size
    rope_theta: float = 500000.0


def init_transformer(model: nn.Module, layers: int) -> None:
    """GPT-2's initialisation: N(0, 0.02), zero biases, residual projections scaled by 1/sqrt(2 layers)."""
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue  # biases were zeroed, norm weights are ones
        std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.weight2", "w2.weight")) else 0.02
        nn.init.normal_(p, std=std)
    for module in model.modules():
        if isinstance(module, (nn.Linear, FusedDense)) and module.bias is not None:
            nn.init.zeros_(module.bias)


class GPT2Block(nn.Module):
    def __init__(self, cfg: TransformerConfig, kit: Kit):
        super().__init__()
        self.kit, self.heads = kit, cfg.heads
        self.norm1 = kit.layer_norm(cfg.width)
        self.qkv = kit.linear(cfg.width, 3 * cfg.width)
        self.proj = kit.linear(cfg.width, cfg.width)
        self.norm2 = kit.layer_norm(cfg.width)
        self.mlp = kit.gelu_mlp(cfg.width, 4 * cfg.width)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None):
        """The residual stream is ``x + pending``; returns the next block's ``(x, pending)``."""
        h, x = self.kit.add_norm(self.norm1, x, pending)
        b, s, w = h.shape
        q, k, v = (t.view(b, s, self.heads, w // self.heads).transpose(1, 2) for t in self.qkv(h).split(w, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, w)
        h, x = self.kit.add_norm(self.norm2, x, self.proj(y))
        return x, self.mlp(h)


class GPT2(nn.Module):
    def __init__(self, cfg: TransformerConfig, kit: Kit):
        super().__init__()
        self.kit = kit
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(GPT2Block(cfg, kit) for _ in range(cfg.layers))
        self.norm_f = kit.layer_norm(cfg.width)
        init_transformer(self, cfg.layers)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x, pending = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)), None
        for block in self.blocks:
            x, pending = block(x, pending)
        h, _ = self.kit.add_norm(self.norm_f, x, pending)
        logits = F.linear(h, self.tok.weight)  # tied embeddings
        return self.kit.loss(logits.flatten(0, 1), targets.flatten())


class LlamaBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig, kit: Kit):
        super().__init__()
        self.kit, self.heads, self.kv_heads = kit, cfg.heads, cfg.kv_heads
        self.head_dim = cfg.width // cfg.heads
        self.norm1 = kit.rms_norm(cfg.width)
        self.wqkv = kit.projection(cfg.width, (cfg.heads + 2 * cfg.kv_heads) * self.head_dim)
        self.proj = kit.projection(cfg.width, cfg.width)
        self.norm2 = kit.rms_norm(cfg.width)
        self.w13 = kit.projection(cfg.width, 2 * cfg.ffn)  # gate and up projections together
        self.w2 = kit.projection(cfg.ffn, cfg.width)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rope):
        h, x = self.kit.add_norm(self.norm1, x, pending)
        b, s, w = h.shape
        d = self.head_dim
        q, k, v = self.wqkv(h).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=2)
        q = self.kit.rope(q.view(b, s, self.heads, d), rope).transpose(1, 2)
        k = self.kit.rope(k.view(b, s, self.kv_heads, d), rope).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, d).transpose(1, 2)
        if self.kit.expand_kv:
            k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not self.kit.expand_kv)
        h, x = self.kit.add_norm(self.norm2, x, self.proj(y.transpose(1, 2).reshape(b, s, w)))
        return x, self.w2(self.kit.swiglu(self.w13(h)))


class Llama(nn.Module):
    def __init__(self, cfg: TransformerConfig, kit: Kit):
        super().__init__()
        self.kit, self.cfg = kit, cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.blocks = nn.ModuleList(LlamaBlock(cfg, kit) for _ in range(cfg.layers))
        self.norm_f = kit.rms_norm(cfg.width)
        init_transformer(self, cfg.layers)

    def rope_angles(self, seq: int, device: torch.device) -> torch.Tensor:
        """float32 ``[seq, head_dim]``: position times inverse frequency, both halves alike (rotate-half)."""
        d = self.cfg.width // self.cfg.heads
        inv_freq = self.cfg.rope_theta ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
        angles = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        return torch.cat((angles, angles), dim=-1)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rope = self.kit.rope_table(self.rope_angles(idx.shape[1], idx.device))
        x, pending = self.tok(idx), None
        for block in self.blocks:
            x, pending = block(x, pending, rope)
        h, _ = self.kit.add_norm(self.norm_f, x, pending)
        logits = F.linear(h, self.tok.weight)  # tied embeddings
        return self.kit.loss(logits.flatten(0, 1), targets.flatten())


class Classifier(nn.Module):
    """An image model and its loss, so that amp's casts and torch.compile take both."""

    def __init__(self, net: nn.Module, kit: Kit):
        super().__init__()
        self.kit, self.net = kit, net

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.kit.loss(self.net(images), labels)


@dataclass(frozen=True)
class ImageConfig:
    batch: int
    size: int
    classes: int = 1000
    tiny: bool = False


def apex_batch_norms(net: nn.Module) -> nn.Module:
    """A torchvision bottleneck ResNet with apex's batch norm: every ``nn.BatchNorm2d`` becomes a
    :class:`SyncBatchNorm` with the same state, the ReLU after the stem's norm and after each
    bottleneck's first two is fused into them (``fuse_relu``), and each bottleneck's last norm also
    takes the residual add (``z``). Any other model is returned as it is."""
    try:
        from torchvision.models.resnet import Bottleneck, ResNet
    except ImportError:
        return net
    blocks = [m for layer in (getattr(net, f"layer{i}", ()) for i in range(1, 5)) for m in layer]
    if not isinstance(net, ResNet) or not all(isinstance(b, Bottleneck) for b in blocks):
        return net

    def swap(bn: nn.BatchNorm2d, relu: bool) -> SyncBatchNorm:
        new = SyncBatchNorm(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, fuse_relu=relu)
        new.load_state_dict(bn.state_dict())
        return new.to(bn.weight.device)

    def forward(block, x: torch.Tensor) -> torch.Tensor:
        identity = x if block.downsample is None else block.downsample(x)
        out = block.bn2(block.conv2(block.bn1(block.conv1(x))))
        return block.bn3(block.conv3(out), identity)  # relu(bn3(conv3(out)) + identity)

    fused = type("FusedBottleneck", (Bottleneck,), {"forward": forward})
    net.bn1, net.relu = swap(net.bn1, True), nn.Identity()
    for block in blocks:
        block.bn1, block.bn2, block.bn3 = (swap(bn, True) for bn in (block.bn1, block.bn2, block.bn3))
        if block.downsample is not None:
            block.downsample[1] = swap(block.downsample[1], False)
        block.__class__ = fused
    return net


def resnet(cfg: ImageConfig) -> tuple[Callable[[], nn.Module], str]:
    """torchvision's ResNet-50 (its constructor and name), or for smoke runs its smallest bottleneck
    ResNet, or our stand-in where torchvision is not installed."""
    try:
        import torchvision
    except ImportError as exc:
        if not cfg.tiny:
            raise SystemExit(f"{NAME}: resnet50 needs torchvision ({exc}); leave it out with --models") from exc
        return lambda: TinyResNet(cfg.classes), "a stand-in bottleneck CNN (torchvision is not installed)"
    if cfg.tiny:
        bottleneck = torchvision.models.resnet.Bottleneck
        build = lambda: torchvision.models.resnet.ResNet(bottleneck, [1, 1, 1, 1], num_classes=cfg.classes)  # noqa: E731
        return build, f"torchvision {torchvision.__version__} ResNet with one bottleneck per stage"
    return torchvision.models.resnet50, f"torchvision {torchvision.__version__} resnet50"


class TinyResNet(nn.Module):
    """Two bottleneck residual blocks with batch norm: the smoke run's CNN when torchvision is missing."""

    def __init__(self, classes: int, width: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(width, width // 4, 1, bias=False),
                nn.BatchNorm2d(width // 4),
                nn.ReLU(),
                nn.Conv2d(width // 4, width // 4, 3, padding=1, bias=False),
                nn.BatchNorm2d(width // 4),
                nn.ReLU(),
                nn.Conv2d(width // 4, width, 1, bias=False),
                nn.BatchNorm2d(width),
            )
            for _ in range(2)
        )
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = F.relu(x + block(x))
        return self.fc(x.mean(dim=(2, 3)))


# What each model needs ---------------------------------------------------------------------


@dataclass
class ModelSpec:
    name: str
    unit: str  # what throughput counts: tokens or images
    cfg: object
    build: Callable[[Kit], nn.Module]
    make_batches: Callable[[torch.device, int], list[tuple[torch.Tensor, torch.Tensor]]]
    optimizer: str  # adam or sgd
    lr: float
    weight_decay: float
    channels_last: bool = False
    describe: str = ""


def corpus_batches(cfg: TransformerConfig, device: torch.device, count: int, seed: int):
    """``count`` batches of byte-token windows of the corpus at seeded offsets (inputs, targets)."""
    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()
    if len(data) <= cfg.seq + 1:  # a corpus shorter than the context repeats
        data = data.repeat(math.ceil((cfg.seq + 2) / len(data)))
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        starts = torch.randint(len(data) - cfg.seq - 1, (cfg.batch,), generator=gen)
        window = data[starts[:, None] + torch.arange(cfg.seq + 1)]
        batches.append((window[:, :-1].to(device), window[:, 1:].to(device)))
    return batches


def image_batches(cfg: ImageConfig, device: torch.device, count: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        images = torch.randn(cfg.batch, 3, cfg.size, cfg.size, generator=gen)
        labels = torch.randint(cfg.classes, (cfg.batch,), generator=gen)
        batches.append((images.to(device, memory_format=torch.channels_last), labels.to(device)))
    return batches


def model_spec(name: str, smoke: bool, seed: int, resnet_bn: str = "torch", llama_linear: str = "torch") -> ModelSpec:
    if name in ("gpt2", "llama1b"):
        if name == "gpt2":
            cfg = TransformerConfig(vocab=50304, seq=1024, batch=16, layers=12, width=768, heads=12)
            if smoke:
                cfg = TransformerConfig(vocab=512, seq=32, batch=2, layers=2, width=64, heads=4)
            arch = GPT2
        else:
            cfg = TransformerConfig(128256, 2048, 8, layers=16, width=2048, heads=32, kv_heads=8, ffn=8192)
            if smoke:
                cfg = TransformerConfig(512, 32, 2, layers=2, width=64, heads=4, kv_heads=2, ffn=128)
            arch = Llama
        return ModelSpec(
            name,
            "tokens",
            cfg,
            lambda kit: arch(cfg, replace(kit, fused_projections=llama_linear == "apex")),
            lambda device, count: corpus_batches(cfg, device, count, seed),
            "adam",
            lr=6e-4,
            weight_decay=0.1,
            describe=f"batch {cfg.batch} x {cfg.seq}, {cfg.layers} layers, width {cfg.width}, vocabulary {cfg.vocab}"
            + (
                "; the apex stacks' projections FusedDense(bias=False)"
                if name == "llama1b" and llama_linear == "apex"
                else ""
            ),
        )
    if name == "resnet50":
        cfg = ImageConfig(batch=4, size=32, classes=10, tiny=True) if smoke else ImageConfig(batch=256, size=224)
        net, net_name = resnet(cfg)
        return ModelSpec(
            name,
            "images",
            cfg,
            lambda kit: Classifier(apex_batch_norms(net()) if kit.apex and resnet_bn == "apex" else net(), kit),
            lambda device, count: image_batches(cfg, device, count, seed),
            "sgd",
            lr=0.05,
            weight_decay=5e-5,
            channels_last=True,
            describe=f"{net_name}, batch {cfg.batch} at {cfg.size} x {cfg.size}, {cfg.classes} classes, channels-last",
        )
    raise SystemExit(f"{NAME}: unknown model {name!r}; choose from gpt2, llama1b, resnet50")


# One stack training one model --------------------------------------------------------------


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and convolution kernels; biases, norm weights and positions are left alone."""
    decay, rest = [], []
    for name, p in module.named_parameters():
        (decay if p.dim() >= 2 and not name.startswith("pos.") else rest).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


@dataclass
class Variant:
    stack: str  # a name of STACKS, or one with +VAR=VALUE settings (stack_env)
    module: nn.Module  # as trained (amp-initialized in apex stacks), not compiled
    run: Callable  # the module, or its compiled form
    optimizer: torch.optim.Optimizer
    clip_params: list[torch.Tensor]
    batches: list
    device: torch.device
    losses: list = field(default_factory=list)  # one device scalar per step; floats once retired
    turn_ms: list[float] = field(default_factory=list)
    turn_spans: list[tuple[float, float]] = field(default_factory=list)  # time.time() at each turn's start, end
    clock: ClockSummary | None = None  # the GPU's clock during the timed turns (nvidia-smi samples)
    peak_bytes: int | None = None
    host_syncs: str = "n/a"
    graph_breaks: int | None = None
    warmup_s: float | None = None  # the warm-up steps' wall time: torch.compile's work in the compiled stacks
    host_ms: float | None = None  # one step's host time with the GPU busy (host_step_ms)
    marks: list | None = None  # (phase, CUDA event, host time) at each phase's start, while phase_times runs

    @contextlib.contextmanager
    def phase(self, name: str):
        """One phase of a step: a profiler range (PHASE + name) and, while ``marks`` is a list, a CUDA
        event and the host clock at its start (``--phase-steps``)."""
        if self.marks is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((name, event, time.perf_counter()))
        with record_function(PHASE + name):
            yield

    @property
    def apex(self) -> bool:
        return self.stack.startswith("apex")

    @property
    def env(self) -> dict[str, str]:
        return stack_env(self.stack)[1]

    def step(self) -> None:
        with environment(**self.env):
            self._step()

    def _step(self) -> None:
        inputs, targets = self.batches[len(self.losses) % len(self.batches)]
        # The phases are named for the profile and --phase-steps (about a microsecond each otherwise).
        with self.phase("zero_grad"):
            self.optimizer.zero_grad(set_to_none=True)
        if self.apex:
            with self.phase("forward"):
                loss = self.run(inputs, targets)
            with self.phase("backward"), amp.scale_loss(loss, self.optimizer) as scaled:
                scaled.backward()
            with self.phase("clip"):
                apex_clip_grad_norm_(self.clip_params, MAX_GRAD_NORM)
        else:
            with self.phase("forward"), torch.autocast(self.device.type, dtype=torch.bfloat16):
                loss = self.run(inputs, targets)
            with self.phase("backward"):
                loss.backward()
            with self.phase("clip"):
                torch.nn.utils.clip_grad_norm_(self.clip_params, MAX_GRAD_NORM, foreach=True)
        with self.phase("optimizer"):
            self.optimizer.step()
        self.losses.append(loss.detach())

    def release_grads(self) -> None:
        """Free the gradients between turns, so that the variants waiting hold less memory."""
        self.optimizer.zero_grad(set_to_none=True)

    def retire(self) -> None:
        """Keep the measurements (losses as floats), let go of the model, optimizer and data."""
        self.losses = torch.stack(self.losses).float().tolist()
        self.module = self.run = self.optimizer = self.clip_params = self.batches = self.marks = None


def stack_env(stack: str) -> tuple[str, dict[str, str]]:
    """``apex-eager+APEX_SIDE_STREAM=0`` -> ("apex-eager", {"APEX_SIDE_STREAM": "0"}); a plain name ->
    (name, {}). Raises ValueError for an unknown base stack or a setting without ``=``."""
    base, *settings = stack.split("+")
    if base not in STACKS:
        raise ValueError(f"unknown stack {base!r}; choose from {', '.join(STACKS)}")
    env = {}
    for setting in settings:
        name, sep, value = setting.partition("=")
        if not sep or not name:
            raise ValueError(f"{stack!r}: {setting!r} is not VAR=VALUE")
        env[name] = value
    return base, env


def file_name(stack: str) -> str:
    """The stack's name in a file name: letters, digits, '.', '_' and '-' (``+VAR=VALUE`` -> ``_VAR_VALUE``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", stack)


def build_variant(stack: str, spec: ModelSpec, state: dict, batches: list, device: torch.device) -> Variant:
    kit = Kit(apex=stack.startswith("apex"))
    with torch.device(device):
        module = spec.build(kit)
    module.load_state_dict(state)
    if spec.channels_last:
        module.to(memory_format=torch.channels_last)
    groups = param_groups(module, spec.weight_decay)
    if kit.apex:
        if spec.optimizer == "adam":
            optimizer = FusedAdam(groups, lr=spec.lr, betas=(0.9, 0.95), adam_w_mode=True)
        else:
            optimizer = FusedSGD(groups, lr=spec.lr, momentum=0.9)
        module, optimizer = amp.initialize(
            module, optimizer, opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0
        )
        clip_params = list(amp.master_params(optimizer))
    else:
        if spec.optimizer == "adam":
            optimizer = torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), fused=True)
        else:
            optimizer = torch.optim.SGD(groups, lr=spec.lr, momentum=0.9, fused=True)
        clip_params = list(module.parameters())
    run = torch.compile(module) if stack_env(stack)[0].endswith("compiled") else module
    return Variant(stack, module, run, optimizer, clip_params, batches, device)


def count_flops(spec: ModelSpec, state: dict, batch, device: torch.device) -> int:
    """Forward + backward FLOPs of one step, counted on a native eager copy (apex's fused ops are
    opaque to the counter)."""
    with torch.device(device):
        module = spec.build(Kit(apex=False, expand_kv=True))
    module.load_state_dict(state)
    if spec.channels_last:
        module.to(memory_format=torch.channels_last)
    with FlopCounterMode(display=False) as counter:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = module(*batch)
        loss.backward()
    return counter.get_total_flops()


def timed_steps_ms(variant: Variant, steps: int) -> float:
    """Per-step time of ``steps`` back-to-back steps (CUDA events on the GPU, the host clock on the CPU)."""
    if variant.device.type == "cuda":
        return time_ms([variant.step], samples=1, min_calls=steps, warmup=0)
    start = time.perf_counter()
    for _ in range(steps):
        variant.step()
    return (time.perf_counter() - start) * 1e3 / steps


def host_step_ms(variant: Variant) -> float | None:
    """The host's time for one step while the GPU is busy with a spin kernel queued first, so that the
    host never waits on the device or on a full launch queue: the median over HOST_PROBE_STEPS steps.
    A step is GPU-bound when this is well below its ms/step. None on the CPU (all of a step is host time)."""
    if variant.device.type != "cuda":
        return None
    times, spins = [], []
    for _ in range(HOST_PROBE_STEPS):
        torch.cuda.synchronize()
        spin_start, spin_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        spin_start.record()
        torch.cuda._sleep(HOST_PROBE_CYCLES)
        spin_end.record()
        start = time.perf_counter()
        variant.step()
        times.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        spins.append(spin_start.elapsed_time(spin_end))
    variant.release_grads()
    del variant.losses[-HOST_PROBE_STEPS:]  # not steps of the comparison
    if max(t / s for t, s in zip(times, spins)) > 0.9:
        # The host waited on the device (a full launch queue, or a sync): not the host's own time.
        print(f"  {variant.stack}: host probe reached the spin's end; no host ms/step", file=sys.stderr)
        return None
    return statistics.median(times)


def check_host_syncs(variant: Variant) -> str:
    """One step under ``set_sync_debug_mode("error")``: "pass", or the error it raised."""
    if variant.device.type != "cuda":
        return "n/a (CPU)"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        variant.step()
    except RuntimeError as exc:  # the step stops where it synced; its loss is not recorded
        return "FAIL: " + str(exc).strip().splitlines()[0][:120]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return "pass"


def profiler_activities(device: torch.device) -> list:
    """What torch.profiler records of a step: host ops, and on the GPU its kernels too (after a
    synchronize, so that nothing queued before the profile lands in it)."""
    if device.type != "cuda":
        return [torch.profiler.ProfilerActivity.CPU]
    torch.cuda.synchronize()
    return [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]


def profile_step(variant: Variant, rows: int, trace: Path | None = None) -> list[str]:
    """torch.profiler's table of one step (the ops that cost the most device time, or host time on the
    CPU), for the note of a missed bar; with ``trace``, also its Chrome trace there (gzip: read it with
    ``benchmarks/trace_gaps.py`` for where the GPU waits on the host).

    On the GPU the profiled step is queued behind a spin kernel of ``QUEUED_AHEAD_CYCLES`` (left out
    of the tables), as a timed step is queued behind the step before it: a step started on an idle
    GPU shows the host's launch time of its first ops as idle time that back-to-back steps do not
    have. Idle time left in the profile is where the host fell behind within the step."""
    cuda = variant.device.type == "cuda"
    activities = profiler_activities(variant.device)
    if cuda:
        torch.cuda._sleep(QUEUED_AHEAD_CYCLES)
    with torch.profiler.profile(activities=activities) as prof:
        variant.step()
        if cuda:
            torch.cuda.synchronize()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    variant.release_grads()
    del variant.losses[-1]  # not a step of the comparison: the late-step loss stays an unprofiled step's
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = ["```", prof.key_averages().table(sort_by=sort_by, row_limit=rows), "```"]
    return ([*kernel_categories(prof), "", *phase_times(prof), ""] if cuda else []) + table


def trace_steps(variant: Variant, steps: int, trace: Path) -> None:
    """A Chrome trace of ``steps`` back-to-back steps (``--trace-steps``), for what a run of steps loses
    that one profiled step queued behind a spin kernel may not show (between steps, or where the host
    falls behind after a few). Its steps are not steps of the comparison: their losses are dropped."""
    cuda = variant.device.type == "cuda"
    with torch.profiler.profile(activities=profiler_activities(variant.device)) as prof:
        for _ in range(steps):
            variant.step()
        if cuda:
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace))
    variant.release_grads()
    del variant.losses[-steps:]


def phase_rows(marks: list[tuple[str, float, float]], end: tuple[float, float], steps: int) -> list[list[str]]:
    """The ``--phase-steps`` table from marks (phase, GPU ms, host ms), both clocks from the same start
    (an idle GPU), and the end (GPU ms, host ms) after the last step: per phase, its GPU time and host
    time a step (from its mark to the next), and by how much the host was ahead of the GPU at its marks
    after the first step's (min and median; near 0: the GPU waited on the host there)."""
    per: dict[str, dict[str, list[float]]] = {name: {"gpu": [], "host": [], "lead": []} for name, _, _ in marks}
    first_step = len(per)  # the first step's marks: it starts on an idle GPU, the host never ahead
    bounds = [*marks, ("end", *end)]
    for i, (name, gpu, host) in enumerate(marks):
        per[name]["gpu"].append(bounds[i + 1][1] - gpu)
        per[name]["host"].append(bounds[i + 1][2] - host)
        if i >= first_step:
            per[name]["lead"].append(gpu - host)
    rows = []
    for name, row in per.items():
        lead = row["lead"]
        rows.append(
            [
                name,
                f"{sum(row['gpu']) / steps:.3f}",
                f"{sum(row['host']) / steps:.3f}",
                f"{min(lead):.2f}" if lead else "-",
                f"{statistics.median(lead):.2f}" if lead else "-",
            ]
        )
    rows.append(["step", f"{(end[0] - marks[0][1]) / steps:.3f}", f"{(end[1] - marks[0][2]) / steps:.3f}", "", ""])
    return rows


def phase_times_table(variant: Variant, steps: int) -> list[str]:
    """``--phase-steps``: ``steps`` unprofiled back-to-back steps with a CUDA event and the host clock at
    every phase start: where the step's GPU time goes, and whether the GPU ever waits on the host, without
    the profiler's host overhead (2-3x a compiled step's host time), and the SM clock meanwhile."""
    if variant.device.type != "cuda":
        return []
    torch.cuda.synchronize()
    variant.marks = []
    start_event = torch.cuda.Event(enable_timing=True)
    start_event.record()
    start = time.perf_counter()
    wall_start = time.time()
    for _ in range(steps):
        variant.step()
    end_event = torch.cuda.Event(enable_timing=True)
    end_event.record()
    end = time.perf_counter()
    torch.cuda.synchronize()
    wall_end = time.time()
    marks = [(name, start_event.elapsed_time(event), 1e3 * (at - start)) for name, event, at in variant.marks]
    variant.marks = None
    variant.release_grads()
    del variant.losses[-steps:]  # not steps of the comparison
    rows = phase_rows(marks, (start_event.elapsed_time(end_event), 1e3 * (end - start)), steps)
    clocks = watch_clocks()  # the process's samples (require_cuda started the watch)
    clock = clocks.summary([(wall_start, wall_end)]) if clocks else None
    header = ["phase", "GPU ms/step", "host ms/step", "host ahead, min ms", "host ahead, median ms"]
    return [
        *markdown_table(header, rows),
        "",
        f"SM clock during these steps: {clock.describe() if clock else 'n/a'}",
    ]


def phase_times(prof) -> list[str]:
    """Host time of each phase of the step against the device time of the kernels it launched: a
    phase whose host time is the larger leaves the device waiting (when nothing queued before it
    covers the difference)."""
    rows = []
    for evt in prof.events():
        if evt.name.startswith(PHASE):
            device = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
            rows.append([evt.name[len(PHASE) :], f"{evt.cpu_time_total / 1e3:.3f}", f"{device / 1e3:.3f}"])
    return markdown_table(["phase", "host ms", "device ms (kernels it launched)"], rows)


# Device work by kind, from the kernel's name (first match wins): where a step's time goes. Where the
# name does not say, what launched the kernel does (kernel_owners): some packages' kernels live in an
# unnamed namespace (xentropy's "(anonymous namespace)::backward_kernel"), cuDNN's attention helpers
# are named "cudnn...".
# Inductor's kernels first: their names list the ops they fused ("triton_red_fused_convolution_backward_
# native_batch_norm_backward_..."). Not "conv": ATen's names say "convert" (dtype casts).
KERNEL_KINDS = (
    ("Inductor (Triton)", ("triton",)),
    ("apex kernels", ("apex_", "apex::")),
    ("attention", ("flash", "sdpa", "fmha", "attention")),
    ("convolution", ("fprop", "dgrad", "wgrad", "convolution", "convolve", "cudnn")),
    ("matmul", ("nvjet", "gemm", "cutlass", "cublas", "xmma")),
    ("copies and fills", ("memcpy", "memset", "copy", "fill")),
    ("optimizer and norms (ATen)", ("multi_tensor", "foreach", "adam", "sgd", "norm")),
    ("other ATen elementwise and reductions", ("at::native",)),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def kernel_owners(prof) -> dict[str, str]:
    """Kernel name -> "apex" or "attention": what launched it, where its name does not say. The nearest
    CPU ancestor of the launch that is an apex op (``apex_<package>::<op>``, or its autograd node's)
    or an attention op (``aten::_cudnn_attention_backward``: cuDNN's helper kernels are named
    ``cudnn...``). Empty where this torch's profiler events do not link launches to ops."""
    owners: dict[str, str] = {}
    for evt in prof.events():
        kernels = getattr(evt, "kernels", None)
        if not kernels:
            continue
        owner, parent = None, evt
        while parent is not None and owner is None:
            name = parent.name
            if name.startswith("apex_") and "::" in name:
                owner = "apex"
            elif "attention" in name:
                owner = "attention"
            parent = getattr(parent, "cpu_parent", None)
        if owner is not None:
            for k in kernels:
                owners.setdefault(k.name, owner)
    return owners


def kernel_categories(prof) -> list[str]:
    """Device time of one profiled step by kind of kernel, and the share of the step's wall time
    the device was idle (host-bound gaps): the table behind a missed bar's note."""
    owners = kernel_owners(prof)
    total: dict[str, float] = {}
    first, last = None, None
    for evt in prof.events():
        if getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        if getattr(evt, "is_user_annotation", False) or evt.name.startswith(PHASE):
            continue  # a range on the device's timeline (the step's phases), not a kernel
        if SPIN_KERNEL in evt.name:
            continue  # the queue ahead of the profiled step
        us = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
        kind = kernel_kind(evt.name)
        owner = owners.get(evt.name)
        if owner == "apex" and kind == "other":
            kind = "apex kernels"
        elif owner == "attention" and kind in ("convolution", "other"):
            kind = "attention"
        total[kind] = total.get(kind, 0.0) + us
        start = evt.time_range.start
        end = evt.time_range.end
        first = start if first is None else min(first, start)
        last = end if last is None else max(last, end)
    busy = sum(total.values())
    span = (last - first) if first is not None else 0.0
    rows = [
        [kind, f"{us / 1e3:.3f}", f"{100 * us / busy:.1f}%"]
        for kind, us in sorted(total.items(), key=lambda kv: -kv[1])
    ]
    rows.append(["all kernels (device busy)", f"{busy / 1e3:.3f}", "100%"])
    rows.append(
        [
            "first kernel start to last kernel end",
            f"{span / 1e3:.3f}",
            f"idle {100 * (1 - busy / span):.1f}%" if span else "-",
        ]
    )
    return markdown_table(["kernels by kind", "ms", "share"], rows)


def graph_break_count() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def compiled_graph_count() -> int:
    """Graphs Dynamo has compiled so far: one that grows while timing means a recompile was timed."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def matmul_tflops(device: torch.device, smoke: bool) -> float:
    """The bf16 matmul rate of this device, measured now (dense n x n x n)."""
    n = 512 if smoke else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    if device.type == "cuda":
        ms = time_ms([lambda: torch.mm(a, b)], samples=10)
    else:
        torch.mm(a, b)
        start = time.perf_counter()
        for _ in range(3):
            torch.mm(a, b)
        ms = (time.perf_counter() - start) * 1e3 / 3
    return 2 * n**3 / (ms * 1e-3) / 1e12


# Running and reporting ---------------------------------------------------------------------


@dataclass
class Result:
    model: str
    spec: ModelSpec
    flops: int
    variants: list[Variant]
    profiles: dict[str, list[str]] = field(default_factory=dict)
    recompiles: int = 0  # graphs compiled during the timed rounds (should be none)
    phases: dict[str, list[str]] = field(default_factory=dict)  # --phase-steps tables by stack

    def ms(self, stack: str) -> float | None:
        v = self.get(stack)
        return statistics.median(v.turn_ms) if v is not None and v.turn_ms else None

    def get(self, stack: str) -> Variant | None:
        return next((v for v in self.variants if v.stack == stack), None)


def run_model(name: str, stacks: list[str], args, device: torch.device) -> Result:
    start = time.perf_counter()
    spec = model_spec(name, args.smoke, args.seed, args.resnet_bn, args.llama_linear)
    print(f"{name}: {spec.describe}; building {', '.join(stacks)}", file=sys.stderr, flush=True)
    torch.manual_seed(args.seed)
    with torch.device(device):
        reference = spec.build(Kit(apex=False))
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    del reference
    batches = spec.make_batches(device, args.batch_pool)
    flops = count_flops(spec, state, batches[0], device)

    variants = []
    for stack in stacks:
        # Built and warmed up one at a time: the peak over this stretch, less what the variants before
        # it hold, is this variant's own peak (weights, gradients, optimizer state, activations).
        if device.type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        breaks = graph_break_count()
        variant = build_variant(stack, spec, state, batches, device)
        warm_start = time.perf_counter()
        for i in range(args.warmup):
            variant.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            print(
                f"  {stack}: warm-up step {i + 1} done at {time.perf_counter() - start:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        variant.warmup_s = time.perf_counter() - warm_start
        if stack_env(stack)[0].endswith("compiled"):
            variant.graph_breaks = graph_break_count() - breaks
        if device.type == "cuda":
            torch.cuda.synchronize()
            variant.peak_bytes = torch.cuda.max_memory_allocated() - before
        variant.host_syncs = check_host_syncs(variant)
        variant.release_grads()
        variants.append(variant)
        print(
            f"  {stack}: built and warmed up ({args.warmup} steps) at {time.perf_counter() - start:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    del state

    graphs = compiled_graph_count()
    for r in range(args.rounds):
        for variant in variants[r % len(variants) :] + variants[: r % len(variants)]:
            turn_start = time.time()
            variant.turn_ms.append(timed_steps_ms(variant, args.steps))
            variant.turn_spans.append((turn_start, time.time()))
            variant.release_grads()
    # The SM clock while the turns ran (the process's watch; none on the CPU): a GPU at its power limit
    # clocks down under sustained load, which the figures carry and one profiled step does not show.
    clocks = watch_clocks() if device.type == "cuda" else None
    for variant in variants:
        variant.clock = clocks.summary(variant.turn_spans) if clocks else None
    recompiles = compiled_graph_count() - graphs
    for variant in variants:  # after the timed steps, as the profile
        variant.host_ms = host_step_ms(variant)
    phases = {}
    if args.phase_steps:  # unprofiled, before the profiles
        for variant in variants:
            phases[variant.stack] = phase_times_table(variant, args.phase_steps)
    profiles = {}
    if args.profile:  # after the timed steps, so the losses compared are those of unprofiled steps
        for variant in variants:
            trace = args.trace / f"{name}-{file_name(variant.stack)}.json.gz" if args.trace else None
            profiles[variant.stack] = profile_step(variant, args.profile, trace)
    if args.trace_steps:  # after the profiles, before the variants retire
        for variant in variants:
            trace_steps(variant, args.trace_steps, args.trace / f"{name}-{file_name(variant.stack)}-steps.json.gz")
    for variant in variants:
        variant.retire()
    del batches
    torch.compiler.reset()  # compiled graphs hold on to their modules
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"  {name} done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return Result(name, spec, flops, variants, profiles, recompiles, phases)


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def late_step(result: Result) -> int:
    return min(LATE_STEP, min(len(v.losses) for v in result.variants))


def table_rows(results: list[Result], rate_tflops: float) -> list[list[str]]:
    rows = []
    for res in results:
        per_step = (
            res.spec.cfg.batch * res.spec.cfg.seq if res.spec.unit == "tokens" else res.spec.cfg.batch
        )  # tokens or images
        late = late_step(res)
        native_compiled = res.ms("native-compiled")
        for v in res.variants:
            ms = res.ms(v.stack)
            mfu = res.flops / (ms * 1e-3) / (rate_tflops * 1e12) if ms else None
            rows.append(
                [
                    res.model,
                    v.stack,
                    fmt(ms, ".2f"),
                    fmt(v.host_ms, ".2f"),
                    fmt(per_step / (ms * 1e-3) if ms else None, ",.0f"),
                    fmt(100 * mfu if mfu is not None else None, ".3g") + ("%" if mfu is not None else ""),
                    fmt(v.peak_bytes / 2**30 if v.peak_bytes is not None else None, ".2f"),
                    f"{v.losses[0]:.4f}",
                    f"{v.losses[late - 1]:.4f}",
                    v.host_syncs,
                    "-" if v.graph_breaks is None else str(v.graph_breaks),
                    fmt(v.warmup_s, ".1f"),
                    fmt(v.clock.median_mhz if v.clock else None, ".0f"),
                    clock_limit(v.clock),
                    fmt(native_compiled / ms if native_compiled and ms else None, ".3f") + "x" * bool(native_compiled),
                ]
            )
    return rows


def clock_limit(clock: ClockSummary | None) -> str:
    """The table's cell for what held the clock down during the timed turns: ``power cap 100%``."""
    if clock is None:
        return "n/a"
    return f"{'/'.join(clock.reasons)} {100 * clock.limited:.0f}%" if clock.reasons else "none"


def verdicts(results: list[Result], loss_rtol: float) -> list[str]:
    lines = []
    for res in results:
        m = res.model
        if res.recompiles:
            lines.append(f"WARN: {m}: {res.recompiles} graphs were compiled during the timed rounds (more --warmup)")
        native_compiled = res.ms("native-compiled")
        apex_ms = [res.ms(s) for s in ("apex-eager", "apex-compiled") if res.ms(s) is not None]
        if native_compiled is None:
            lines.append(f"SKIP: {m}: the speed and memory bars compare against native-compiled, not run")
        else:
            if apex_ms and m in SPEEDUP_BAR:
                lines.append(
                    verdict(
                        f"{m}: apex (faster stack) / native compiled", native_compiled / min(apex_ms), SPEEDUP_BAR[m]
                    )
                )
            if res.ms("apex-eager") is not None and m in EAGER_BAR:
                lines.append(
                    verdict(f"{m}: apex eager / native compiled", native_compiled / res.ms("apex-eager"), EAGER_BAR[m])
                )
            nc_peak = res.get("native-compiled").peak_bytes
            for stack in ("apex-eager", "apex-compiled"):
                v = res.get(stack)
                if v is not None and v.peak_bytes and nc_peak:
                    lines.append(verdict(f"{m}: native compiled peak memory / {stack}'s", nc_peak / v.peak_bytes, 1.0))
        for stack in ("apex-eager", "apex-compiled"):
            v = res.get(stack)
            if v is not None and v.host_syncs != "n/a (CPU)":
                lines.append(f"{'PASS' if v.host_syncs == 'pass' else 'FAIL'}: {m}: no host sync in a {stack} step")
            if v is not None and v.graph_breaks:
                lines.append(f"FAIL: {m}: {stack} has {v.graph_breaks} graph breaks (a bug to fix)")
        base = res.get("native-eager") or res.variants[0]
        late = late_step(res)
        for v in res.variants:
            if v is base:
                continue
            ref, got = base.losses[late - 1], v.losses[late - 1]
            ok = abs(got - ref) <= loss_rtol * abs(ref)
            lines.append(
                f"{'PASS' if ok else 'FAIL'}: {m}: {v.stack} loss at step {late} {got:.4f} within "
                f"{100 * loss_rtol:g}% of {base.stack}'s {ref:.4f}"
            )
    return lines


def plot(results: list[Result], path: Path) -> None:
    title = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    draw({r.model: {s: r.ms(s) for s in STACKS if r.ms(s)} for r in results}, title, path)


def read_reports(paths: list[Path]) -> tuple[dict[str, dict[str, float]], str]:
    """ms/step per model and stack from reports this benchmark wrote (--out), and their device."""
    ms: dict[str, dict[str, float]] = {}
    device = ""
    for path in paths:
        for line in path.read_text().splitlines():
            if line.startswith("- device:") and not device:
                device = line.split(":", 1)[1].split(";")[0].strip()
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) > 3 and cells[1] in STACKS:
                try:
                    ms.setdefault(cells[0], {})[cells[1]] = float(cells[2])
                except ValueError:
                    continue
    return ms, device


def draw(ms: dict[str, dict[str, float]], title: str, path: Path) -> None:
    """Bars of ms/step, one group per model, one bar per stack."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{NAME}: --plot {path}: matplotlib is not installed (pip install matplotlib); no plot written")
        return
    models = list(ms)
    stacks = [s for s in STACKS if any(s in ms[m] for m in models)]
    # One panel per model: their step times differ by an order of magnitude.
    fig, axes = plt.subplots(1, len(models), figsize=(1.2 + 2.6 * len(models), 4), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, model in zip(axes[0], models):
        ys = [ms[model].get(stack, 0.0) for stack in stacks]
        bars = ax.bar(range(len(stacks)), ys, color=colors[: len(stacks)])
        ax.bar_label(bars, labels=[f"{y:.1f}" if y else "" for y in ys], fontsize=7)
        ax.set_xticks(range(len(stacks)), stacks, rotation=30, ha="right", fontsize=8)
        ax.set_title(model)
    axes[0][0].set_ylabel("ms / step (lower is better)")
    fig.suptitle(f"one training step, {title}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    print(f"{NAME}: plot written to {path}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2,llama1b,resnet50", help="comma-separated: gpt2, llama1b, resnet50")
    p.add_argument("--stacks", default=",".join(STACKS), help=f"comma-separated: {', '.join(STACKS)}")
    p.add_argument("--steps", type=int, default=10, help="back-to-back steps per timed turn")
    p.add_argument("--rounds", type=int, default=5, help="rounds of turns (ms/step is their median)")
    p.add_argument("--warmup", type=int, default=3, help="steps per variant before timing (compiles)")
    p.add_argument("--batch-pool", type=int, default=8, help="distinct batches cycled through (same for all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss-rtol", type=float, default=0.03, help="late-step losses agree within this fraction")
    p.add_argument(
        "--resnet-bn",
        choices=("apex", "torch"),
        default="torch",
        help="the apex stacks' ResNet-50 batch norms: torch's, or apex SyncBatchNorm with fused ReLU and residual add",
    )
    p.add_argument(
        "--llama-linear",
        choices=("apex", "torch"),
        default="torch",
        help="the apex stacks' Llama projections (bias-free): nn.Linear, or apex FusedDense(bias=False)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny models, 1 step per turn, 1 round; CPU allowed")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="cpu only with --smoke")
    p.add_argument(
        "--profile", type=int, default=0, metavar="ROWS", help="append a profiler table of one step per variant"
    )
    p.add_argument(
        "--trace",
        type=Path,
        metavar="DIR",
        help="with --profile: also write each profiled step's Chrome trace to DIR/<model>-<stack>.json.gz "
        "(benchmarks/trace_gaps.py reads them)",
    )
    p.add_argument(
        "--trace-steps",
        type=int,
        default=0,
        metavar="N",
        help="with --trace: also trace N back-to-back steps per variant to DIR/<model>-<stack>-steps.json.gz",
    )
    p.add_argument(
        "--phase-steps",
        type=int,
        default=0,
        metavar="N",
        help="append each variant's GPU and host time per step phase over N unprofiled back-to-back steps "
        "(CUDA events at the phase starts), with how far the host ran ahead",
    )
    p.add_argument("--out", type=Path, help=f"also write the report to DIR/{NAME}.md")
    p.add_argument("--plot", type=Path, help="a bar chart of ms/step per model and stack (needs matplotlib)")
    p.add_argument(
        "--plot-from",
        type=Path,
        nargs="+",
        metavar="REPORT",
        help="only draw --plot from reports written before (--out), e.g. one per model; runs nothing",
    )
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    if not args.stacks:
        p.error(f"--stacks: none given; choose from {', '.join(STACKS)}")
    for stack in args.stacks:
        try:
            stack_env(stack)
        except ValueError as exc:
            p.error(f"--stacks: {exc}")
    # A fixed order for the table: STACKS', each stack's +VAR=VALUE variants after it as given.
    args.stacks = sorted(dict.fromkeys(args.stacks), key=lambda s: STACKS.index(stack_env(s)[0]))
    if args.smoke:
        defaults = {"steps": 10, "rounds": 5, "warmup": 3, "batch_pool": 8}
        for key, small in {"steps": 1, "rounds": 1, "warmup": 1, "batch_pool": 2}.items():
            if getattr(args, key) == defaults[key]:
                setattr(args, key, small)
    if args.trace is not None:
        if not args.profile:
            p.error("--trace needs --profile ROWS (the trace is of the profiled step)")
        args.trace.mkdir(parents=True, exist_ok=True)
    if args.trace_steps < 0 or (args.trace_steps and args.trace is None):
        p.error("--trace-steps N needs --trace DIR (and N >= 0)")
    if args.phase_steps < 0:
        p.error("--phase-steps N needs N >= 0")
    if min(args.steps, args.rounds, args.batch_pool) < 1 or args.warmup < 0:
        p.error("--steps, --rounds and --batch-pool must be positive, --warmup not negative")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot_from:
        if args.plot is None:
            print(f"{NAME}: --plot-from needs --plot PATH", file=sys.stderr)
            return 1
        ms, device = read_reports(args.plot_from)
        if not ms:
            print(f"{NAME}: no bench_e2e table in {', '.join(map(str, args.plot_from))}", file=sys.stderr)
            return 1
        draw(ms, device or "unknown device", args.plot)
        return 0
    if args.device == "cpu" or (args.device == "auto" and args.smoke and not torch.cuda.is_available()):
        if not args.smoke:
            print(f"{NAME}: the CPU runs only --smoke", file=sys.stderr)
            return 1
        device = torch.device("cpu")
    else:
        if not require_cuda(NAME):
            return 1
        device = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cudnn.benchmark = True  # as upstream Apex's ImageNet example
    rate = matmul_tflops(device, args.smoke)
    results = [run_model(name, args.stacks, args, device) for name in args.models]

    header = [
        "model",
        "stack",
        "ms/step",
        "host ms/step",
        "tokens (images) /s",
        "MFU",
        "peak GiB",
        "loss @1",
        "loss @late",
        "host syncs",
        "graph breaks",
        "warm-up s",
        "SM MHz",
        "clock limit",
        "native compiled / this",
    ]
    body = markdown_table(header, table_rows(results, rate))
    body += ["", *verdicts(results, args.loss_rtol)]
    for res in results:
        for stack, table in res.phases.items():
            if table:
                title = f"## phases: {res.model}, {stack} ({args.phase_steps} unprofiled steps, CUDA events)"
                body += ["", title, "", *table]
        for stack, table in res.profiles.items():
            body += ["", f"## profile: {res.model}, {stack} (one step)", "", *table]
    notes = [
        f"bf16 matmul rate measured in this run: {rate:.4g} TFLOP/s (MFU's denominator)",
        "models: " + "; ".join(f"{r.model}: {r.spec.describe}" for r in results),
        "model FLOPs per step (FlopCounterMode, native forward + backward): "
        + ", ".join(f"{r.model} {r.flops / 1e9:,.4g} GFLOP" for r in results),
        f"timing: {args.warmup} warm-up steps per variant, then {args.rounds} rounds of {args.steps} steps per "
        "variant in turns; ms/step is the median of rounds",
        "loss @late: step " + ", ".join(f"{r.model} {late_step(r)}" for r in results) + f" (step {LATE_STEP} when run)",
        "torch.compile in its default mode on the model and its loss; clipping and the optimizer step eager",
        "peak GiB: a variant's own peak (build and warm-up, less what the variants before it hold)",
        "host ms/step: one step's host time with the GPU kept busy (a spin kernel queued ahead; median of "
        f"{HOST_PROBE_STEPS}): near ms/step, the GPU waits on the host",
        "warm-up s: wall time of the warm-up steps, torch.compile's tracing and code generation included",
        "SM MHz, clock limit: the median SM clock of nvidia-smi's samples (every 50 ms) during the variant's "
        "timed turns, and the share of them with a clock-limit reason active (n/a: no nvidia-smi). A GPU at "
        "its power cap runs the timed steps below the clock of the one profiled step",
    ]
    if args.smoke:
        notes.append("smoke run: tiny models; the timings and the bars say nothing about the full sizes")
    report(NAME, body, out=args.out, notes=notes, cpu=device.type == "cpu")
    if args.plot is not None:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
