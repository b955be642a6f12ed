"""Group norm with an optional fused SiLU, in PyTorch: the CPU path, the CUDA fallback, the spec.

Layout: ``x`` is ``(N, *spatial, C)`` and contiguous, the memory order of a channels-last tensor
(``nchw.movedim(1, -1)`` of a channels-last ``nchw`` is such a view, without a copy). Group ``g``
of sample ``n`` is channels ``g*C/G .. (g+1)*C/G - 1`` at every spatial position: ``M = HW * C/G``
elements, normalized by their mean and ``rstd = 1/sqrt(var + eps)`` (biased variance):

    z = (x - mean[n, g]) * rstd[n, g] * weight[c] + bias[c]
    y = z * sigmoid(z)   with SiLU, else y = z

in float32 for every input dtype, ``y`` rounded once to ``x``'s dtype. An empty group (no spatial
positions) has mean 0 and variance 0.

Backward, with ``xhat = (x - mean) * rstd`` and ``g = dy * dy/dz`` (SiLU's derivative
``s * (1 + z * (1 - s))``, ``s = sigmoid(z)``, recomputed from ``x``, not saved):

    dbias[c] = sum_{n, hw} g            dweight[c] = sum_{n, hw} g * xhat
    dx = rstd * (g * w - A / M - xhat * B / M),  A = sum_group g * w,  B = sum_group g * w * xhat

(the sums over each (n, g)). Every sum is float32 (no Python loops over groups: the groups are a
dimension of a view).
"""

from __future__ import annotations

import math

import torch


def _grouped(t: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``(N, HW, G, C/G)`` float32 view (or copy, for 16-bit ``t``) of an ``(N, *, C)`` tensor."""
    n, c = t.shape[0], t.shape[-1]
    return t.reshape(n, math.prod(t.shape[1:-1]), num_groups, c // num_groups).float()


def statistics(x: torch.Tensor, num_groups: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """mean and rstd, float32 ``(N, G)``, of ``x`` ``(N, *, C)``; differentiable in ``x``."""
    xg = _grouped(x, num_groups)
    count = max(xg.shape[1] * xg.shape[3], 1)
    mean = xg.sum((1, 3)) / count
    var = (xg - mean[:, None, :, None]).square().sum((1, 3)) / count
    return mean, torch.rsqrt(var + eps)


def _normalized(x, mean, rstd, num_groups):
    """xhat as float32 ``(N, HW, C)``."""
    xg = _grouped(x, num_groups)
    xhat = (xg - mean[:, None, :, None]) * rstd[:, None, :, None]
    return xhat.reshape(xg.shape[0], xg.shape[1], x.shape[-1])


def _affine(xhat, weight, bias):
    z = xhat if weight is None else xhat * weight.float()
    return z if bias is None else z + bias.float()


def forward(x, weight, bias, num_groups: int, eps: float, silu: bool):
    """(y in x's dtype and shape, mean, rstd)."""
    mean, rstd = statistics(x, num_groups, eps)
    z = _affine(_normalized(x, mean, rstd, num_groups), weight, bias)
    y = torch.nn.functional.silu(z) if silu else z
    return y.to(x.dtype).reshape(x.shape), mean, rstd


def backward(dy, x, weight, bias, mean, rstd, num_groups: int, silu: bool):
    """(dx in x's dtype, dweight in weight's dtype or None, dbias in bias's dtype or None).

    Differentiable in every tensor argument (a double backward recomputes mean and rstd from x
    with :func:`statistics` and passes them here)."""
    n, c = x.shape[0], x.shape[-1]
    xhat = _normalized(x, mean, rstd, num_groups)
    g = dy.reshape(xhat.shape).float()
    if silu:
        z = _affine(xhat, weight, bias)
        s = torch.sigmoid(z)
        g = g * (s * (1 + z * (1 - s)))
    dweight = None if weight is None else (g * xhat).sum((0, 1)).to(weight.dtype)
    dbias = None if bias is None else g.sum((0, 1)).to(bias.dtype)
    gw = g if weight is None else g * weight.float()
    hw, cg = xhat.shape[1], c // num_groups
    count = max(hw * cg, 1)
    gw_g = gw.reshape(n, hw, num_groups, cg)
    xhat_g = xhat.reshape(n, hw, num_groups, cg)
    a = gw_g.sum((1, 3))[:, None, :, None] / count
    b = (gw_g * xhat_g).sum((1, 3))[:, None, :, None] / count
    dx = rstd[:, None, :, None] * (gw_g - a - xhat_g * b)
    return dx.to(x.dtype).reshape(x.shape), dweight, dbias
