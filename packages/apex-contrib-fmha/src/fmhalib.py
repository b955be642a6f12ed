"""Upstream Apex's ``fmhalib`` extension module, on apex.contrib.fmha's reference path (torch ops).

- ``fwd(qkv, cu_seqlens, p_dropout, max_s, is_training, is_nl, zero_tensors, generator)
  -> [context, S_dmask]``: ``context [total_tokens, heads, head_dim]``, and ``S_dmask
  [batch, heads, max_s, max_s]`` in ``qkv``'s dtype: the attention probabilities before dropout,
  with the sign bit set on the ones dropout removed (upstream's encoding of its dropout mask).
- ``fwd_nl(...)``: the same as ``fwd`` (upstream's small-batch variant; its ``FMHAFun`` called
  ``fwd_nl`` for batch < 4 with ``fwd``'s arguments although the extension at its removal no
  longer bound it).
- ``bwd(dout, qkv, S_dmask, cu_seqlens, p_dropout, max_s, zero_tensors) -> [dqkv, dS]``.
- ``bwd_nl(dout, qkv, S_dmask, cu_seqlens, p_dropout, max_s, zero_tensors) -> [dqkv, dS, dkv]``.

``qkv`` is ``[total_tokens, 3, heads, head_dim]``, ``cu_seqlens`` int32 ``[batch + 1]`` (see
``apex.contrib.fmha.FMHAFun``). ``generator`` is None or a ``torch.Generator`` of ``qkv``'s device;
``is_nl`` (upstream's choice of a small-batch kernel) changes nothing here.

Differences from upstream (on purpose): any float dtype and device (upstream: fp16 CUDA, head_dim
64, max_s up to 512 on sm80/sm90); ``S_dmask``'s last two dimensions are ``max_s`` (upstream: max_s
rounded up to 128/256/384/512); the backwards recompute the probabilities from ``qkv`` in float32
and read only the dropout mask (the sign bits) from ``S_dmask``, so ``S_dmask`` is not overwritten
and a backward after a non-training forward must get ``p_dropout=0.0`` or the forward's ``S_dmask``
(which has no sign bits set); the second result ``dS [batch, heads, max_s, max_s]`` is the gradient
of the scaled, masked attention scores (the input of the softmax), a new tensor; ``bwd_nl``'s
``dkv`` is ``[total_tokens, 1, 2, heads, head_dim]``, one "chunk" holding dK and dV (upstream:
2 to 4 partial chunks that sum to them; summing over dimension 1 gives the same either way).
"""

from __future__ import annotations

import torch

from apex.contrib.fmha import _attention
from apex.core import __version__

__all__ = ["__version__", "bwd", "bwd_nl", "fwd", "fwd_nl"]


def _forward(name, qkv, cu_seqlens, p_dropout, max_s, is_training, zero_tensors, generator):
    _attention.check(name, qkv, cu_seqlens, p_dropout, max_s, zero_tensors)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"{name}: generator must be None or a torch.Generator, got {type(generator).__name__}")
    dropout_p = float(p_dropout) if is_training else 0.0
    with torch.no_grad():
        context, probs, _, keep = _attention.padded_attention(qkv, cu_seqlens, max_s, dropout_p, generator=generator)
        s_dmask = probs.to(qkv.dtype)
        if keep is not None:
            s_dmask = torch.where(keep, s_dmask, -s_dmask)
    return [context, s_dmask]


def fwd(qkv, cu_seqlens, p_dropout, max_s, is_training, is_nl, zero_tensors, generator):
    return _forward("fmhalib.fwd", qkv, cu_seqlens, p_dropout, max_s, is_training, zero_tensors, generator)


def fwd_nl(qkv, cu_seqlens, p_dropout, max_s, is_training, is_nl, zero_tensors, generator):
    return _forward("fmhalib.fwd_nl", qkv, cu_seqlens, p_dropout, max_s, is_training, zero_tensors, generator)


def _backward(name, dout, qkv, s_dmask, cu_seqlens, p_dropout, max_s, zero_tensors):
    _attention.check(name, qkv, cu_seqlens, p_dropout, max_s, zero_tensors)
    total, _, heads, head_dim = qkv.shape
    batch = cu_seqlens.numel() - 1
    if not isinstance(dout, torch.Tensor) or tuple(dout.shape) != (total, heads, head_dim):
        described = tuple(dout.shape) if isinstance(dout, torch.Tensor) else type(dout).__name__
        raise ValueError(
            f"{name}: dout has shape {described}; expected [total_tokens, heads, head_dim] = {(total, heads, head_dim)}"
        )
    if not dout.dtype.is_floating_point or dout.device != qkv.device:
        raise TypeError(f"{name}: dout must be a float tensor on {qkv.device}, got {dout.dtype} on {dout.device}")
    expected = (batch, heads, max_s, max_s)
    if not isinstance(s_dmask, torch.Tensor) or tuple(s_dmask.shape) != expected:
        described = tuple(s_dmask.shape) if isinstance(s_dmask, torch.Tensor) else type(s_dmask).__name__
        raise ValueError(f"{name}: softmax (fwd's S_dmask) has shape {described}; expected {expected}")
    if s_dmask.device != qkv.device:
        raise ValueError(f"{name}: softmax (fwd's S_dmask) is on {s_dmask.device}, qkv on {qkv.device}")
    keep = ~torch.signbit(s_dmask) if p_dropout > 0.0 else None
    with torch.enable_grad():
        leaf = qkv.detach().requires_grad_()
        context, _, scores, _ = _attention.padded_attention(leaf, cu_seqlens, max_s, float(p_dropout), keep=keep)
        dqkv, dscores = torch.autograd.grad(context, [leaf, scores], dout.to(context.dtype))
    return dqkv, dscores.to(qkv.dtype)


def bwd(dout, qkv, softmax, cu_seqlens, p_dropout, max_s, zero_tensors):
    dqkv, dscores = _backward("fmhalib.bwd", dout, qkv, softmax, cu_seqlens, p_dropout, max_s, zero_tensors)
    return [dqkv, dscores]


def bwd_nl(dout, qkv, softmax, cu_seqlens, p_dropout, max_s, zero_tensors):
    dqkv, dscores = _backward("fmhalib.bwd_nl", dout, qkv, softmax, cu_seqlens, p_dropout, max_s, zero_tensors)
    return [dqkv, dscores, dqkv[:, None, 1:].clone()]
