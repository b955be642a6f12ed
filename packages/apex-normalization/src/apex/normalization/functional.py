"""Functional layer norm and RMS norm with upstream Apex's signatures, plus fused residual-add variants.

Every function normalizes over the last ``len(normalized_shape)`` dimensions, keeps its
statistics in float32 whatever the input dtype, and is differentiable in the input and the
affine parameters (``torch.ops.apex_normalization.*``, whose autograd is registered on the ops).

- ``fused_*`` functions return the input's dtype; their weight (and bias) may be in the
  input's dtype or float32.
- ``mixed_dtype_*`` functions return the weight's dtype (float32 weights with float16/bfloat16
  input give a float32 output), as upstream's ``MixedFused*`` modules do.
- ``memory_efficient=True`` keeps the output instead of the input for the backward pass and
  recomputes the normalized values from it (which needs a weight without zeros): when the output
  is kept anyway (the next layer saves it), the input and, for layer norm, the per-row means are
  no longer held: ``rows * hidden * input.element_size() + 4 * rows`` bytes less per call.
- ``fused_add_*`` functions compute ``s = input + residual`` (in the input's dtype) and return
  ``(norm(s), s)`` in one pass, as a pre-norm transformer block uses them.

Under ``torch.autocast`` the tensors are first cast to the autocast dtype, as upstream does.
Non-contiguous tensors are made contiguous first (a copy).
"""

from __future__ import annotations

import numbers

import torch

from apex.core.library import plain_cpu
from apex.normalization import _ops, _reference

# Layer norm whose CPU path is PyTorch's own op (_ops.aten_layer_norm): float32/float64 with or
# without weight and bias in the input's dtype, float16/bfloat16 without them.
_ATEN_DTYPES = (torch.float32, torch.float64)
_ATEN_PLAIN_DTYPES = (torch.float16, torch.bfloat16)


def normalized_shape_tuple(normalized_shape) -> tuple:
    if isinstance(normalized_shape, tuple):  # torch.Size too, as the modules pass it
        return normalized_shape
    if isinstance(normalized_shape, (int, numbers.Integral)):  # int first: cheaper than the ABC check
        return (int(normalized_shape),)
    return tuple(normalized_shape)


def _norm(input, residual, weight, bias, normalized_shape, eps, rms, memory_efficient, mixed):
    device_type = "cuda" if input.is_cuda else input.device.type  # input.device builds a torch.device per call
    # is_autocast_available is not traceable by dynamo (torch 2.11); a compiled graph only runs on
    # devices that have autocast anyway.
    compiling = torch.compiler.is_compiling()
    available = compiling or torch.amp.is_autocast_available(device_type)
    if available and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        input, residual, weight, bias = (
            t.to(dtype) if t is not None and t.is_floating_point() else t for t in (input, residual, weight, bias)
        )
    # Written out rather than looped: this runs on every eager call, whose host time it adds to.
    input = input.contiguous()
    if residual is not None:
        residual = residual.contiguous()
    output_dtype = None
    if weight is not None:
        weight = weight.contiguous()
        if mixed:
            output_dtype = weight.dtype
    if bias is not None:
        bias = bias.contiguous()
    shape = normalized_shape_tuple(normalized_shape)
    if compiling and torch.onnx.is_in_onnx_export():
        # ONNX has no function for our ops: the exporter gets the reference's torch ops instead
        # (upstream's modules fall back to torch's norms when traced, too).
        out, residual_out, _, _ = _reference.norm_forward(
            input, weight, bias, len(shape), eps, rms, output_dtype or input.dtype, residual
        )
        return out if residual is None else (out, residual_out)
    eager = input.is_cpu and plain_cpu(input, residual, weight, bias)  # the ops' reference, past the dispatcher
    if eager and residual is None and not rms and not memory_efficient:
        dtype = input.dtype
        plain = weight is None and dtype in _ATEN_PLAIN_DTYPES  # no weight: 16-bit types too
        same = dtype in _ATEN_DTYPES and (weight is None or weight.dtype == dtype)
        if plain or same:
            if not _reference._tiny(input, len(shape)):
                return _ops.aten_layer_norm(input, weight, bias, shape, eps)
    if residual is None:
        forward = _ops.eager_norm_forward if eager else _ops.norm_forward
        return forward(input, weight, bias, shape, eps, rms, memory_efficient, output_dtype)[0]
    forward = _ops.eager_add_norm_forward if eager else _ops.add_norm_forward
    outputs = forward(input, residual, weight, bias, shape, eps, rms, memory_efficient, output_dtype)
    return outputs[0], outputs[1]


def fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False):
    """Layer norm with weight and bias (bias may be None); output in the input's dtype."""
    return _norm(input, None, weight, bias, normalized_shape, eps, False, memory_efficient, False)


def fused_layer_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    """Layer norm without affine parameters."""
    return _norm(input, None, None, None, normalized_shape, eps, False, memory_efficient, False)


def mixed_dtype_fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False):
    """Layer norm with weight and bias; output in the weight's dtype."""
    return _norm(input, None, weight, bias, normalized_shape, eps, False, memory_efficient, True)


def fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):
    """RMS norm with a weight; output in the input's dtype."""
    return _norm(input, None, weight, None, normalized_shape, eps, True, memory_efficient, False)


def fused_rms_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    """RMS norm without a weight."""
    return _norm(input, None, None, None, normalized_shape, eps, True, memory_efficient, False)


def mixed_dtype_fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):
    """RMS norm with a weight; output in the weight's dtype."""
    return _norm(input, None, weight, None, normalized_shape, eps, True, memory_efficient, True)


def fused_add_layer_norm_affine(input, residual, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False):
    """``s = input + residual``; returns ``(layer_norm(s) * weight + bias, s)``."""
    return _norm(input, residual, weight, bias, normalized_shape, eps, False, memory_efficient, False)


def fused_add_layer_norm(input, residual, normalized_shape, eps=1e-6, memory_efficient=False):
    """``s = input + residual``; returns ``(layer_norm(s), s)``."""
    return _norm(input, residual, None, None, normalized_shape, eps, False, memory_efficient, False)


def fused_add_rms_norm_affine(input, residual, weight, normalized_shape, eps=1e-6, memory_efficient=False):
    """``s = input + residual``; returns ``(rms_norm(s) * weight, s)``."""
    return _norm(input, residual, weight, None, normalized_shape, eps, True, memory_efficient, False)


def fused_add_rms_norm(input, residual, normalized_shape, eps=1e-6, memory_efficient=False):
    """``s = input + residual``; returns ``(rms_norm(s), s)``."""
    return _norm(input, residual, None, None, normalized_shape, eps, True, memory_efficient, False)
