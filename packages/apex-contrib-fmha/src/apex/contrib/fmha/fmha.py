"""``FMHAFun`` and ``FMHA``: upstream Apex's packed variable-length BERT self-attention, on torch ops."""

from __future__ import annotations

import torch

from apex.contrib.fmha import _attention


class FMHAFun:
    """Fused multi-head self-attention over packed variable-length sequences.

    ``FMHAFun.apply(qkv, cu_seqlens, p_dropout, max_s, is_training, zero_tensors)`` (upstream's
    call, all positional) returns the context ``[total_tokens, heads, head_dim]`` in ``qkv``'s dtype.

    Args:
        qkv: ``[total_tokens, 3, heads, head_dim]``: per token, its query, key and value rows of
            every head; the sequences lie back to back. float32, float16 or bfloat16 (float64 too,
            on the reference path), any device, any strides.
        cu_seqlens: int32 ``[batch + 1]``, on ``qkv``'s device: ``0`` then the running sum of the
            sequence lengths (sequence ``i`` is rows ``cu_seqlens[i]:cu_seqlens[i+1]``). Lengths of
            0 are allowed.
        p_dropout: probability of dropping an attention probability, in ``[0, 1)``; kept ones are
            scaled by ``1 / (1 - p_dropout)``. Applied only when ``is_training``.
        max_s: an int, at least the longest sequence (the padded length of the reference path and
            the bound the kernels are told).
        is_training: apply dropout.
        zero_tensors: upstream zero-filled the output rows past ``cu_seqlens[-1]``; here those rows
            are always zero and their gradient is zero, and ``cu_seqlens[-1] < total_tokens`` is
            accepted only with ``zero_tensors=True`` (an error otherwise: upstream left them garbage).

    Each token attends to all tokens of its own sequence with scale ``1 / sqrt(head_dim)``. The
    result is differentiable in ``qkv``.

    Differences from upstream (on purpose): upstream ran its own fp16-only CUDA kernels for
    head_dim 64 and max_s up to 512 on sm80/sm90. Here any of the dtypes above, any head_dim, any
    ``max_s`` and any device: on CUDA, ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention on
    the packed rows; sm80+, float16/bfloat16, head_dim a multiple of 8 up to 256, no active dropout,
    torch 2.10+), torch's FlashAttention varlen kernels with dropout for the same inputs, or else
    ``scaled_dot_product_attention`` on jagged nested tensors (memory-efficient, without dropout);
    a padded batched reference in float32 elsewhere, for
    dropout flash cannot take (torch's memory-efficient kernel reuses one dropout mask for all
    heads and sequences of jagged inputs), and under ``torch.compile`` except the varlen case. This
    is not an ``autograd.Function`` subclass: ``apply`` composes torch ops, whose own backward
    kernels give the gradient and which ``torch.compile`` traces. Dropout draws from torch's
    generator of ``qkv``'s device, so ``torch.manual_seed`` reproduces it on a given path and
    device (the patterns of the paths differ). Reading ``cu_seqlens`` to check it costs one small
    device-to-host copy the first time a ``cu_seqlens`` tensor is passed (again after it is written
    in place; never while ``torch.compile`` traces): the other layers of a step pay nothing.
    """

    @staticmethod
    def apply(qkv, cu_seqlens, p_dropout, max_s, is_training, zero_tensors):
        return _attention.attention(
            qkv, cu_seqlens, p_dropout, max_s, bool(is_training), bool(zero_tensors), name="FMHAFun"
        )


class FMHA(torch.nn.Module):
    """Multi-head self-attention of BERT over packed variable-length sequences (upstream's module).

    Args:
        config: any object with ``attention_probs_dropout_prob`` (dropout on the attention
            probabilities), ``num_attention_heads`` and ``hidden_size`` (a multiple of the heads;
            ``head_dim = hidden_size // num_attention_heads``), as a Hugging Face ``BertConfig``.

    ``forward(qkv, cu_seqlens, max_s, is_training=True, zero_tensors=False)`` takes the fused
    projection ``qkv`` (any shape that views as ``[total_tokens, 3, heads, head_dim]``, e.g.
    ``[total_tokens, 3 * hidden_size]`` with q, k, v blocks side by side) and returns
    ``[total_tokens, hidden_size]``. See :class:`FMHAFun` for the arguments and the differences from
    upstream. Dropout follows ``is_training``, not ``self.training`` (upstream's rule). No parameters.
    """

    def __init__(self, config):
        super().__init__()
        self.p_dropout = config.attention_probs_dropout_prob
        self.h = config.num_attention_heads
        self.hidden_size = config.hidden_size
        if self.h <= 0 or self.hidden_size <= 0 or self.hidden_size % self.h != 0:
            raise ValueError(
                f"FMHA: config.hidden_size ({self.hidden_size}) must be a positive multiple of "
                f"config.num_attention_heads ({self.h})"
            )
        if not 0.0 <= self.p_dropout < 1.0:
            raise ValueError(f"FMHA: config.attention_probs_dropout_prob must be in [0, 1), got {self.p_dropout}")
        self.d = self.hidden_size // self.h

    def forward(self, qkv, cu_seqlens, max_s, is_training=True, zero_tensors=False):
        if not isinstance(qkv, torch.Tensor) or qkv.numel() % (3 * self.hidden_size) != 0:
            described = tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__
            raise ValueError(
                f"FMHA: qkv has shape {described}; expected [total_tokens, 3 * hidden_size] "
                f"(hidden_size={self.hidden_size}) or [total_tokens, 3, heads, head_dim]"
            )
        context = FMHAFun.apply(
            qkv.view(-1, 3, self.h, self.d), cu_seqlens, self.p_dropout, max_s, is_training, zero_tensors
        )
        return context.view(-1, self.hidden_size)

    def extra_repr(self) -> str:
        return f"heads={self.h}, head_dim={self.d}, p_dropout={self.p_dropout}"
