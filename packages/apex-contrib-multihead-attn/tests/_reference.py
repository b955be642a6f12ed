"""Float64 references written from the definition (one head and one sequence at a time), shared by the tests."""

from __future__ import annotations

import math

import torch


def on_input(t, x):
    """``t`` (a parameter, maybe on another device, or None) in float64 on ``x``'s device, still
    differentiable: the reference runs where its input is (the CPU), whatever module it reads."""
    return None if t is None else t.to(device=x.device, dtype=torch.float64)


def layer_norm(x, gamma, beta, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * gamma + beta


def attention(q, k, v, key_padding_mask=None, attn_mask=None, additive=None):
    """q [Tq, B, H, d], k and v [Tk, B, H, d] -> [Tq, B, H * d], by loops over sequences and heads."""
    tq, batch, heads, d = q.shape
    out = torch.empty(tq, batch, heads, d, dtype=q.dtype, device=q.device)
    for b in range(batch):
        for h in range(heads):
            scores = q[:, b, h] @ k[:, b, h].T / math.sqrt(d)
            if key_padding_mask is not None:
                scores = scores.masked_fill(key_padding_mask[b].bool()[None, :], -math.inf)
            if additive is not None:
                scores = scores + additive[b].double()[None, :]
            if attn_mask is not None:
                scores = scores.masked_fill(attn_mask.bool(), -math.inf)
            out[:, b, h] = torch.softmax(scores, dim=-1) @ v[:, b, h]
    return out.reshape(tq, batch, heads * d)


def self_attention(x, w_in, b_in, w_out, b_out, heads, norm=None, **masks):
    """Upstream's SelfMultiheadAttn in eval: in_proj rows grouped per head as (q, k, v)."""
    x = x.double()
    t, batch, e = x.shape
    d = e // heads
    w_in, b_in, w_out, b_out = (on_input(p, x) for p in (w_in, b_in, w_out, b_out))
    h = layer_norm(x, *(on_input(p, x) for p in norm)) if norm is not None else x
    proj = h @ w_in.T + (0 if b_in is None else b_in)
    proj = proj.view(t, batch, heads, 3, d)
    out = attention(proj[..., 0, :], proj[..., 1, :], proj[..., 2, :], **masks)
    out = out @ w_out.T + (0 if b_out is None else b_out)
    return x + out if norm is not None else out


def encdec_attention(x, mem, w_q, w_kv, w_out, heads, biases=(None, None, None), norm=None, **masks):
    """Upstream's EncdecMultiheadAttn in eval: kv rows grouped per head as (k, v)."""
    x, mem = x.double(), mem.to(device=x.device, dtype=torch.float64)
    tq, batch, e = x.shape
    d = e // heads
    w_q, w_kv, w_out = (on_input(w, x) for w in (w_q, w_kv, w_out))
    b_q, b_kv, b_out = (0 if b is None else on_input(b, x) for b in biases)
    h = layer_norm(x, *(on_input(p, x) for p in norm)) if norm is not None else x
    q = (h @ w_q.T + b_q).view(tq, batch, heads, d)
    kv = (mem @ w_kv.T + b_kv).view(mem.shape[0], batch, heads, 2, d)
    out = attention(q, kv[..., 0, :], kv[..., 1, :], **masks) @ w_out.T + b_out
    return x + out if norm is not None else out
