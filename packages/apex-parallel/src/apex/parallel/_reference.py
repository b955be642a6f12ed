"""Synchronized batch norm in plain PyTorch: the specification of the apex_parallel kernels.

Layouts. A channels-first input has shape ``(N, C, *spatial)``; a channels-last input has its
channels in the last dimension, ``(..., C)``. Per channel ``c`` the statistics run over every
other element, ``n`` of them on this rank.

Forward, per rank then over the group (float32 for every storage dtype; float64 stays float64):

- ``welford_mean_var``: ``mean_c``, ``var_c`` (biased) of this rank's elements; both 0 when ``n`` is 0;
- ``welford_parallel``: the pooled mean and biased variance of ranks ``r`` with counts ``n_r``::

      n = sum n_r,  mean = sum n_r mean_r / n,  m2 = sum n_r (var_r + (mean_r - mean)^2)
      invstd = 1 / sqrt(m2 / n + eps)

  and, when given, ``running = (1 - momentum) * running + momentum * stat`` with the unbiased
  variance ``m2 / (n - 1)`` for ``running_var`` (as torch.nn.BatchNorm);
- ``batch_norm_forward``: ``y = (x - mean) * invstd * weight + bias``, then ``+ z`` and ``relu``
  when asked (the channels-last op only), rounded once to the input's dtype.

Backward, with ``dy`` the gradient of the output (after the ReLU mask, ``relu_backward``):

- ``reduce_bn``: ``sum_dy = sum dy``, ``sum_dy_xmu = sum dy * (x - mean)`` over this rank, and the
  local ``grad_weight = sum_dy_xmu * invstd``, ``grad_bias = sum_dy``;
- after the sums are all-reduced over the group, ``batch_norm_backward``::

      dx = (dy - sum_dy / n - (x - mean) * invstd^2 * sum_dy_xmu / n) * invstd * weight
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _channel_view(t: torch.Tensor, channel_last: bool) -> torch.Tensor:
    """``t`` as (rows, C) in the compute dtype, channels last."""
    cdt = compute_dtype(t.dtype)
    if channel_last:
        return t.reshape(-1, t.shape[-1]).to(cdt)
    return t.movedim(1, -1).reshape(-1, t.shape[1]).to(cdt)


def _per_channel(v: torch.Tensor, like: torch.Tensor, channel_last: bool) -> torch.Tensor:
    """A per-channel vector shaped to broadcast against ``like``."""
    if channel_last:
        return v
    return v.reshape((1, -1) + (1,) * (like.dim() - 2))


def welford_mean_var(x: torch.Tensor, channel_last: bool):
    rows = _channel_view(x, channel_last)
    if rows.shape[0] == 0:
        zeros = rows.new_zeros(rows.shape[1])
        return zeros, zeros.clone()
    var, mean = torch.var_mean(rows, dim=0, unbiased=False)
    return mean, var


def welford_parallel(mean, var_biased, count, eps, running_mean=None, running_var=None, momentum=0.1):
    """Merges per-rank ``[W, C]`` statistics with counts ``[W]``; returns ``(mean, invstd)``."""
    counts = count.to(mean.dtype).reshape(-1, 1)
    n = counts.sum(0)
    safe_n = torch.where(n > 0, n, torch.ones_like(n))
    merged = (counts * mean).sum(0) / safe_n
    m2 = (counts * (var_biased + (mean - merged) ** 2)).sum(0)
    var = torch.where(n > 0, m2 / safe_n, torch.zeros_like(m2))
    invstd = torch.rsqrt(var + eps)
    if running_mean is not None:
        unbiased = m2 / (n - 1)
        rm = running_mean.to(merged.dtype) * (1 - momentum) + merged * momentum
        rv = running_var.to(merged.dtype) * (1 - momentum) + unbiased * momentum
        running_mean.copy_(rm)
        running_var.copy_(rv)
    return merged, invstd


def _affine(x, z, mean, invstd, weight, bias, channel_last):
    cdt = compute_dtype(x.dtype)
    scale = invstd if weight is None else invstd * weight.to(cdt)
    y = (x.to(cdt) - _per_channel(mean, x, channel_last)) * _per_channel(scale, x, channel_last)
    if bias is not None:
        y = y + _per_channel(bias.to(cdt), x, channel_last)
    if z is not None:
        y = y + z.to(cdt)
    return y


def batch_norm_forward(x, z, mean, invstd, weight, bias, fuse_relu, channel_last):
    y = _affine(x, z, mean, invstd, weight, bias, channel_last)
    if fuse_relu:
        y = torch.relu(y)
    return y.to(x.dtype)


def relu_backward(grad_output, x, z, mean, invstd, weight, bias, channel_last):
    """``grad_output`` where the pre-activation ``bn(x) + z`` is positive, else 0."""
    y = _affine(x, z, mean, invstd, weight, bias, channel_last)
    return torch.where(y > 0, grad_output, torch.zeros_like(grad_output))


def reduce_bn(grad_output, x, mean, invstd, weight, channel_last):
    dy = _channel_view(grad_output, channel_last)
    xmu = _channel_view(x, channel_last) - mean
    sum_dy = dy.sum(0)
    sum_dy_xmu = (dy * xmu).sum(0)
    if weight is None:
        return sum_dy, sum_dy_xmu, None, None
    return sum_dy, sum_dy_xmu, (sum_dy_xmu * invstd).to(weight.dtype), sum_dy.to(weight.dtype, copy=True)


def batch_norm_backward(grad_output, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count, channel_last):
    cdt = compute_dtype(x.dtype)
    n = count.to(cdt).sum()
    mean_dy = sum_dy / n
    factor = invstd * invstd * sum_dy_xmu / n
    scale = invstd if weight is None else invstd * weight.to(cdt)

    def pc(v):
        return _per_channel(v, x, channel_last)

    xmu = x.to(cdt) - pc(mean)
    dx = (grad_output.to(cdt) - pc(mean_dy) - xmu * pc(factor)) * pc(scale)
    return dx.to(x.dtype)
