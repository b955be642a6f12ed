"""Upstream Apex's ``fused_rotary_positional_embedding`` extension module, on apex-transformer's ops.

The functions, argument orders and returns of upstream's module (each returns a new tensor;
none records a gradient, as upstream's). The math and the accepted shapes and dtypes are in
``apex.transformer.functional.fused_rope``; these run on the CPU too (the PyTorch references).

- ``forward(input, freqs, transpose_output)`` / ``backward(output_grads, freqs, transpose_output)``:
  ``[s, b, h, d]`` with float32 ``freqs [s, 1, 1, d2]``;
- ``forward_cached(input, cos, sin, transpose_output)`` / ``backward_cached(...)``;
- ``forward_thd(input, cu_seqlens, freqs)`` / ``backward_thd(output_grads, cu_seqlens, freqs)``:
  ``[t, h, d]``, int32 ``cu_seqlens [b + 1]``, ``freqs [max_s, 1, 1, d2]``;
- ``forward_2d(input, cos_h, sin_h, cos_w, sin_w)`` / ``backward_2d(output_grads, ...)``:
  ``[b, img_h, img_w, h, d]`` in, ``[b, img_h * img_w, h, d]`` out.
"""

from __future__ import annotations

import torch

import apex.transformer._rope_ops  # noqa: F401  (registers the ops)

_ops = torch.ops.apex_transformer


def forward(input: torch.Tensor, freqs: torch.Tensor, transpose_output: bool) -> torch.Tensor:
    return _ops.rope(input, freqs, transpose_output, False)


def backward(output_grads: torch.Tensor, freqs: torch.Tensor, transpose_output: bool) -> torch.Tensor:
    return _ops.rope(output_grads, freqs, transpose_output, True)


def forward_cached(input: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose_output: bool) -> torch.Tensor:
    return _ops.rope_cached(input, cos, sin, transpose_output, False)


def backward_cached(
    output_grads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose_output: bool
) -> torch.Tensor:
    return _ops.rope_cached(output_grads, cos, sin, transpose_output, True)


def forward_thd(input: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    return _ops.rope_thd(input, cu_seqlens, freqs, False)


def backward_thd(output_grads: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    return _ops.rope_thd(output_grads, cu_seqlens, freqs, True)


def forward_2d(
    input: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor, cos_w: torch.Tensor, sin_w: torch.Tensor
) -> torch.Tensor:
    return _ops.rope_2d(input, cos_h, sin_h, cos_w, sin_w, False)


def backward_2d(
    output_grads: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor, cos_w: torch.Tensor, sin_w: torch.Tensor
) -> torch.Tensor:
    return _ops.rope_2d(output_grads, cos_h, sin_h, cos_w, sin_w, True)


__all__ = [
    "backward",
    "backward_2d",
    "backward_cached",
    "backward_thd",
    "forward",
    "forward_2d",
    "forward_cached",
    "forward_thd",
]
