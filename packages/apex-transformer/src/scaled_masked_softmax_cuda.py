"""Upstream Apex's ``scaled_masked_softmax_cuda`` extension module, on apex-transformer's ops.

- ``forward(input, mask, scale) -> softmax_results``: softmax of ``scale * input`` over the last
  dimension with a padding mask; ``input`` is 4-D ``[b, np, sq, sk]``, ``mask`` bool or uint8
  ``[b or 1, 1, sq, sk]`` (nonzero = masked: score -10000; a fully masked row gives 0).
- ``backward(output_grads, softmax_results, scale) -> output_grads``: the input gradient, written
  into ``output_grads`` (or into a contiguous copy of it) and returned, as upstream does.
- ``get_batch_per_block(sq, sk, b, np) -> int``: upstream's value (rows per 128-thread block of
  its warp kernels), which Megatron's eligibility check divides by.

``scale`` is a number or a one-element tensor (Megatron-Core passes a 0-d CPU tensor). Runs on
the CPU too (the PyTorch reference); accepts float32 besides upstream's float16 and bfloat16, and
any ``sk`` (upstream: at most 16384).
"""

from __future__ import annotations

from apex.transformer import _softmax_ops
from apex.transformer.functional.fused_softmax import get_batch_per_block as _get_batch_per_block

_MODULE = "scaled_masked_softmax_cuda"
_LAYOUT = "[b, np, sq, sk]"


def forward(input, mask, scale):
    return _softmax_ops.legacy_forward(_MODULE, input, mask, scale, False, 4, _LAYOUT)


def backward(output_grads, softmax_results, scale):
    return _softmax_ops.legacy_backward(_MODULE, output_grads, softmax_results, scale, False, 4, _LAYOUT)


def get_batch_per_block(query_seq_len, key_seq_len, batches, attn_heads):
    return _get_batch_per_block(int(query_seq_len), int(key_seq_len), int(batches), int(attn_heads))
