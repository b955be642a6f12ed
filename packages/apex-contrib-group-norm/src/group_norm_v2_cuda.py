"""Upstream Apex's ``group_norm_v2_cuda`` extension module (its Blackwell kernels), on
apex-contrib-group-norm's ops.

Upstream's functions, argument names and orders; any GPU, the CPU too, any ``num_groups``
dividing C, float32/float16/bfloat16 (upstream: float16/bfloat16 with weights of the same dtype):

- ``gn(x, w, b, eps, silu, num_groups, mean_var_out=None, sm_margin=0) -> y``: ``x`` 4-D
  channels-last; ``mean_var_out``, if given, a float32 tensor of ``2 * N * num_groups`` elements,
  receives (mean, rstd) pairs per (sample, group), which ``gn_bwd`` reads back as ``mean_var``;
- ``gn_bwd(grad_output, x, w, b, mean_var, eps, silu, num_groups, sm_margin=0)
  -> (grad_input, grad_weight, grad_bias)``.

``sm_margin`` (multiprocessors left free for other work) is accepted and ignored.
"""

from __future__ import annotations

import torch

from apex.contrib.group_norm import group_norm as _gn


def _act(silu: bool) -> str:
    return "silu" if silu else ""


def gn(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    eps: float,
    silu: bool,
    num_groups: int,
    mean_var_out: torch.Tensor | None = None,
    sm_margin: int = 0,
) -> torch.Tensor:
    with torch.no_grad():
        y, sums = _gn.group_norm_nhwc_fprop(x, num_groups, w, b, eps, _act(silu))
        if mean_var_out is not None:
            if mean_var_out.dtype != torch.float32 or mean_var_out.numel() != sums.numel():
                raise ValueError(
                    f"gn: mean_var_out must be float32 with 2 * N * num_groups = {sums.numel()} elements, "
                    f"got {mean_var_out.dtype} with {mean_var_out.numel()}"
                )
            mean_var_out.view(-1).copy_(sums)
    return y


def gn_bwd(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    mean_var: torch.Tensor,
    eps: float,
    silu: bool,
    num_groups: int,
    sm_margin: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _gn.group_norm_nhwc_bprop(grad_output, mean_var.reshape(-1), x, num_groups, w, b, eps, _act(silu))


__all__ = ["gn", "gn_bwd"]
