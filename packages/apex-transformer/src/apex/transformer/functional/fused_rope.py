"""Fused rotary positional embeddings (RoPE) with upstream Apex's signatures.

Megatron's non-interleaved ("rotate-half") convention. With ``f`` the angles of one position
(``d2`` of them, ``d2`` even and at most the head dim ``d``) and ``k = d2 / 2``::

    out[..., :d2] = x[..., :d2] * cos(f) + rotate_half(x[..., :d2]) * sin(f)
    out[..., d2:] = x[..., d2:]                       (the rest of the head dim passes through)
    rotate_half([x1, x2]) = [-x2, x1]                 (x1, x2 the two halves of k channels)

computed in float32 and returned in ``t``'s dtype (float32, float16 or bfloat16). Every function
is differentiable in ``t`` (the gradient is the transposed rotation, by ``-f`` when both halves of
``f`` are equal, as Megatron builds them); the angle tables get no gradient, as upstream's. On
CUDA one kernel reads ``t`` in place, whatever its strides (a slice of a fused QKV projection,
say), and writes a fresh output; elsewhere the PyTorch reference in ``apex.transformer._rope_ops``
runs.
"""

from __future__ import annotations

import torch

from apex.transformer import _rope_ops


def fused_apply_rotary_pos_emb(
    t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False
) -> torch.Tensor:
    """Apply RoPE to ``t`` of shape ``[s, b, h, d]`` ("sbhd").

    Args:
        t: the input, ``[s, b, h, d]``, any strides.
        freqs: the angles, float32 ``[s, 1, 1, d2]``, ``d2 <= d`` even: position ``i`` of the
            sequence is rotated by ``freqs[i, 0, 0]``. sin and cos are computed from it in the
            kernel, once per position and channel.
        transpose_output_memory: lay the output out as ``[b, s, h, d]`` in memory (its shape is
            still ``[s, b, h, d]``), so that ``output.transpose(0, 1)`` is contiguous.

    Returns:
        ``[s, b, h, d]`` in ``t``'s dtype.
    """
    return _rope_ops.rotary(t, freqs, transpose_output_memory, False)


def fused_apply_rotary_pos_emb_cached(
    t: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor, transpose_output_memory: bool = False
) -> torch.Tensor:
    """Apply RoPE to ``t`` of shape ``[s, b, h, d]`` with precomputed ``cos(freqs)`` and ``sin(freqs)``.

    Args:
        t: the input, ``[s, b, h, d]``, any strides.
        cos_, sin_: ``[s, 1, 1, d2]``, ``d2 <= d`` even, float32 or ``t``'s dtype (both the same).
        transpose_output_memory: as for :func:`fused_apply_rotary_pos_emb`.

    Returns:
        ``[s, b, h, d]`` in ``t``'s dtype.
    """
    return _rope_ops.rotary_cached(t, cos_, sin_, transpose_output_memory, False)


def fused_apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to packed variable-length sequences ``t`` of shape ``[t, h, d]`` ("thd").

    Args:
        t: the tokens of all sequences one after the other, ``[t, h, d]``, any strides.
        cu_seqlens: int32 ``[b + 1]``, the sequences' boundaries: sequence ``i`` holds tokens
            ``cu_seqlens[i]`` to ``cu_seqlens[i+1] - 1`` (non-decreasing; empty sequences are
            allowed), and its token ``j`` is at position ``j - cu_seqlens[i]``: positions restart
            at every sequence. Tokens outside ``[cu_seqlens[0], cu_seqlens[-1])`` (padding) are
            returned unchanged.
        freqs: float32 ``[max_s, 1, 1, d2]``, ``d2 <= d`` even, the angles of positions
            ``0 .. max_s - 1``; a sequence longer than ``max_s`` gets NaN in its rotated channels
            past that (checking it would stall on the device).

    Returns:
        ``[t, h, d]`` in ``t``'s dtype, contiguous.
    """
    return _rope_ops.rotary_thd(t, cu_seqlens, freqs, False)


def fused_apply_rotary_pos_emb_2d(
    t: torch.Tensor,
    img_h: int,
    img_w: int,
    cos_h: torch.Tensor,
    sin_h: torch.Tensor,
    cos_w: torch.Tensor,
    sin_w: torch.Tensor,
) -> torch.Tensor:
    """Apply 2-D RoPE to image tokens ``t`` of shape ``[b, s, h, d]`` ("bshd"), ``s = img_h * img_w``.

    Token ``s_i = r * img_w + c`` (row ``r``, column ``c``): the first ``d/2`` channels of the head
    dim are rotated (rotate-half within them) by row ``r``'s angles, the last ``d/2`` by column
    ``c``'s.

    Args:
        t: ``[b, img_h * img_w, h, d]``, ``d`` a multiple of 4, any strides.
        img_h, img_w: the image's height and width in tokens.
        cos_h, sin_h: ``[1, H, 1, d/2]`` with ``H >= img_h``: the rows' cos and sin.
        cos_w, sin_w: ``[1, W, 1, d/2]`` with ``W >= img_w``: the columns' cos and sin.
            All four float32 or ``t``'s dtype (the same for all four).

    Returns:
        ``[b, img_h * img_w, h, d]`` in ``t``'s dtype, contiguous.
    """
    if t.dim() != 4 or t.shape[1] != img_h * img_w:
        raise ValueError(
            f"fused_apply_rotary_pos_emb_2d: t must be [b, img_h * img_w = {img_h * img_w}, h, d], "
            f"got shape {tuple(t.shape)}"
        )
    return _rope_ops.rotary_2d(t, cos_h, sin_h, cos_w, sin_w, img_h, img_w, False)


__all__ = [
    "fused_apply_rotary_pos_emb",
    "fused_apply_rotary_pos_emb_2d",
    "fused_apply_rotary_pos_emb_cached",
    "fused_apply_rotary_pos_emb_thd",
]
