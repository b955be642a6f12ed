"""Upstream Apex's ``generic_scaled_masked_softmax_cuda`` extension module, on apex-transformer's ops.

Upstream's module for rows longer than its warp kernels took; ours share one kernel family,
which covers every ``sk``:

- ``forward(input, mask, scale) -> softmax_results``: softmax of ``scale * input`` over the last
  dimension with a padding mask; ``input`` is 4-D ``[b, np, sq, sk]``, ``mask`` bool or uint8
  ``[b or 1, 1, sq, sk]`` (nonzero = masked: score -10000; a fully masked row gives 0).
- ``backward(output_grads, softmax_results, scale) -> output_grads``: the input gradient, written
  into ``output_grads`` (or into a contiguous copy of it) and returned, as upstream does.

``scale`` is a number or a one-element tensor. Runs on the CPU too (the PyTorch reference);
accepts float32 besides upstream's float16 and bfloat16.
"""

from __future__ import annotations

from apex.transformer import _softmax_ops

_MODULE = "generic_scaled_masked_softmax_cuda"
_LAYOUT = "[b, np, sq, sk]"


def forward(input, mask, scale):
    return _softmax_ops.legacy_forward(_MODULE, input, mask, scale, False, 4, _LAYOUT)


def backward(output_grads, softmax_results, scale):
    return _softmax_ops.legacy_backward(_MODULE, output_grads, softmax_results, scale, False, 4, _LAYOUT)
