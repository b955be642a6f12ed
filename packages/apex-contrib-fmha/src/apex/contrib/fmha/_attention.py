"""Packed variable-length self-attention: argument checks, the path choice, and the three paths.

Layout (upstream's): ``qkv [total_tokens, 3, heads, head_dim]`` holds each token's query, key and
value rows; the sequences lie back to back, sequence ``i`` in rows ``cu_seqlens[i]:cu_seqlens[i+1]``
(``cu_seqlens`` int32 ``[batch + 1]``, 0 first). Each token attends to every token of its own
sequence: ``softmax(q k^T / sqrt(head_dim))``, dropout on those probabilities when training (kept
ones scaled by ``1 / (1 - p_dropout)``), times ``v``. The output is ``[total_tokens, heads, head_dim]``.

Paths (``plan``), all differentiable by autograd through public torch ops:

- ``"varlen"``: FlashAttention over the packed rows (no padding), on CUDA sm80+ for
  float16/bfloat16, head_dim a multiple of 8 up to 256, and no active dropout: under
  ``torch.compile`` ``torch.nn.attention.varlen.varlen_attn`` (a custom op; it has no dropout
  argument), in eager mode the same kernels as ``"flash"`` without the custom op's host time. Only
  where torch has ``varlen_attn`` (2.10+).
- ``"flash"``: dropout where FlashAttention takes the inputs (as for ``"varlen"``): torch's own
  FlashAttention varlen forward and backward (``aten::_flash_attention_forward`` / ``_backward``,
  what ``varlen_attn`` and SDPA call) over the packed rows with ``cu_seqlens``, in an
  ``autograd.Function`` that keeps the RNG state for the backward. Not while ``torch.compile``
  traces.
- ``"nested"``: ``scaled_dot_product_attention`` on jagged nested tensors that view the packed rows
  (no padding): the other CUDA cases without dropout (memory-efficient kernel, e.g. float32). Not
  while ``torch.compile`` traces. (It took dropout too until SDPA on jagged inputs with
  ``requires_grad`` was measured at 10-14 ms where the flash path's kernels take under 1 ms.)
- ``"dense"``: every device but CUDA (the CPU): the same padded batch as ``"padded"`` with a
  key-padding mask, through one ``scaled_dot_product_attention`` call (PyTorch's fused CPU kernel),
  in float32 for 16-bit input and rounded once. On 2 CPU cores, inference at BERT shapes took
  0.3-0.7x the reference's time (8x512 float32: 206 against 604 ms), training about the same.
- ``"padded"``: the reference: the sequences padded to ``max_s`` in one batch, explicit matmul,
  softmax with a key-padding mask and dropout, in float32 for 16-bit input (float64 for float64),
  rounded once. Every other device (the CPU); on CUDA, dropout that FlashAttention cannot take
  (e.g. float32: torch's memory-efficient kernel on jagged inputs reuses one dropout mask for every
  head and sequence of a call), and everything but ``"varlen"`` while ``torch.compile`` traces
  (nested tensors do not survive the graph break SDPA makes on them into the backward).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - older torch
    _varlen_attn = None

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PATHS = ("varlen", "flash", "nested", "dense", "padded")


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def check(name, qkv, cu_seqlens, p_dropout, max_s, zero_tensors) -> int | None:
    """Raise on malformed input, naming the argument; return the number of packed tokens
    (``cu_seqlens[-1]``), or None while torch.compile traces (the values are not read then).

    Reading ``cu_seqlens``' values is one small device-to-host copy (``batch + 1`` ints), made once
    per ``cu_seqlens`` tensor: the result is remembered on the tensor with its version counter and
    the other arguments it depends on, so the next calls of a step (every layer takes the same
    ``cu_seqlens``) neither read nor wait. Writing into the tensor in place bumps its version, and
    the next call checks again."""
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"{name}: qkv must be a tensor, got {type(qkv).__name__}")
    if qkv.dtype not in DTYPES and qkv.dtype != torch.float64:
        raise TypeError(f"{name}: qkv has dtype {qkv.dtype}; expected float32, float16, bfloat16 (or float64)")
    if qkv.dim() != 4 or qkv.shape[1] != 3 or qkv.shape[2] == 0 or qkv.shape[3] == 0:
        raise ValueError(
            f"{name}: qkv has shape {tuple(qkv.shape)}; expected [total_tokens, 3, heads, head_dim] "
            "with heads, head_dim > 0"
        )
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name}: cu_seqlens must be a tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{name}: cu_seqlens has dtype {cu_seqlens.dtype}; expected torch.int32")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"{name}: cu_seqlens has shape {tuple(cu_seqlens.shape)}; expected [batch + 1] with batch >= 1"
        )
    if cu_seqlens.device != qkv.device:
        raise ValueError(f"{name}: cu_seqlens is on {cu_seqlens.device}, qkv on {qkv.device}")
    if isinstance(max_s, bool) or not isinstance(max_s, int) or max_s <= 0:
        raise ValueError(f"{name}: max_s must be a positive int, got {max_s!r}")
    if not 0.0 <= p_dropout < 1.0:  # false for NaN too
        raise ValueError(f"{name}: p_dropout must be in [0, 1), got {p_dropout}")
    if _compiling():
        return None
    total = qkv.shape[0]
    key = (cu_seqlens._version, total, max_s, bool(zero_tensors))
    memo = getattr(cu_seqlens, _CHECKED, None)
    if memo is not None and memo[0] == key:
        return memo[1]
    offsets = _read_offsets(cu_seqlens)
    if offsets[0] != 0:
        raise ValueError(f"{name}: cu_seqlens must start at 0, got {offsets[0]}")
    lengths = [end - start for start, end in itertools.pairwise(offsets)]
    if min(lengths) < 0:
        raise ValueError(f"{name}: cu_seqlens must be non-decreasing, got {offsets}")
    if max(lengths) > max_s:
        raise ValueError(f"{name}: a sequence has {max(lengths)} tokens (from cu_seqlens), more than max_s={max_s}")
    used = offsets[-1]
    if used > total or (used < total and not zero_tensors):
        raise ValueError(
            f"{name}: cu_seqlens ends at {used} but qkv has {total} tokens; they must be equal "
            "(or, with zero_tensors=True, cu_seqlens[-1] < total_tokens: the rows past it are zeroed)"
        )
    setattr(cu_seqlens, _CHECKED, (key, used))
    return used


_CHECKED = "_apex_fmha_checked"  # the attribute check() leaves on a cu_seqlens it has validated


def _read_offsets(cu_seqlens) -> list[int]:
    return cu_seqlens.tolist()  # the one device-to-host copy (and wait) of a call


@torch.compiler.assume_constant_result
def _flash_capable(device_index: int) -> bool:
    """FlashAttention's floor, sm80 (a constant to torch.compile, which need not trace the query)."""
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def _flash_eligible(qkv) -> bool:
    """FlashAttention takes these inputs: CUDA sm80+, float16/bfloat16, head_dim a multiple of 8 up to 256."""
    head_dim = qkv.shape[-1]
    return (
        _flash_capable(qkv.device.index)
        and qkv.dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 256
    )


def plan(qkv, p_dropout, is_training) -> str:
    """The path for these inputs (see the module docstring)."""
    if qkv.device.type != "cuda":
        return "dense"
    dropout = is_training and p_dropout > 0.0
    flash = _flash_eligible(qkv)
    if flash and not dropout and _varlen_attn is not None:
        return "varlen"
    if _compiling():
        # Nested tensors cannot cross a graph break, and SDPA on them breaks the graph to read the
        # shortest length: the backward then fails in AOTAutograd ("expected len(meta.attrs) ==
        # len(runtime_subclass_keys)"). The padded path traces to one graph.
        return "padded"
    if dropout and not flash:
        # Only the memory-efficient kernel would be left, and on jagged inputs it draws one
        # dropout mask for every head and sequence of a call (its RNG offset per (sequence, head)
        # is computed from a key length of 0); the padded path draws each element independently.
        return "padded"
    return "flash" if dropout else "nested"


def attention(qkv, cu_seqlens, p_dropout, max_s, is_training, zero_tensors, *, name, path=None):
    """The context ``[total_tokens, heads, head_dim]`` (see the module docstring); ``path`` forces one."""
    used = check(name, qkv, cu_seqlens, p_dropout, max_s, zero_tensors)
    path = path or plan(qkv, p_dropout, is_training)
    if path not in PATHS:
        raise ValueError(f"{name}: path must be one of {PATHS}, got {path!r}")
    dropout_p = float(p_dropout) if is_training else 0.0
    if path == "padded":
        return padded_attention(qkv, cu_seqlens, max_s, dropout_p)[0]
    if path == "dense":
        return dense_attention(qkv, cu_seqlens, max_s, dropout_p)
    total = qkv.shape[0]
    used = total if used is None else used
    packed = qkv[:used] if used < total else qkv
    if path == "varlen":
        if dropout_p > 0.0:
            raise ValueError(f"{name}: the varlen path has no dropout; p_dropout={p_dropout} with is_training")
        # FlashAttention takes any row strides but needs each head's features contiguous.
        q, k, v = (packed if packed.stride(-1) == 1 else packed.contiguous()).unbind(1)
        if _compiling():  # a custom op with a fake: one graph
            out = _varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_s, max_s)
        else:  # the same kernels without the custom op's layers (host time: see _flash)
            out = _flash(q, k, v, cu_seqlens, max_s, 0.0)
    elif path == "flash":
        q, k, v = (packed if packed.stride(-1) == 1 else packed.contiguous()).unbind(1)
        out = _flash(q, k, v, cu_seqlens, max_s, dropout_p)
    else:
        out = _nested_attention(packed, cu_seqlens, max_s, dropout_p)
    if used < total:
        out = torch.cat([out, out.new_zeros((total - used, *out.shape[1:]))])
    return out


def _flash(q, k, v, cu_seqlens, max_s, dropout_p):
    """FlashAttention varlen on packed ``q, k, v``: through :class:`_FlashVarlen` where a gradient is
    to be recorded, else torch's forward op alone. In eager mode both ``"varlen"`` and ``"flash"`` come
    here: ``varlen_attn`` runs the same forward and backward ops behind a Python custom op, whose
    layers cost host time that showed at small shapes (H100, 2026-12-05: inference at 64x128 took
    0.056-0.073 ms a call against 0.042-0.052 for padded SDPA; the kernels take less)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _FlashVarlen.apply(q, k, v, cu_seqlens, max_s, dropout_p)
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_s, max_s, dropout_p, False, False
    )[0]


class _FlashVarlen(torch.autograd.Function):
    """FlashAttention over packed rows ``q, k, v [used, heads, d]`` (each head's features contiguous)
    with dropout: torch's varlen forward, and its backward replaying the forward's dropout mask from
    the RNG state the forward returned. Each (sequence, head, query, key) element draws its own
    keep bit from the CUDA generator (Philox), as SDPA's flash backend does."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_s, dropout_p):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_s, max_s, dropout_p, False, False
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng_state, unused)
        ctx.max_s, ctx.dropout_p = max_s, dropout_p
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu_seqlens, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, ctx.max_s, ctx.max_s,
            ctx.dropout_p, False, rng_state, unused,
        )  # fmt: skip
        return dq, dk, dv, None, None, None


def _nested_attention(packed, cu_seqlens, max_s, dropout_p):
    offsets = cu_seqlens.to(torch.int64)

    def jagged(rows):  # [used, heads, d] -> [batch, heads, (lengths), d]
        return torch.nested.nested_tensor_from_jagged(rows.contiguous(), offsets, max_seqlen=max_s).transpose(1, 2)

    q, k, v = (jagged(rows) for rows in packed.unbind(1))
    if dropout_p > 0.0:
        # Flash draws an independent mask per (sequence, head); the memory-efficient kernel does
        # not on jagged inputs (see plan), so it is never used with dropout: where flash is
        # refused (e.g. a sequence of length 0), SDPA's math backend is.
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    else:
        out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).values()


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _layout(cu_seqlens, total, max_s):
    """Index tensors between the packed rows and a ``[batch, max_s]`` padded batch (no host sync):
    ``gather [batch, max_s]`` (a packed row per padded slot; ``total`` for an empty slot),
    ``key_valid [batch, max_s]``, and ``scatter [total]`` (a padded slot per packed row;
    ``batch * max_s``, an extra zero row, for rows past ``cu_seqlens[-1]``)."""
    starts = cu_seqlens[:-1].to(torch.int64)
    lengths = cu_seqlens[1:].to(torch.int64) - starts
    batch = lengths.shape[0]
    slot = torch.arange(max_s, device=cu_seqlens.device)
    valid = slot < lengths[:, None]
    gather = torch.where(valid, starts[:, None] + slot, total)
    # An empty sequence's slots attend to all its (unused) keys rather than to none, which gives NaN.
    key_valid = valid | (lengths == 0)[:, None]
    row = torch.arange(total, device=cu_seqlens.device)
    sequence = torch.searchsorted(cu_seqlens[1:].to(torch.int64), row, right=True)
    inside = sequence < batch
    sequence = sequence.clamp(max=batch - 1)
    scatter = torch.where(inside, sequence * max_s + row - starts[sequence], batch * max_s)
    return gather, key_valid, scatter


def _padded(qkv, cu_seqlens, max_s):
    """``(q, k, v, key_valid, unpad)`` of the padded batch: ``q, k, v [batch, heads, max_s, d]`` in
    float32 for 16-bit ``qkv`` (float64 for float64), ``key_valid [batch, max_s]`` and ``unpad``,
    which takes a context ``[batch, max_s, heads, d]`` back to the packed ``[total, heads, d]`` rows in
    ``qkv``'s dtype (rows past ``cu_seqlens[-1]`` zero)."""
    total, _, heads, head_dim = qkv.shape
    compute = _compute_dtype(qkv.dtype)
    gather, key_valid, scatter = _layout(cu_seqlens, total, max_s)
    rows = torch.cat([qkv.to(compute), qkv.new_zeros((1, 3, heads, head_dim), dtype=compute)])
    padded = rows[gather]  # [batch, max_s, 3, heads, d]
    q, k, v = (padded[:, :, i].transpose(1, 2) for i in range(3))  # [batch, heads, max_s, d]

    def unpad(context):
        flat = torch.cat([context.reshape(-1, heads, head_dim), context.new_zeros((1, heads, head_dim))])
        return flat[scatter].to(qkv.dtype)

    return q, k, v, key_valid, unpad


def dense_attention(qkv, cu_seqlens, max_s, dropout_p):
    """The ``"dense"`` path: ``[total, heads, d]`` from one SDPA call over the padded batch (the
    layout of :func:`padded_attention`, a boolean key-padding mask), computed in float32 for 16-bit
    ``qkv`` (float64 for float64) and rounded once; rows past ``cu_seqlens[-1]`` are zero."""
    q, k, v, key_valid, unpad = _padded(qkv, cu_seqlens, max_s)
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=key_valid[:, None, None, :], dropout_p=dropout_p)
    return unpad(context.transpose(1, 2))


def padded_attention(qkv, cu_seqlens, max_s, dropout_p, keep=None, generator=None):
    """The reference path: ``(context [total, heads, d], probs [batch, heads, max_s, max_s],
    scores, keep)`` with ``probs`` the softmax before dropout, ``scores`` the scaled, masked
    scores it came from (float32, or float64 for float64 ``qkv``) and ``keep`` the dropout mask
    (bool, True = kept; None without dropout). A given ``keep`` is used instead of drawing one."""
    q, k, v, key_valid, unpad = _padded(qkv, cu_seqlens, max_s)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(qkv.shape[-1]))
    scores = scores.masked_fill(~key_valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    dropped = probs
    if keep is None and dropout_p > 0.0:
        noise = torch.rand(probs.shape, device=probs.device, dtype=probs.dtype, generator=generator)
        keep = noise >= dropout_p
    if keep is not None and dropout_p > 0.0:
        dropped = probs * keep * (1.0 / (1.0 - dropout_p))
    context = torch.matmul(dropped, v).transpose(1, 2)  # [batch, max_s, heads, d]
    return unpad(context), probs, scores, keep
