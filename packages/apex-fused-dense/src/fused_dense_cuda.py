"""Upstream Apex's ``fused_dense_cuda`` extension module, on apex-fused-dense's ops.

Code written against upstream imports this module by that name. The functions keep upstream's
names, argument orders and returns, and call ``torch.ops.apex_fused_dense``, so they also run on
the CPU (through the PyTorch references):

- ``linear_bias_forward(input, weight, bias) -> output``;
- ``linear_bias_backward(input, weight, d_output) -> [d_input, d_weight, d_bias]``;
- ``linear_gelu_linear_forward(input, weight1, bias1, weight2, bias2) -> [output1, output2,
  gelu_in]`` (``output1`` the GELU's output, ``gelu_in`` its input);
- ``linear_gelu_linear_backward(input, gelu_in, output1, weight1, weight2, d_output2) ->
  [d_input, d_weight1, d_bias1, d_weight2, d_bias2]``.

``input`` is ``[batch, in_features]`` as upstream's (2-D), weights ``[out, in]``. Unlike upstream's
module, non-contiguous tensors are made contiguous instead of read as if they were, and float32 and
float64 inputs are computed exactly as for 16-bit ones.
"""

from __future__ import annotations

from apex.fused_dense import _ops


def linear_bias_forward(input, weight, bias):
    return _ops.linear_forward(input.contiguous(), weight.contiguous(), bias.contiguous())


def linear_bias_backward(input, weight, d_output):
    return list(_ops.linear_backward(input.contiguous(), weight.contiguous(), d_output.contiguous(), True))


def linear_gelu_linear_forward(input, weight1, bias1, weight2, bias2):
    tensors = (t.contiguous() for t in (input, weight1, bias1, weight2, bias2))
    return list(_ops.linear_gelu_linear_forward(*tensors))


def linear_gelu_linear_backward(input, gelu_in, output1, weight1, weight2, d_output2):
    tensors = (t.contiguous() for t in (input, gelu_in, output1, weight1, weight2, d_output2))
    return list(_ops.linear_gelu_linear_backward(*tensors))
