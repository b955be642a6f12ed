"""apex_contrib_conv_bias_relu's dispatcher ops: schemas, checks, references, fakes, and autograd.

A 2-D convolution (groups 1, dilation 1, the same ``padding`` and ``stride`` along H and W) of
``x [N, C, H, W]`` with ``weight [K, C, R, S]`` into ``[N, K, P, Q]``, followed by an epilogue:

- ``conv_bias_forward``:                ``conv(x, w) + bias``
- ``conv_bias_relu_forward``:           ``relu(conv(x, w) + bias)``
- ``conv_bias_mask_relu_forward``:      ``relu((conv(x, w) + bias) * mask)``
- ``conv_frozen_scale_bias_relu_forward``: ``relu(conv(x, w) * scale + bias)``

``bias`` and ``scale`` hold one value per output channel, shaped ``(1, K, 1, 1)`` (upstream's
shape) or ``(K,)``; ``mask`` has the output's shape, dtype int8, uint8, bool or ``x``'s dtype.
``x``, ``weight``, ``bias`` and ``scale`` share one dtype: float32, float16 or bfloat16, in any
memory format; outputs and ``grad_x`` take ``x``'s memory format (channels-last or contiguous),
``grad_weight`` takes ``weight``'s.

Backward ops (the ReLU's derivative is read from the saved output, ``out > 0``, as upstream does;
no pre-activation is kept):

- ``conv_bias_relu_backward(x, weight, out, grad_out, padding, stride, mask=None)
  -> (grad_x, grad_weight, grad_bias)``; with ``mask`` the gradient is also multiplied by the mask
  (equal to upstream's for a 0/1 mask; right for any other mask values as well);
- ``conv_bias_backward(x, weight, grad_out, padding, stride) -> (grad_x, grad_weight, grad_bias)``;
- ``conv_frozen_scale_bias_relu_backward(x, weight, scale, out, grad_out, padding, stride)
  -> (grad_x, grad_weight)`` (scale and bias are frozen: no gradient, as upstream).

``grad_bias`` is float32, shaped ``(1, K, 1, 1)`` (upstream's), summed in float32.

There is no custom kernel: every op is its PyTorch reference, ``aten.convolution`` /
``aten.convolution_backward`` (cuDNN's convolution on CUDA, oneDNN or the native one on the CPU)
and PyTorch's element-wise kernels for the epilogue, in as few passes as PyTorch allows:
the bias is added by the convolution, the ReLU (and the mask) run in place on its output; the
frozen scale is folded into the weight (``weight * scale``, a weight-sized product rounded once)
so that its forward is a convolution with bias and an in-place ReLU too. The backward's ReLU
derivative is one ``threshold_backward`` pass over the output.
"""

from __future__ import annotations

import contextlib

import torch

from apex.contrib.conv_bias_relu._plugin import KERNELS
from apex.core import checks
from apex.core.library import autograd, op

MASK_DTYPES = (torch.int8, torch.uint8, torch.bool)
_DTYPE_NAMES = "float32, float16, bfloat16"


# checks ----------------------------------------------------------------------------------------


def _memory_format(t: torch.Tensor) -> torch.memory_format:
    """channels_last for a channels-last tensor that is not also contiguous; else contiguous."""
    if not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def output_size(size: int, kernel: int, padding: int, stride: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def _check_float(op: str, name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected {dtype}, x's dtype")
    checks.placed(op, name, t, device)


def _check_channels(op: str, name: str, t: torch.Tensor, channels: int) -> None:
    """One value per output channel: shape (1, K, 1, 1) or (K,)."""
    if tuple(t.shape) not in ((1, channels, 1, 1), (channels,)):
        raise ValueError(
            f"{op}: {name} must have shape (1, {channels}, 1, 1) or ({channels},) (one value per output "
            f"channel of weight), got {tuple(t.shape)}"
        )


def _check_conv(a) -> tuple[int, ...]:
    """Check x, weight, padding and stride; return the output's shape."""
    op, x, w = a.op, a.x, a.weight
    if x.dtype not in checks.FLOAT_DTYPES:
        raise TypeError(f"{op}: x has dtype {x.dtype}; expected one of {_DTYPE_NAMES}")
    if x.dim() != 4:
        raise ValueError(f"{op}: x must be 4-D (N, C, H, W), got shape {tuple(x.shape)}")
    checks.placed(op, "x", x, x.device)
    _check_float(op, "weight", w, x.dtype, x.device)
    if w.dim() != 4:
        raise ValueError(f"{op}: weight must be 4-D (K, C, R, S), got shape {tuple(w.shape)}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(
            f"{op}: weight has {w.shape[1]} input channels (shape {tuple(w.shape)}) but x has {x.shape[1]} "
            f"(shape {tuple(x.shape)}); groups are not supported"
        )
    if w.shape[0] < 1:
        raise ValueError(f"{op}: weight must have at least one output channel, got shape {tuple(w.shape)}")
    if a.padding < 0:
        raise ValueError(f"{op}: padding must be >= 0, got {a.padding}")
    if a.stride < 1:
        raise ValueError(f"{op}: stride must be >= 1, got {a.stride}")
    sizes = [output_size(x.shape[d], w.shape[d], a.padding, a.stride) for d in (2, 3)]
    if min(sizes) < 1 or min(w.shape[2:]) < 1:
        raise ValueError(
            f"{op}: weight's kernel {tuple(w.shape[2:])} does not fit x's input (H, W) {tuple(x.shape[2:])} "
            f"padded by {a.padding}"
        )
    return (x.shape[0], w.shape[0], *sizes)


def _check_forward(a) -> None:
    a.out_shape = _check_conv(a)
    channels = a.weight.shape[0]
    _check_float(a.op, "bias", a.bias, a.x.dtype, a.x.device)
    _check_channels(a.op, "bias", a.bias, channels)
    scale = getattr(a, "scale", None)
    if scale is not None:
        _check_float(a.op, "scale", scale, a.x.dtype, a.x.device)
        _check_channels(a.op, "scale", scale, channels)
    mask = getattr(a, "mask", None)
    if mask is not None:
        _check_mask(a, mask)


def _check_mask(a, mask: torch.Tensor) -> None:
    if mask.dtype not in (*MASK_DTYPES, a.x.dtype):
        raise TypeError(f"{a.op}: mask has dtype {mask.dtype}; expected int8, uint8, bool or {a.x.dtype} (x's)")
    checks.placed(a.op, "mask", mask, a.x.device)
    if tuple(mask.shape) != tuple(a.out_shape):
        raise ValueError(f"{a.op}: mask must have the output's shape {tuple(a.out_shape)}, got {tuple(mask.shape)}")


def _check_grad(a, name: str, t: torch.Tensor) -> None:
    _check_float(a.op, name, t, a.x.dtype, a.x.device)
    if tuple(t.shape) != tuple(a.out_shape):
        raise ValueError(f"{a.op}: {name} must have the output's shape {tuple(a.out_shape)}, got {tuple(t.shape)}")


def _check_relu_backward(a) -> None:
    a.out_shape = _check_conv(a)
    _check_grad(a, "out", a.out)
    _check_grad(a, "grad_out", a.grad_out)
    if a.mask is not None:
        _check_mask(a, a.mask)


def _check_bias_backward(a) -> None:
    a.out_shape = _check_conv(a)
    _check_grad(a, "grad_out", a.grad_out)


def _check_scale_backward(a) -> None:
    a.out_shape = _check_conv(a)
    _check_float(a.op, "scale", a.scale, a.x.dtype, a.x.device)
    _check_channels(a.op, "scale", a.scale, a.weight.shape[0])
    _check_grad(a, "out", a.out)
    _check_grad(a, "grad_out", a.grad_out)


# references ------------------------------------------------------------------------------------


def _no_autocast(device: torch.device):
    """The references compute in their inputs' dtype: an enclosing autocast region must not recast
    the convolution inside them (the public functions cast their inputs once, as upstream's
    custom_fwd does)."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _conv(a, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.ops.aten.convolution(a.x, weight, bias, [a.stride] * 2, [a.padding] * 2, [1, 1], False, [0, 0], 1)
    return out.contiguous(memory_format=_memory_format(a.x))


def _folded_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``weight * scale`` per output channel, in float32 and rounded once to weight's dtype."""
    folded = weight.float() * scale.float().reshape(-1, 1, 1, 1)
    return folded.to(weight.dtype).contiguous(memory_format=_memory_format(weight))


def _conv_backward(a, grad_z: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x, grad_w, _ = torch.ops.aten.convolution_backward(
        grad_z, a.x, weight, None, [a.stride] * 2, [a.padding] * 2, [1, 1], False, [0, 0], 1, [True, True, False]
    )
    return grad_x.contiguous(memory_format=_memory_format(a.x)), grad_w.contiguous(
        memory_format=_memory_format(a.weight)
    )


def _grad_bias(grad_z: torch.Tensor) -> torch.Tensor:
    return grad_z.sum((0, 2, 3), dtype=torch.float32).reshape(1, -1, 1, 1)


def _forward_fake(a):
    return a.x.new_empty(a.out_shape).contiguous(memory_format=_memory_format(a.x))


def _grads_fake(a, with_bias: bool = True):
    grad_x = torch.empty_like(a.x, memory_format=_memory_format(a.x))
    grad_w = torch.empty_like(a.weight, memory_format=_memory_format(a.weight))
    if not with_bias:
        return grad_x, grad_w
    return grad_x, grad_w, a.x.new_empty((1, a.weight.shape[0], 1, 1), dtype=torch.float32)


@op(
    KERNELS,
    "conv_bias_forward(Tensor x, Tensor weight, Tensor bias, int padding, int stride) -> Tensor",
    check=_check_forward,
    fake=_forward_fake,
)
def conv_bias_forward(a):
    with _no_autocast(a.x.device):
        return _conv(a, a.weight, a.bias.reshape(-1))


@op(
    KERNELS,
    "conv_bias_relu_forward(Tensor x, Tensor weight, Tensor bias, int padding, int stride) -> Tensor",
    check=_check_forward,
    fake=_forward_fake,
)
def conv_bias_relu_forward(a):
    with _no_autocast(a.x.device):
        return _conv(a, a.weight, a.bias.reshape(-1)).relu_()


@op(
    KERNELS,
    "conv_bias_mask_relu_forward(Tensor x, Tensor weight, Tensor bias, Tensor mask, int padding, int stride) -> Tensor",
    check=_check_forward,
    fake=_forward_fake,
)
def conv_bias_mask_relu_forward(a):
    with _no_autocast(a.x.device):
        return _conv(a, a.weight, a.bias.reshape(-1)).mul_(a.mask).relu_()


@op(
    KERNELS,
    "conv_frozen_scale_bias_relu_forward(Tensor x, Tensor weight, Tensor scale, Tensor bias, int padding, "
    "int stride) -> Tensor",
    check=_check_forward,
    fake=_forward_fake,
)
def conv_frozen_scale_bias_relu_forward(a):
    with _no_autocast(a.x.device):
        return _conv(a, _folded_weight(a.weight, a.scale), a.bias.reshape(-1)).relu_()


@op(
    KERNELS,
    "conv_bias_relu_backward(Tensor x, Tensor weight, Tensor out, Tensor grad_out, int padding, int stride, "
    "Tensor? mask=None) -> (Tensor, Tensor, Tensor)",
    check=_check_relu_backward,
    fake=_grads_fake,
)
def conv_bias_relu_backward(a):
    with _no_autocast(a.x.device):
        grad_z = torch.ops.aten.threshold_backward(a.grad_out, a.out, 0)
        if a.mask is not None:
            grad_z.mul_(a.mask)
        return *_conv_backward(a, grad_z, a.weight), _grad_bias(grad_z)


@op(
    KERNELS,
    "conv_bias_backward(Tensor x, Tensor weight, Tensor grad_out, int padding, int stride) -> (Tensor, Tensor, Tensor)",
    check=_check_bias_backward,
    fake=_grads_fake,
)
def conv_bias_backward(a):
    with _no_autocast(a.x.device):
        return *_conv_backward(a, a.grad_out, a.weight), _grad_bias(a.grad_out)


@op(
    KERNELS,
    "conv_frozen_scale_bias_relu_backward(Tensor x, Tensor weight, Tensor scale, Tensor out, Tensor grad_out, "
    "int padding, int stride) -> (Tensor, Tensor)",
    check=_check_scale_backward,
    fake=lambda a: _grads_fake(a, with_bias=False),
)
def conv_frozen_scale_bias_relu_backward(a):
    with _no_autocast(a.x.device):
        grad_z = torch.ops.aten.threshold_backward(a.grad_out, a.out, 0)
        grad_x, grad_w = _conv_backward(a, grad_z, _folded_weight(a.weight, a.scale))
        # d out / d weight carries the scale: grad_w * scale per output channel, in float32, rounded once
        grad_w = (grad_w.float() * a.scale.float().reshape(-1, 1, 1, 1)).to(grad_w.dtype)
        return grad_x, grad_w.contiguous(memory_format=_memory_format(a.weight))


# autograd --------------------------------------------------------------------------------------
# Gradients for x, weight and bias (upstream's); none for the mask, the frozen scale and bias, or
# padding and stride. The bias gradient (float32 from the op) is returned in bias's shape and dtype.
# The backward ops are not themselves differentiable: a second derivative raises.


def _no_double_backward(grad: torch.Tensor) -> None:
    # (not read while Dynamo traces the backward: torch 2.6's refuses .requires_grad there)
    if not torch.compiler.is_compiling() and grad.requires_grad:
        raise RuntimeError("conv_bias_relu: a second derivative is not supported")


def _relu_setup_context(ctx, inputs, output) -> None:
    x, weight, bias, padding, stride = inputs
    ctx.save_for_backward(x, weight, output)
    ctx.bias_meta = (bias.shape, bias.dtype)
    ctx.padding, ctx.stride = padding, stride


def _relu_backward(ctx, grad_out):
    _no_double_backward(grad_out)
    x, weight, out = ctx.saved_tensors
    grad_x, grad_w, grad_b = conv_bias_relu_backward(x, weight, out, grad_out, ctx.padding, ctx.stride)
    return grad_x, grad_w, grad_b.reshape(ctx.bias_meta[0]).to(ctx.bias_meta[1]), None, None


def _bias_setup_context(ctx, inputs, output) -> None:
    x, weight, bias, padding, stride = inputs
    ctx.save_for_backward(x, weight)
    ctx.bias_meta = (bias.shape, bias.dtype)
    ctx.padding, ctx.stride = padding, stride


def _bias_backward(ctx, grad_out):
    _no_double_backward(grad_out)
    x, weight = ctx.saved_tensors
    grad_x, grad_w, grad_b = conv_bias_backward(x, weight, grad_out, ctx.padding, ctx.stride)
    return grad_x, grad_w, grad_b.reshape(ctx.bias_meta[0]).to(ctx.bias_meta[1]), None, None


def _mask_setup_context(ctx, inputs, output) -> None:
    x, weight, bias, mask, padding, stride = inputs
    ctx.save_for_backward(x, weight, output, mask)
    ctx.bias_meta = (bias.shape, bias.dtype)
    ctx.padding, ctx.stride = padding, stride


def _mask_backward(ctx, grad_out):
    _no_double_backward(grad_out)
    x, weight, out, mask = ctx.saved_tensors
    grad_x, grad_w, grad_b = conv_bias_relu_backward(x, weight, out, grad_out, ctx.padding, ctx.stride, mask)
    return grad_x, grad_w, grad_b.reshape(ctx.bias_meta[0]).to(ctx.bias_meta[1]), None, None, None


def _scale_setup_context(ctx, inputs, output) -> None:
    x, weight, scale, _bias, padding, stride = inputs
    ctx.save_for_backward(x, weight, scale, output)
    ctx.padding, ctx.stride = padding, stride


def _scale_backward(ctx, grad_out):
    _no_double_backward(grad_out)
    x, weight, scale, out = ctx.saved_tensors
    grad_x, grad_w = conv_frozen_scale_bias_relu_backward(x, weight, scale, out, grad_out, ctx.padding, ctx.stride)
    return grad_x, grad_w, None, None, None, None


conv_bias_relu = autograd(conv_bias_relu_forward, _relu_setup_context, _relu_backward, "ConvBiasReLU")
conv_bias = autograd(conv_bias_forward, _bias_setup_context, _bias_backward, "ConvBias")
conv_bias_mask_relu = autograd(conv_bias_mask_relu_forward, _mask_setup_context, _mask_backward, "ConvBiasMaskReLU")
conv_frozen_scale_bias_relu = autograd(
    conv_frozen_scale_bias_relu_forward, _scale_setup_context, _scale_backward, "ConvFrozenScaleBiasReLU"
)
