"""FusedLayerNorm and MixedFusedLayerNorm (upstream's module path: every public name is also importable here)."""

from __future__ import annotations

import torch

from apex.normalization import _ops
from apex.normalization._module import _FusedNorm, _MixedDtype
from apex.normalization.functional import (
    fused_add_layer_norm,
    fused_add_layer_norm_affine,
    fused_add_rms_norm,
    fused_add_rms_norm_affine,
    fused_layer_norm,
    fused_layer_norm_affine,
    fused_rms_norm,
    fused_rms_norm_affine,
    mixed_dtype_fused_layer_norm_affine,
    mixed_dtype_fused_rms_norm_affine,
    normalized_shape_tuple,
)


class FusedLayerNorm(_FusedNorm):
    r"""Layer normalization over the last dimensions of the input (Ba et al., 2016), as ``torch.nn.LayerNorm``.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot \gamma + \beta

    Mean and (biased) variance are computed in float32 over the last ``len(normalized_shape)``
    dimensions, in training and evaluation alike. The output has the input's dtype; ``weight`` and
    ``bias`` may be in the input's dtype or float32 (see :class:`MixedFusedLayerNorm` for a float32
    output). On CUDA one fused kernel computes the forward, one the backward (input, weight and bias
    gradients, reduced deterministically); on the CPU, or without a built kernel, a PyTorch
    reference runs.

    Args:
        normalized_shape (int or sequence of int): the trailing shape to normalize over.
        eps (float): added to the variance for numerical stability. Default: 1e-5.
        elementwise_affine (bool): learnable ``weight`` (ones) and ``bias`` (zeros) of
            ``normalized_shape``. Default: True.
        memory_efficient (bool): save the output instead of the input for backward and recompute
            the normalized values from it. Saves the input tensor (and the per-row means) when the
            output is kept anyway, as it is when a linear layer follows. Needs a weight without
            zeros. Default: False.
        device, dtype: of the parameters (keyword only).

    ``forward(input, residual=None)``: with ``residual``, returns ``(norm(input + residual),
    input + residual)`` from one kernel, the sum rounded to the input's dtype.

    Shape: input ``(*, *normalized_shape)``; output the same.
    """

    _rms = False
    _mixed = False


class MixedFusedLayerNorm(_MixedDtype, FusedLayerNorm):
    """:class:`FusedLayerNorm` whose output has the parameters' dtype: float32 parameters with float16
    or bfloat16 input give a float32 output. Always affine (``elementwise_affine=False`` is refused)."""


# Upstream's autograd Functions, with its names and argument orders (Megatron-Core calls
# FusedLayerNormAffineFunction.apply and looks for ``memory_efficient`` in forward's signature).
# They call the same ops as the functions above and save what the ops' registered autograd saves;
# their backward is differentiable (double backward) as the ops' is. Unlike the functions, they do
# not cast under autocast (upstream's do not either).


def _function_forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient, rms, mixed):
    shape = normalized_shape_tuple(normalized_shape)
    input = input.contiguous()
    weight = None if weight is None else weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    output_dtype = weight.dtype if mixed else None
    out, mean, rstd = _ops.norm_forward(input, weight, bias, shape, eps, rms, memory_efficient, output_dtype)
    _ops.save(ctx, input, out, weight, bias, mean, rstd, shape, eps, rms, memory_efficient, input.dtype)
    return out


class FusedLayerNormAffineFunction(torch.autograd.Function):
    """Layer norm with weight and bias: ``apply(input, weight, bias, normalized_shape, eps,
    memory_efficient=False)``; the output in the input's dtype."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False):
        return _function_forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient, False, False)

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight, grad_bias = _ops.backward(ctx, grad_output)
        return grad_input, grad_weight, grad_bias, None, None, None


class FusedLayerNormAffineMixedDtypesFunction(FusedLayerNormAffineFunction):
    """:class:`FusedLayerNormAffineFunction` with the output in the weight's dtype."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False):
        return _function_forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient, False, True)


class FusedLayerNormFunction(torch.autograd.Function):
    """Layer norm without affine parameters: ``apply(input, normalized_shape, eps, memory_efficient=False)``."""

    @staticmethod
    def forward(ctx, input, normalized_shape, eps, memory_efficient=False):
        return _function_forward(ctx, input, None, None, normalized_shape, eps, memory_efficient, False, False)

    @staticmethod
    def backward(ctx, grad_output):
        return _ops.backward(ctx, grad_output)[0], None, None, None


class FusedRMSNormAffineFunction(torch.autograd.Function):
    """RMS norm with a weight: ``apply(input, weight, normalized_shape, eps, memory_efficient=False)``."""

    @staticmethod
    def forward(ctx, input, weight, normalized_shape, eps, memory_efficient=False):
        return _function_forward(ctx, input, weight, None, normalized_shape, eps, memory_efficient, True, False)

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight, _ = _ops.backward(ctx, grad_output)
        return grad_input, grad_weight, None, None, None


class FusedRMSNormAffineMixedDtypesFunction(FusedRMSNormAffineFunction):
    """:class:`FusedRMSNormAffineFunction` with the output in the weight's dtype."""

    @staticmethod
    def forward(ctx, input, weight, normalized_shape, eps, memory_efficient=False):
        return _function_forward(ctx, input, weight, None, normalized_shape, eps, memory_efficient, True, True)


class FusedRMSNormFunction(torch.autograd.Function):
    """RMS norm without a weight: ``apply(input, normalized_shape, eps, memory_efficient=False)``."""

    @staticmethod
    def forward(ctx, input, normalized_shape, eps, memory_efficient=False):
        return _function_forward(ctx, input, None, None, normalized_shape, eps, memory_efficient, True, False)

    @staticmethod
    def backward(ctx, grad_output):
        return _ops.backward(ctx, grad_output)[0], None, None, None


from apex.normalization.fused_rms_norm import FusedRMSNorm, MixedFusedRMSNorm  # noqa: E402

__all__ = [
    "FusedLayerNorm",
    "FusedLayerNormAffineFunction",
    "FusedLayerNormAffineMixedDtypesFunction",
    "FusedLayerNormFunction",
    "FusedRMSNorm",
    "FusedRMSNormAffineFunction",
    "FusedRMSNormAffineMixedDtypesFunction",
    "FusedRMSNormFunction",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "fused_add_layer_norm",
    "fused_add_layer_norm_affine",
    "fused_add_rms_norm",
    "fused_add_rms_norm_affine",
    "fused_layer_norm",
    "fused_layer_norm_affine",
    "fused_rms_norm",
    "fused_rms_norm_affine",
    "mixed_dtype_fused_layer_norm_affine",
    "mixed_dtype_fused_rms_norm_affine",
]
