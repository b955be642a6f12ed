"""Upstream Apex's ``fast_bottleneck`` extension module (apex-contrib-bottleneck), as far as it goes.

- ``forward(explicit_nhwc, stride_1x1, inputs) -> [out1, out2, out3]``: ``inputs`` is upstream's list
  ``[x, w1, w2, w3, scale1, scale2, scale3, bias1, bias2, bias3(, w4, scale4, bias4)]`` (the last three
  with a downsample); ``out1 = relu(conv1x1(x, w1, stride) * scale1 + bias1)``, ``out2 =
  relu(conv3x3(out1, w2) * scale2 + bias2)``, ``out3 = relu(conv1x1(out2, w3) * scale3 + bias3 +
  identity)``, ``identity = x`` or ``conv1x1(x, w4, stride) * scale4 + bias4``.
- ``backward(explicit_nhwc, stride_1x1, inputs) -> [grad_x, grad_w1, grad_w2, grad_w3(, grad_w4)]``:
  ``inputs`` is upstream's ``[x, w1, w2, w3, scale1, scale2, scale3, bias1, bias2, bias3, grad_conv3,
  grad_conv4, out1, out2(, w4)]`` where ``grad_conv3`` is the gradient at conv3's output already
  multiplied by ``scale3`` (and by out3's ReLU mask), ``grad_conv4`` the downsample's (times ``scale4``),
  or, without a downsample, the gradient reaching ``identity``, as upstream's ``BottleneckFunction``
  computes them.

Tensors are NCHW (any memory format) or, with ``explicit_nhwc``, activations ``[N, H, W, C]`` and weights
``[K, R, S, C]``; scales and biases hold one value per channel in any shape. Outputs come back in the
input's layout. Any device, float32/float16/bfloat16 (upstream: CUDA, float16, channels-last).

The decomposed spatial functions (``forward_init``, ``forward_out1``, ``forward_out2`` and its ``_mask``,
``_halo``, ``_halo_corr``, ``_pad`` variants, ``forward_rest``, ``backward_init``, ``backward_grad_out2``,
``backward_grad_out1`` and its ``_mask``, ``_halo``, ``_halo_corr`` variants, ``backward_wgrad1``,
``backward_wgrad2``, ``backward_wgrad2_pad``, ``backward_wgrad2_halo``, ``backward_wgrad3``,
``backward_rest``) raise NotImplementedError naming themselves: they fill upstream's preallocated cuDNN
buffers piece by piece; ``apex.contrib.bottleneck.SpatialBottleneck`` does the spatial block instead.
"""

from __future__ import annotations

import torch

from apex.contrib.bottleneck._block import from_nchw, nchw, outputs, prepare

__all__ = ["backward", "forward"]


def _unpack_forward(inputs):
    inputs = list(inputs)
    if len(inputs) not in (10, 13):
        raise ValueError(
            f"fast_bottleneck.forward: inputs must hold 10 tensors (13 with a downsample), got {len(inputs)}"
        )
    x, w1, w2, w3, s1, s2, s3, b1, b2, b3 = inputs[:10]
    weights, scales, biases = [w1, w2, w3], [s1, s2, s3], [b1, b2, b3]
    if len(inputs) == 13:
        weights.append(inputs[10])
        scales.append(inputs[11])
        biases.append(inputs[12])
    return x, weights, scales, biases


def forward(explicit_nhwc, stride_1x1, inputs):
    x, weights, scales, biases = _unpack_forward(inputs)
    with torch.no_grad():
        outs = outputs(*prepare(x, weights, scales, biases, explicit_nhwc), stride_1x1)
    return [from_nchw(t, explicit_nhwc) for t in outs]


def _conv_grads(grad, inp, weight, stride, padding):
    gi, gw, _ = torch.ops.aten.convolution_backward(
        grad, inp, weight, None, [stride] * 2, [padding] * 2, [1, 1], False, [0, 0], 1, [True, True, False]
    )
    return gi, gw


def backward(explicit_nhwc, stride_1x1, inputs):
    inputs = list(inputs)
    if len(inputs) not in (14, 15):
        raise ValueError(
            f"fast_bottleneck.backward: inputs must hold 14 tensors (15 with a downsample), got {len(inputs)}"
        )
    x, w1, w2, w3, s1, s2, _s3, _b1, _b2, _b3, grad_conv3, grad_conv4, out1, out2 = inputs[:14]
    with torch.no_grad():
        x4, w1, w2, w3 = (nchw(t, explicit_nhwc) for t in (x, w1, w2, w3))
        grad_conv3, grad_conv4, out1, out2 = (nchw(t, explicit_nhwc) for t in (grad_conv3, grad_conv4, out1, out2))
        s1, s2 = (t.reshape(1, -1, 1, 1).to(x.dtype) for t in (s1, s2))
        grad_out2, grad_w3 = _conv_grads(grad_conv3, out2, w3, 1, 0)
        grad_z2 = torch.where(out2 > 0, grad_out2, 0) * s2
        grad_out1, grad_w2 = _conv_grads(grad_z2, out1, w2, 1, 1)
        grad_z1 = torch.where(out1 > 0, grad_out1, 0) * s1
        grad_x, grad_w1 = _conv_grads(grad_z1, x4, w1, stride_1x1, 0)
        grads = [grad_w1, grad_w2, grad_w3]
        if len(inputs) == 15:
            w4 = nchw(inputs[14], explicit_nhwc)
            grad_x4, grad_w4 = _conv_grads(grad_conv4, x4, w4, stride_1x1, 0)
            grad_x = grad_x + grad_x4
            grads.append(grad_w4)
        else:
            grad_x = grad_x + grad_conv4
    return [from_nchw(grad_x, explicit_nhwc), *(from_nchw(g, explicit_nhwc) for g in grads)]


_SPATIAL = (
    "forward_init",
    "forward_out1",
    "forward_out2",
    "forward_out2_mask",
    "forward_out2_halo",
    "forward_out2_halo_corr",
    "forward_out2_pad",
    "forward_rest",
    "backward_init",
    "backward_grad_out2",
    "backward_grad_out1",
    "backward_grad_out1_mask",
    "backward_grad_out1_halo",
    "backward_grad_out1_halo_corr",
    "backward_wgrad1",
    "backward_wgrad2",
    "backward_wgrad2_pad",
    "backward_wgrad2_halo",
    "backward_wgrad3",
    "backward_rest",
)


def _not_implemented(name: str):
    def function(*args, **kwargs):
        raise NotImplementedError(
            f"fast_bottleneck.{name}: upstream's decomposed spatial bottleneck (cuDNN buffers filled piece by "
            "piece) is not implemented; use apex.contrib.bottleneck.SpatialBottleneck"
        )

    function.__name__ = name
    return function


for _name in _SPATIAL:
    globals()[_name] = _not_implemented(_name)
__all__ += list(_SPATIAL)
