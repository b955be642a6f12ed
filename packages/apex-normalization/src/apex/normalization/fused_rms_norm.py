"""FusedRMSNorm and MixedFusedRMSNorm."""

from __future__ import annotations

from apex.normalization._module import _FusedNorm, _MixedDtype


class FusedRMSNorm(_FusedNorm):
    r"""Root-mean-square normalization over the last dimensions of the input (Zhang & Sennrich, 2019),
    as ``torch.nn.RMSNorm``.

    .. math::
        y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} \cdot \gamma

    The mean square is computed in float32 over the last ``len(normalized_shape)`` dimensions. The
    output has the input's dtype; ``weight`` may be in the input's dtype or float32 (see
    :class:`MixedFusedRMSNorm` for a float32 output). On CUDA one fused kernel computes the forward,
    one the backward (input and weight gradients, reduced deterministically); on the CPU, or
    without a built kernel, a PyTorch reference runs.

    Args:
        normalized_shape (int or sequence of int): the trailing shape to normalize over.
        eps (float): added to the mean square for numerical stability. Default: 1e-5.
        elementwise_affine (bool): a learnable ``weight`` of ``normalized_shape``, initialized to
            ones. Default: True.
        memory_efficient (bool): save the output instead of the input for backward and recompute
            the normalized values from it. Saves the input tensor when the output is kept anyway, as
            it is when a linear layer follows. Needs a weight without zeros. Default: False.
        device, dtype: of the parameters (keyword only).

    ``forward(input, residual=None)``: with ``residual``, returns ``(norm(input + residual),
    input + residual)`` from one kernel, the sum rounded to the input's dtype.

    Shape: input ``(*, *normalized_shape)``; output the same.
    """

    _rms = True
    _mixed = False


class MixedFusedRMSNorm(_MixedDtype, FusedRMSNorm):
    """:class:`FusedRMSNorm` whose output has the weight's dtype: a float32 weight with float16 or
    bfloat16 input gives a float32 output. Always affine (``elementwise_affine=False`` is refused)."""
