"""FusedLayerNorm and MixedFusedLayerNorm (upstream's module path: every public name is also importable here)."""

from __future__ import annotations

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


from apex.normalization.fused_rms_norm import FusedRMSNorm, MixedFusedRMSNorm  # noqa: E402

__all__ = [
    "FusedLayerNorm",
    "FusedRMSNorm",
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
