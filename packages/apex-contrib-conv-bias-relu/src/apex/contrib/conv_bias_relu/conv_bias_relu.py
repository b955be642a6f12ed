"""Convolution with a fused bias (+ ReLU, + mask, + frozen scale) epilogue: upstream's four functions.

Each is differentiable and traceable by ``torch.compile(fullgraph=True)``; the math, the ops and
what runs where are in ``apex.contrib.conv_bias_relu._ops``. In short: ``aten.convolution`` (cuDNN's
on CUDA) with the bias, then the ReLU (and the mask) in place; no custom kernel. While the ops have
no kernel of their own, the functions run the ops' checks and then compose those same torch ops under
torch's autograd rather than calling the ops (``_COMPOSE``, below: host time); the legacy module
``fused_conv_bias_relu`` calls the ops.

Where we differ from upstream on purpose:

- upstream runs channels-last float16 on CUDA only (cuDNN runtime fusion); these take float32,
  float16 and bfloat16, contiguous or channels-last, on any device, and return the output (and
  ``x``'s gradient) in ``x``'s memory format; float32 convolutions follow PyTorch's TF32 switch
  (``torch.backends.cudnn.allow_tf32``, on by default: cuDNN may round float32 inputs to TF32's
  10-bit mantissa on Ampere and later), as ``nn.Conv2d`` does;
- under autocast upstream casts its floating inputs to float16 (``custom_fwd(cast_inputs=
  torch.half)``); these cast them to the autocast dtype of ``x``'s device (float16 by default on
  CUDA, so the same there; bfloat16 under ``autocast(dtype=torch.bfloat16)``), and compute with
  autocast off, as upstream;
- ``bias`` and ``scale`` may be shaped ``(K,)`` as well as upstream's ``(1, K, 1, 1)``; the bias
  gradient comes back in bias's shape and dtype;
- ``ConvBiasMaskReLU``'s gradient is multiplied by the mask (upstream's ignores it, which is the
  same for a 0/1 mask); ``mask`` may be int8 (upstream's), uint8, bool or ``x``'s dtype;
- bad input raises an error naming the argument (upstream's kernels print a cuDNN error).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from apex.contrib.conv_bias_relu import _ops
from apex.core.library import Args

__all__ = ["ConvBias", "ConvBiasMaskReLU", "ConvBiasReLU", "ConvFrozenScaleBiasReLU"]

# The ops have no kernel of their own: each runs its PyTorch reference, on CUDA too. Called through
# the ops, every call also paid the custom op's dispatch and its Python autograd: Bottleneck, three
# of these per block, ran at 0.55-0.78x of the same block in plain modules, forward + backward on an
# H100 (bench_bottleneck.py, N=64, 2026-12-05), and on 2 CPU cores the host time of one 3x3
# ConvFrozenScaleBiasReLU forward + backward at 1x8x4x4 was 216 us against 90 us for the plain ops.
# So the functions compose the same ops here, after the ops' own checks, under PyTorch's autograd
# (which also gives second derivatives); the ops stay the seam where a fused kernel would go. The
# tests set this False to run the ops.
_COMPOSE = True


def _checked(name: str, x, weight, bias, padding, stride, scale=None, mask=None) -> None:
    """The op ``name``'s checks of these arguments (the same errors, naming the argument). Skipped
    while torch.compile traces: Dynamo of torch 2.11 cannot trace the checks' argument object (its
    ``__dict__.update``), and the compiled convolution checks shapes itself."""
    if torch.compiler.is_compiling():
        return
    values = dict(op=name, x=x, weight=weight, bias=bias, padding=padding, stride=stride, scale=scale, mask=mask)
    _ops._check_forward(Args(values))


def _composed(x, weight, bias, padding: int, stride: int, relu: bool, mask=None, scale=None) -> torch.Tensor:
    """The ops' forward math in differentiable PyTorch ops: the convolution (of the weight folded with a
    frozen ``scale``, which gets no gradient, where there is one) with the bias, then the mask and the
    ReLU in place on its output, in x's memory format."""
    with _ops._no_autocast(x.device):
        if scale is not None:
            weight = _ops._folded_weight(weight, scale.detach())
        out = F.conv2d(x, weight, bias.reshape(-1), stride, padding)
        out = out.contiguous(memory_format=_ops._memory_format(x))
        if mask is not None:  # no gradient for the mask, as the ops (and upstream)
            out = out.mul_(mask.detach())
        return out.relu_() if relu else out


def _autocast(x: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """``x`` and ``tensors`` cast to the autocast dtype of ``x``'s device where autocast is on
    (floating tensors on that device only, as ``torch.amp.custom_fwd`` casts)."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return [x, *tensors]
    dtype = torch.get_autocast_dtype(device_type)
    return [t.to(dtype) if t.is_floating_point() and t.device.type == device_type else t for t in (x, *tensors)]


def ConvBiasReLU(x, weight, bias, padding: int, stride: int) -> torch.Tensor:
    """``relu(conv2d(x, weight, padding=padding, stride=stride) + bias)``.

    Args:
        x: ``[N, C, H, W]``, float32, float16 or bfloat16, contiguous or channels-last.
        weight: ``[K, C, R, S]``, x's dtype (groups 1, dilation 1).
        bias: ``(1, K, 1, 1)`` or ``(K,)``, x's dtype.
        padding: zero padding on each side of H and W (an int, >= 0).
        stride: the stride along H and W (an int, >= 1).

    Returns ``[N, K, P, Q]`` in x's dtype and memory format; gradients for x, weight and bias.
    """
    x, weight, bias = _autocast(x, weight, bias)
    if _COMPOSE:
        _checked("conv_bias_relu_forward", x, weight, bias, padding, stride)
        return _composed(x, weight, bias, padding, stride, relu=True)
    return _ops.conv_bias_relu(x, weight, bias, padding, stride)


def ConvBias(x, weight, bias, padding: int, stride: int) -> torch.Tensor:
    """``conv2d(x, weight, padding=padding, stride=stride) + bias``; arguments as :func:`ConvBiasReLU`."""
    x, weight, bias = _autocast(x, weight, bias)
    if _COMPOSE:
        _checked("conv_bias_forward", x, weight, bias, padding, stride)
        return _composed(x, weight, bias, padding, stride, relu=False)
    return _ops.conv_bias(x, weight, bias, padding, stride)


def ConvBiasMaskReLU(x, weight, bias, mask, padding: int, stride: int) -> torch.Tensor:
    """``relu((conv2d(x, weight, padding=padding, stride=stride) + bias) * mask)``.

    ``mask`` has the output's shape ``[N, K, P, Q]``, dtype int8 (upstream's), uint8, bool or x's
    dtype; it gets no gradient. Other arguments as :func:`ConvBiasReLU`.
    """
    x, weight, bias = _autocast(x, weight, bias)
    if _COMPOSE:
        _checked("conv_bias_mask_relu_forward", x, weight, bias, padding, stride, mask=mask)
        return _composed(x, weight, bias, padding, stride, relu=True, mask=mask)
    return _ops.conv_bias_mask_relu(x, weight, bias, mask, padding, stride)


def ConvFrozenScaleBiasReLU(x, weight, scale, bias, padding: int, stride: int) -> torch.Tensor:
    """``relu(conv2d(x, weight, padding=padding, stride=stride) * scale + bias)``: a convolution
    followed by a frozen batch norm folded into a per-channel ``scale`` and ``bias``.

    ``scale`` and ``bias`` are ``(1, K, 1, 1)`` or ``(K,)`` in x's dtype and get no gradient
    (frozen, as upstream); x and weight do. The scale is folded into the weight (``weight *
    scale`` per output channel, computed in float32 and rounded once to x's dtype).
    """
    x, weight, scale, bias = _autocast(x, weight, scale, bias)
    if _COMPOSE:
        _checked("conv_frozen_scale_bias_relu_forward", x, weight, bias, padding, stride, scale=scale)
        return _composed(x, weight, bias.detach(), padding, stride, relu=True, scale=scale)
    return _ops.conv_frozen_scale_bias_relu(x, weight, scale, bias, padding, stride)
