"""Upstream Apex's ``syncbn`` extension module, on apex-parallel's ops (``torch.ops.apex_parallel``).

Code written against upstream (its ``optimized_sync_batchnorm_kernel``, and projects that call the
kernels directly) imports this module by that name. The functions keep upstream's names, argument
orders, return values (lists, as upstream's bindings return) and dtypes, and call our ops, so they
also run on the CPU (through the PyTorch references):

- ``welford_mean_var[_c_last](input) -> [mean, var_biased]``: float32 statistics (float64 for a
  float64 input);
- ``welford_parallel(mean, var_biased, numel, eps) -> [mean, var, inv_std]``: the merge of ``[W, C]``
  per-rank statistics with per-rank element counts ``numel`` (an integer tensor ``[W]``, as upstream
  passes it, or one int for every rank, as its older releases did); ``var`` is unbiased;
- ``batchnorm_forward(input, mean, inv_std, weight, shift)``,
  ``batchnorm_forward_c_last(input, z, mean, inv_std, weight, shift, fuse_relu)``;
- ``reduce_bn[_c_last](grad_output, input, mean, inv_std, weight) -> [sum_dy, sum_dy_xmu,
  grad_weight, grad_bias]`` (empty weight gradients without a weight);
- ``batchnorm_backward[_c_last](grad_output, input, mean, inv_std, weight, sum_dy, sum_dy_xmu, count)``,
  ``count`` the per-rank element counts;
- ``relu_bw_c_last(grad_output, input, z, mean, inv_std, weight, shift)``: ``grad_output`` where
  ``bn(input) + z`` is positive.

Inputs may be float32, float16, bfloat16 or float64 (upstream's kernels take float32 and float16);
weight and shift float32 or the input's dtype. Inputs are made contiguous first, as upstream's
Python caller does before calling its kernels.
"""

from __future__ import annotations

import torch

from apex.parallel import _ops

_INTEGER_OR_FLOAT = "an integer or floating-point tensor"


def _counts(op: str, name: str, counts, ranks: int | None, like: torch.Tensor) -> torch.Tensor:
    """Upstream's integer per-rank counts as our ops take them: float on ``like``'s device, float64
    for float64 statistics (exact beyond 2^24 elements)."""
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    if isinstance(counts, int) and not isinstance(counts, bool):
        return torch.full((ranks or 1,), float(counts), dtype=dtype, device=like.device)
    if not isinstance(counts, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor of per-rank element counts, got {type(counts).__name__}")
    if counts.dtype == torch.bool or counts.dtype.is_complex or counts.dtype in (torch.float16, torch.bfloat16):
        raise TypeError(f"{op}: {name} has dtype {counts.dtype}; expected {_INTEGER_OR_FLOAT} (int32 as upstream)")
    if counts.dim() != 1:
        raise ValueError(f"{op}: {name} must be 1-D (one count per rank), got shape {tuple(counts.shape)}")
    if ranks is not None and counts.shape[0] != ranks:
        raise ValueError(f"{op}: {name} has {counts.shape[0]} elements, expected one per rank ({ranks})")
    return counts.to(device=like.device, dtype=dtype)


def _contiguous(t):
    return None if t is None else t.contiguous()


def welford_mean_var(input):
    return list(_ops.welford_mean_var(input.contiguous()))


def welford_mean_var_c_last(input):
    return list(_ops.welford_mean_var_c_last(input.contiguous()))


def welford_parallel(mean_feature_nodes, var_biased, numel, eps):
    ranks = mean_feature_nodes.shape[0] if mean_feature_nodes.dim() == 2 else None
    count = _counts("welford_parallel", "numel", numel, ranks, mean_feature_nodes)
    # The unbiased variance is what the running-variance update takes: from zeros, with momentum 1.
    running_mean = torch.zeros_like(mean_feature_nodes[0]) if ranks is not None else None
    running_var = torch.zeros_like(mean_feature_nodes[0]) if ranks is not None else None
    mean, inv_std = _ops.welford_parallel(
        mean_feature_nodes, var_biased, count, float(eps), running_mean, running_var, 1.0
    )
    return [mean, running_var, inv_std]


def batchnorm_forward(input, mean, inv_std, weight=None, shift=None):
    return _ops.batch_norm_forward(input.contiguous(), mean, inv_std, weight, shift)


def batchnorm_forward_c_last(input, z, mean, inv_std, weight=None, shift=None, fuse_relu=False):
    return _ops.batch_norm_forward_c_last(input.contiguous(), _contiguous(z), mean, inv_std, weight, shift, fuse_relu)


def reduce_bn(grad_output, input, mean, inv_std, weight=None):
    return list(_ops.reduce_bn(grad_output.contiguous(), input.contiguous(), mean, inv_std, weight))


def reduce_bn_c_last(grad_output, input, mean, inv_std, weight=None):
    return list(_ops.reduce_bn_c_last(grad_output.contiguous(), input.contiguous(), mean, inv_std, weight))


def batchnorm_backward(grad_output, input, mean, inv_std, weight, sum_dy, sum_dy_xmu, count):
    count = _counts("batchnorm_backward", "count", count, None, mean)
    return _ops.batch_norm_backward(
        grad_output.contiguous(), input.contiguous(), mean, inv_std, weight, sum_dy, sum_dy_xmu, count
    )


def batchnorm_backward_c_last(grad_output, input, mean, inv_std, weight, sum_dy, sum_dy_xmu, count):
    count = _counts("batchnorm_backward_c_last", "count", count, None, mean)
    return _ops.batch_norm_backward_c_last(
        grad_output.contiguous(), input.contiguous(), mean, inv_std, weight, sum_dy, sum_dy_xmu, count
    )


def relu_bw_c_last(grad_output, input, z, mean, inv_std, weight=None, shift=None):
    return _ops.relu_backward_c_last(
        grad_output.contiguous(), input.contiguous(), _contiguous(z), mean, inv_std, weight, shift
    )


__all__ = [
    "batchnorm_backward",
    "batchnorm_backward_c_last",
    "batchnorm_forward",
    "batchnorm_forward_c_last",
    "reduce_bn",
    "reduce_bn_c_last",
    "relu_bw_c_last",
    "welford_mean_var",
    "welford_mean_var_c_last",
    "welford_parallel",
]
