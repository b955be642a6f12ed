"""The float64 oracle of the tests: attention one sequence at a time (no padding, no packing tricks)."""

from __future__ import annotations

import math

import torch


def cu_seqlens_of(lengths, device="cpu"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def random_qkv(lengths, heads, head_dim, dtype, device, extra_rows=0):
    """Normal ``[sum(lengths) + extra_rows, 3, heads, head_dim]`` values, exact in ``dtype``."""
    shape = (sum(lengths) + extra_rows, 3, heads, head_dim)
    return torch.randn(shape, dtype=torch.float64).to(dtype).to(device)


def attention(qkv, lengths, p_dropout=0.0, keep=None):
    """Context ``[sum(lengths), heads, head_dim]`` in float64 (differentiable in ``qkv``): for each
    sequence ``softmax(q k^T / sqrt(d))``, times ``keep / (1 - p)`` where ``keep [batch, heads, S, S]``
    (bool, True = kept; its top-left ``length x length`` block is used) is given, times ``v``."""
    qkv = qkv.double()
    scale = 1.0 / math.sqrt(qkv.shape[-1])
    outputs, start = [], 0
    for index, length in enumerate(lengths):
        q, k, v = qkv[start : start + length].unbind(1)  # [length, heads, d]
        probs = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * scale, dim=-1)
        if keep is not None:
            probs = probs * keep[index, :, :length, :length].double() / (1.0 - p_dropout)
        outputs.append(torch.einsum("hqk,khd->qhd", probs, v))
        start += length
    return torch.cat(outputs)


def probabilities(qkv, lengths, max_s):
    """``[batch, heads, max_s, max_s]`` softmax probabilities in float64; NaN outside each sequence's block."""
    qkv = qkv.double()
    batch, heads = len(lengths), qkv.shape[2]
    out = torch.full((batch, heads, max_s, max_s), float("nan"), dtype=torch.float64, device=qkv.device)
    start = 0
    for index, length in enumerate(lengths):
        q, k, _ = qkv[start : start + length].unbind(1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(qkv.shape[-1])
        out[index, :, :length, :length] = torch.softmax(scores, dim=-1)
        start += length
    return out
