"""Layer norm and RMS norm, forward and backward, in plain PyTorch: the specification of the kernels.

The rows are the leading dimensions of the input, the normalized elements its last ``ndim``
dimensions (``H`` of them per row). With ``x`` a row in float32:

- layer norm: ``mean = sum(x) / H``, ``var = sum((x - mean)^2) / H`` (biased), ``xhat = (x - mean) * rstd``;
- RMS norm: ``var = sum(x^2) / H``, ``xhat = x * rstd``; no mean, no bias;

with ``rstd = 1 / sqrt(var + eps)`` and ``y = xhat * weight + bias`` rounded once to the output
dtype. Statistics and arithmetic are float32 for every storage dtype (float64 inputs stay
float64, which ``gradcheck`` uses). With a residual, the norm is applied to ``x + residual``
rounded to the input's dtype: the same sum that is returned, so the fused call equals the
unfused one.

Backward, with ``wdy = weight * dy`` (``dy`` when there is no weight)::

    dx = rstd * (wdy - xhat * mean(wdy * xhat) - mean(wdy))      # layer norm
    dx = rstd * (wdy - xhat * mean(wdy * xhat))                  # RMS norm
    dweight = sum over rows of dy * xhat,   dbias = sum over rows of dy

``xhat`` comes from the saved input and statistics, or, with ``memory_efficient``, from the
saved output: ``xhat = (y - bias) / weight`` (this needs a weight without zeros).
"""

from __future__ import annotations

import math

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_shape(shape, ndim: int) -> tuple:
    """The shape of per-row statistics broadcast against a tensor of ``shape``."""
    return (*shape[: len(shape) - ndim], *([1] * ndim))


def norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    ndim: int,
    eps: float,
    rms: bool,
    output_dtype: torch.dtype,
    residual: torch.Tensor | None = None,
):
    """Returns ``(output, residual_out or None, mean or None, rstd)``; mean and rstd have the
    input's leading shape and the compute dtype."""
    cdt = compute_dtype(x.dtype)
    residual_out = None
    if residual is not None:
        residual_out = (x.to(cdt) + residual.to(cdt)).to(x.dtype)
        x = residual_out
    xf = x.to(cdt)
    dims = tuple(range(-ndim, 0))
    if rms:
        mean = None
        centered = xf
    else:
        mean = xf.mean(dims, keepdim=True)
        centered = xf - mean
    var = centered.square().mean(dims, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    y = centered * rstd
    if weight is not None:
        y = y * weight.to(cdt)
    if bias is not None:
        y = y + bias.to(cdt)
    lead = x.shape[: x.dim() - ndim]
    return (
        y.to(output_dtype),
        residual_out,
        None if mean is None else mean.reshape(lead),
        rstd.reshape(lead),
    )


def _sum_rows(t: torch.Tensor, ndim: int) -> torch.Tensor:
    lead = tuple(range(t.dim() - ndim))
    return t.sum(lead) if lead else t  # sum(()) would reduce every dimension


def norm_backward(
    grad_output: torch.Tensor,
    saved: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    ndim: int,
    rms: bool,
    memory_efficient: bool,
    input_dtype: torch.dtype,
    weight_grads: bool = True,
    grad_residual_out: torch.Tensor | None = None,
):
    """Returns ``(grad_input, grad_weight or None, grad_bias or None)``.

    ``saved`` is the input (or the residual sum) normally, the output with ``memory_efficient``;
    ``grad_residual_out``, the gradient of the returned residual sum, is added to ``grad_input``.
    """
    cdt = compute_dtype(input_dtype)
    row_shape = _row_shape(saved.shape, ndim)
    rstd_b = rstd.to(cdt).reshape(row_shape)
    dy = grad_output.to(cdt)
    w = None if weight is None else weight.to(cdt)
    if memory_efficient:
        xhat = saved.to(cdt)
        if bias is not None:
            xhat = xhat - bias.to(cdt)
        if w is not None:
            xhat = xhat / w
    else:
        xf = saved.to(cdt)
        xhat = (xf if rms else xf - mean.to(cdt).reshape(row_shape)) * rstd_b
    wdy = dy if w is None else dy * w
    dims = tuple(range(-ndim, 0))
    hidden = math.prod(saved.shape[saved.dim() - ndim :])
    projection = (wdy * xhat).sum(dims, keepdim=True) / hidden
    inner = wdy - xhat * projection
    if not rms:
        inner = inner - wdy.sum(dims, keepdim=True) / hidden
    grad_input = rstd_b * inner
    if grad_residual_out is not None:
        grad_input = grad_input + grad_residual_out.to(cdt)
    grad_weight = grad_bias = None
    if weight_grads and weight is not None:
        grad_weight = _sum_rows(dy * xhat, ndim).to(weight.dtype)
        if bias is not None:
            grad_bias = _sum_rows(dy, ndim).to(bias.dtype)
    return grad_input.to(input_dtype), grad_weight, grad_bias
