"""Upstream Apex's ``fused_conv_bias_relu`` extension module, on apex-contrib-conv-bias-relu's ops.

Upstream's functions, argument orders and returns (tensor lists in, lists out; ``padding`` and
``stride`` are ints applied to H and W). These run on every device and take float32, float16 and
bfloat16 in either memory format (upstream: channels-last float16 on CUDA); the math is in
``apex.contrib.conv_bias_relu._ops``.

- ``forward([x, weight, bias], padding, stride) -> [relu(conv + bias)]``
- ``backward([x, weight, out, grad_out], padding, stride) -> [grad_x, grad_weight, grad_bias]``
  (the ReLU's derivative from ``out``; ``grad_bias`` float32 ``(1, K, 1, 1)``, as upstream)
- ``forward_no_relu([x, weight, bias], padding, stride) -> [conv + bias]``
- ``backward_no_relu([x, weight, grad_out], padding, stride) -> [grad_x, grad_weight, grad_bias]``
- ``forward_mask([x, weight, bias, mask], padding, stride) -> [relu((conv + bias) * mask)]``
  (upstream's mask backward is ``backward`` on the masked output)
- ``forward_cscale_cbias_relu([x, weight, scale, bias], padding, stride) -> relu(conv * scale + bias)``
  (a tensor, not a list, as upstream)
- ``backward_cscale_cbias_relu([x, weight, scale, out, grad_out], padding, stride) -> [grad_x, grad_weight]``
"""

from __future__ import annotations

import torch

import apex.contrib.conv_bias_relu._ops  # noqa: F401  (registers the ops)

_ops = torch.ops.apex_contrib_conv_bias_relu


def _unpack(name: str, inputs, count: int) -> list[torch.Tensor]:
    inputs = list(inputs)
    if len(inputs) != count:
        raise ValueError(f"fused_conv_bias_relu.{name}: inputs must hold {count} tensors, got {len(inputs)}")
    return inputs


def forward(inputs, padding: int, stride: int) -> list[torch.Tensor]:
    x, weight, bias = _unpack("forward", inputs, 3)
    return [_ops.conv_bias_relu_forward(x, weight, bias, padding, stride)]


def backward(inputs, padding: int, stride: int) -> list[torch.Tensor]:
    x, weight, out, grad_out = _unpack("backward", inputs, 4)
    return list(_ops.conv_bias_relu_backward(x, weight, out, grad_out, padding, stride))


def forward_no_relu(inputs, padding: int, stride: int) -> list[torch.Tensor]:
    x, weight, bias = _unpack("forward_no_relu", inputs, 3)
    return [_ops.conv_bias_forward(x, weight, bias, padding, stride)]


def backward_no_relu(inputs, padding: int, stride: int) -> list[torch.Tensor]:
    x, weight, grad_out = _unpack("backward_no_relu", inputs, 3)
    return list(_ops.conv_bias_backward(x, weight, grad_out, padding, stride))


def forward_mask(inputs, padding: int, stride: int) -> list[torch.Tensor]:
    x, weight, bias, mask = _unpack("forward_mask", inputs, 4)
    return [_ops.conv_bias_mask_relu_forward(x, weight, bias, mask, padding, stride)]


def forward_cscale_cbias_relu(inputs, padding: int, stride: int) -> torch.Tensor:
    x, weight, scale, bias = _unpack("forward_cscale_cbias_relu", inputs, 4)
    return _ops.conv_frozen_scale_bias_relu_forward(x, weight, scale, bias, padding, stride)


def backward_cscale_cbias_relu(inputs, padding: int, stride: int) -> list[torch.Tensor]:
    x, weight, scale, out, grad_out = _unpack("backward_cscale_cbias_relu", inputs, 5)
    return list(_ops.conv_frozen_scale_bias_relu_backward(x, weight, scale, out, grad_out, padding, stride))


__all__ = [
    "backward",
    "backward_cscale_cbias_relu",
    "backward_no_relu",
    "forward",
    "forward_cscale_cbias_relu",
    "forward_mask",
    "forward_no_relu",
]
