"""Upstream Apex's ``group_norm_cuda`` extension module, on apex-contrib-group-norm's ops.

Upstream's functions and argument orders; they run on the CPU too (the PyTorch references) and
take any ``groups`` dividing C and any C:

- ``forward(input, groups, weight, bias, eps, passes, with_swish=False) -> [output, sums]``:
  ``input`` 4-D channels-last; ``output`` channels-last; ``sums`` float32 ``(2 * N * groups,)``,
  (mean, rstd) pairs per (sample, group) (upstream's buffer had its kernels' own layout; only
  ``backward`` reads it);
- ``backward(grad_output, sums, input, groups, weight, bias, eps, passes, with_swish=False)
  -> [grad_input, grad_weight, grad_bias]``.

``passes`` chose between upstream's two kernels; one kernel serves both here (1 or 2 accepted).
"""

from __future__ import annotations

import torch

from apex.contrib.group_norm import group_norm as _gn


def _act(with_swish: bool) -> str:
    return "silu" if with_swish else ""


def forward(
    input: torch.Tensor,
    groups: int,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    passes: int,
    with_swish: bool = False,
) -> list[torch.Tensor]:
    with torch.no_grad():
        y, sums = _gn.group_norm_nhwc_fprop(input, groups, weight, bias, eps, _act(with_swish), passes)
    return [y, sums]


def backward(
    grad_output: torch.Tensor,
    sums: torch.Tensor,
    input: torch.Tensor,
    groups: int,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    passes: int,
    with_swish: bool = False,
) -> list[torch.Tensor]:
    dx, dweight, dbias = _gn.group_norm_nhwc_bprop(
        grad_output, sums, input, groups, weight, bias, eps, _act(with_swish), passes
    )
    return [dx, dweight, dbias]


__all__ = ["backward", "forward"]
