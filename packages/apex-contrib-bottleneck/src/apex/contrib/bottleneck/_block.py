"""The bottleneck block's math on tensors: 1x1 -> 3x3 -> 1x1 convolutions, each followed by a frozen batch
norm folded into a per-channel scale and bias, ReLUs, and the residual (through a 1x1 downsample where
there is one). Shared by ``Bottleneck``, ``SpatialBottleneck`` and the legacy ``fast_bottleneck``.

Every tensor is seen in logical NCHW (an explicit-NHWC tensor is permuted to a channels-last view on the
way in and back on the way out); the convolutions with a ReLU are apex-contrib-conv-bias-relu's
``ConvFrozenScaleBiasReLU`` (scale folded into the weight, bias and ReLU fused by PyTorch as far as it
can); the last one adds the residual before its ReLU, in plain PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from apex.contrib.conv_bias_relu import ConvFrozenScaleBiasReLU


def nchw(t: torch.Tensor, explicit_nhwc: bool) -> torch.Tensor:
    """``t`` (an activation [N, H, W, C] or a weight [K, R, S, C] when ``explicit_nhwc``) as NCHW."""
    return t.permute(0, 3, 1, 2) if explicit_nhwc else t


def from_nchw(t: torch.Tensor, explicit_nhwc: bool) -> torch.Tensor:
    return t.permute(0, 2, 3, 1) if explicit_nhwc else t


def frozen_scale_bias(bn, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A frozen batch norm's ``(scale, bias)``, shape ``(C,)``: ``weight / sqrt(running_var)`` and
    ``bias - running_mean * scale`` (no eps, as upstream), computed in the buffers' dtype, then cast."""
    scale = bn.weight * bn.running_var.rsqrt()
    bias = bn.bias - bn.running_mean * scale
    return scale.to(dtype), bias.to(dtype)


class HaloPad(torch.autograd.Function):
    """``y`` [N, C, H, W] -> [N, C, H + 2, W]: one row from each neighbour along H (zeros at the group's
    ends), by ``exchanger.left_right_halo_exchange``. Backward sends each halo's gradient back to the rank
    that owns the row and adds what comes back to this rank's first and last rows."""

    @staticmethod
    def forward(ctx, y, exchanger):
        ctx.exchanger = exchanger
        top, bottom = exchanger.left_right_halo_exchange(y[:, :, :1], y[:, :, -1:])
        return torch.cat([top.to(y.dtype), y, bottom.to(y.dtype)], dim=2)

    @staticmethod
    def backward(ctx, grad):
        from_top, from_bottom = ctx.exchanger.left_right_halo_exchange(grad[:, :, :1], grad[:, :, -1:])
        grad_y = grad[:, :, 1:-1].clone()
        grad_y[:, :, :1] += from_top
        grad_y[:, :, -1:] += from_bottom
        return grad_y, None


def prepare(x, weights, scales, biases, explicit_nhwc: bool):
    """``x`` and ``weights`` as NCHW, ``scales`` and ``biases`` as ``(C,)`` in ``x``'s dtype."""
    return (
        nchw(x, explicit_nhwc),
        [nchw(t, explicit_nhwc) for t in weights],
        [t.reshape(-1).to(x.dtype) for t in scales],
        [t.reshape(-1).to(x.dtype) for t in biases],
    )


def outputs(x, w, s, b, stride: int, exchanger=None):
    """``(out1, out2, out3)`` of the block, NCHW, from :func:`prepare`'s tensors."""
    out1 = ConvFrozenScaleBiasReLU(x, w[0], s[0], b[0], 0, stride)
    if exchanger is None:
        out2 = ConvFrozenScaleBiasReLU(out1, w[1], s[1], b[1], 1, 1)
    else:
        padded = F.pad(HaloPad.apply(out1, exchanger), (1, 1, 0, 0))
        out2 = ConvFrozenScaleBiasReLU(padded, w[1], s[1], b[1], 0, 1)
    z3 = torch.addcmul(b[2].view(1, -1, 1, 1), F.conv2d(out2, w[2]), s[2].view(1, -1, 1, 1))
    if len(w) > 3:
        identity = torch.addcmul(b[3].view(1, -1, 1, 1), F.conv2d(x, w[3], stride=stride), s[3].view(1, -1, 1, 1))
    else:
        identity = x
    return out1, out2, torch.relu(z3 + identity)


def block(x, weights, scales, biases, stride: int, explicit_nhwc: bool, exchanger=None) -> torch.Tensor:
    """The block's output for input ``x``; ``weights`` [w1, w2, w3(, w4)] in ``x``'s layout, ``scales`` and
    ``biases`` per channel (any shape holding C values). With ``exchanger``, ``x`` is this rank's slice of H
    and the 3x3 convolution reads one halo row from each neighbour (autograd included)."""
    out3 = outputs(*prepare(x, weights, scales, biases, explicit_nhwc), stride, exchanger)[2]
    return from_nchw(out3, explicit_nhwc)
