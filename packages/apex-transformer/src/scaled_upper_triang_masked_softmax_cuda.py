"""Upstream Apex's ``scaled_upper_triang_masked_softmax_cuda`` extension module, on apex-transformer's ops.

- ``forward(input, scale) -> softmax_results``: causal softmax of ``scale * input`` over the last
  dimension; ``input`` is 3-D ``[attn_batches, sq, sk]`` with ``sq == sk``.
- ``backward(output_grads, softmax_results, scale) -> output_grads``: the input gradient, written
  into ``output_grads`` (or into a contiguous copy of it) and returned, as upstream does.

``scale`` is a number or a one-element tensor (Megatron-Core passes a 0-d CPU tensor). Runs on
the CPU too (the PyTorch reference); accepts float32 besides upstream's float16 and bfloat16, and
any ``sk`` (upstream: at most 16384).
"""

from __future__ import annotations

from apex.transformer import _softmax_ops

_MODULE = "scaled_upper_triang_masked_softmax_cuda"
_LAYOUT = "[attn_batches, sq, sk]"


def forward(input, scale):
    return _softmax_ops.legacy_forward(_MODULE, input, None, scale, True, 3, _LAYOUT)


def backward(output_grads, softmax_results, scale):
    return _softmax_ops.legacy_backward(_MODULE, output_grads, softmax_results, scale, True, 3, _LAYOUT)
