"""Convolution with a fused bias (+ ReLU, + mask, + frozen scale) epilogue: upstream's four functions.

Each is differentiable and traceable by ``torch.compile(fullgraph=True)``; the math, the ops and
what runs where are in ``apex.contrib.conv_bias_relu._ops``. In short: ``aten.convolution`` (cuDNN's
on CUDA) with the bias, then the ReLU (and the mask) in place; no custom kernel.

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

from apex.contrib.conv_bias_relu import _ops

__all__ = ["ConvBias", "ConvBiasMaskReLU", "ConvBiasReLU", "ConvFrozenScaleBiasReLU"]


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
    return _ops.conv_bias_relu(x, weight, bias, padding, stride)


def ConvBias(x, weight, bias, padding: int, stride: int) -> torch.Tensor:
    """``conv2d(x, weight, padding=padding, stride=stride) + bias``; arguments as :func:`ConvBiasReLU`."""
    x, weight, bias = _autocast(x, weight, bias)
    return _ops.conv_bias(x, weight, bias, padding, stride)


def ConvBiasMaskReLU(x, weight, bias, mask, padding: int, stride: int) -> torch.Tensor:
    """``relu((conv2d(x, weight, padding=padding, stride=stride) + bias) * mask)``.

    ``mask`` has the output's shape ``[N, K, P, Q]``, dtype int8 (upstream's), uint8, bool or x's
    dtype; it gets no gradient. Other arguments as :func:`ConvBiasReLU`.
    """
    x, weight, bias = _autocast(x, weight, bias)
    return _ops.conv_bias_mask_relu(x, weight, bias, mask, padding, stride)


def ConvFrozenScaleBiasReLU(x, weight, scale, bias, padding: int, stride: int) -> torch.Tensor:
    """``relu(conv2d(x, weight, padding=padding, stride=stride) * scale + bias)``: a convolution
    followed by a frozen batch norm folded into a per-channel ``scale`` and ``bias``.

    ``scale`` and ``bias`` are ``(1, K, 1, 1)`` or ``(K,)`` in x's dtype and get no gradient
    (frozen, as upstream); x and weight do. The scale is folded into the weight (``weight *
    scale`` per output channel, computed in float32 and rounded once to x's dtype).
    """
    x, weight, scale, bias = _autocast(x, weight, scale, bias)
    return _ops.conv_frozen_scale_bias_relu(x, weight, scale, bias, padding, stride)
