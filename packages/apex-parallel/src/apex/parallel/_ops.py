"""apex-parallel's dispatcher ops (namespace ``apex_parallel``): the kernels of SyncBatchNorm.

Two layouts: channels-first ops take a contiguous ``(N, C, *spatial)`` input; the ``_c_last``
ops take a contiguous input whose last dimension is the channels (``(N, H, W, C)``, or any
``(..., C)``; a 2-D ``(N, C)`` input is both). Per-channel tensors are float32 of shape ``(C,)``;
weight and bias are float32 or the input's dtype; outputs and gradients of the input have the
input's dtype. The math is in ``_reference.py``.

- ``welford_mean_var[_c_last](input) -> (mean, var_biased)``: this rank's statistics;
- ``welford_parallel(mean, var_biased, count, eps, running_mean, running_var, momentum)
  -> (mean, invstd)``: merges ``[W, C]`` per-rank statistics with per-rank element counts
  ``count`` (``[W]``, float32), and updates the running statistics in place when given;
- ``batch_norm_forward(input, mean, invstd, weight, bias)``, ``batch_norm_forward_c_last(input,
  z, mean, invstd, weight, bias, fuse_relu)``: the normalized output (``relu(bn(x) + z)``);
- ``reduce_bn[_c_last](grad_output, input, mean, invstd, weight) -> (sum_dy, sum_dy_xmu,
  grad_weight, grad_bias)``; the weight gradients are empty float32 tensors without a weight;
- ``batch_norm_backward[_c_last](grad_output, input, mean, invstd, weight, sum_dy, sum_dy_xmu,
  count) -> grad_input``, ``count`` being the per-rank counts (their sum is the group's);
- ``relu_backward_c_last(grad_output, input, z, mean, invstd, weight, bias)``: ``grad_output``
  masked where the recomputed pre-activation is not positive.

Every op accepts an empty batch: the statistics of no elements are 0 and the outputs are empty.
"""

from __future__ import annotations

import torch

from apex.core import checks
from apex.core.library import define
from apex.parallel import _reference
from apex.parallel._plugin import KERNELS

FLOAT_DTYPES = checks.FLOAT_DTYPES
_DTYPE_NAMES = "float32, float16, bfloat16"


# checks ----------------------------------------------------------------------------------------


def check_input(op: str, input: torch.Tensor, channel_last: bool) -> int:
    """Checks the input; returns its number of channels."""
    if input.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: input has dtype {input.dtype}; expected one of {_DTYPE_NAMES}")
    if input.dim() < 2:
        raise ValueError(f"{op}: input must have at least 2 dimensions, got shape {tuple(input.shape)}")
    checks.dense(op, "input", input, input.device)
    return input.shape[-1] if channel_last else input.shape[1]


def check_like_input(op: str, name: str, t: torch.Tensor, input: torch.Tensor) -> None:
    if t.dtype != input.dtype:
        raise TypeError(f"{op}: {name} has dtype {t.dtype} but input has {input.dtype}")
    if tuple(t.shape) != tuple(input.shape):
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)} but input has {tuple(input.shape)}")
    checks.dense(op, name, t, input.device)


def check_channel_stat(op: str, name: str, t: torch.Tensor, channels: int, device: torch.device) -> None:
    if t.dtype != torch.float32:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected torch.float32")
    if tuple(t.shape) != (channels,):
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected ({channels},)")
    checks.dense(op, name, t, device)


def check_affine(op: str, input_dtype, device, weight, bias, channels: int) -> None:
    if weight is not None:
        if weight.dtype not in (input_dtype, torch.float32):
            allowed = "float32" if input_dtype == torch.float32 else f"{str(input_dtype)[6:]} or float32"
            raise TypeError(
                f"{op}: weight has dtype {weight.dtype} but the input has {input_dtype}; weight must be {allowed}"
            )
        if tuple(weight.shape) != (channels,):
            raise ValueError(f"{op}: weight has shape {tuple(weight.shape)}, expected ({channels},)")
        checks.dense(op, "weight", weight, device)
    if bias is not None:
        if weight is None:
            raise ValueError(f"{op}: bias given without weight")
        if bias.dtype != weight.dtype:
            raise TypeError(f"{op}: bias has dtype {bias.dtype} but weight has {weight.dtype}")
        if tuple(bias.shape) != (channels,):
            raise ValueError(f"{op}: bias has shape {tuple(bias.shape)}, expected ({channels},)")
        checks.dense(op, "bias", bias, device)


def check_count(op: str, count: torch.Tensor, device: torch.device) -> None:
    if count.dtype != torch.float32:
        raise TypeError(f"{op}: count has dtype {count.dtype}; expected torch.float32")
    if count.dim() != 1:
        raise ValueError(f"{op}: count must be 1-D (one count per rank), got shape {tuple(count.shape)}")
    checks.placed(op, "count", count, device)


def check_stats(op: str, input, mean, invstd, weight, bias, channel_last: bool) -> int:
    channels = check_input(op, input, channel_last)
    check_channel_stat(op, "mean", mean, channels, input.device)
    check_channel_stat(op, "invstd", invstd, channels, input.device)
    check_affine(op, input.dtype, input.device, weight, bias, channels)
    return channels


def check_parallel(op: str, mean, var_biased, count, running_mean, running_var) -> int:
    """Checks welford_parallel's arguments; returns the number of channels."""
    for name, t in (("mean", mean), ("var_biased", var_biased)):
        if t.dtype != torch.float32:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected torch.float32")
    if mean.dim() != 2:
        raise ValueError(f"{op}: mean must be 2-D (ranks, channels), got shape {tuple(mean.shape)}")
    if tuple(var_biased.shape) != tuple(mean.shape):
        raise ValueError(f"{op}: var_biased has shape {tuple(var_biased.shape)} but mean has {tuple(mean.shape)}")
    device = mean.device
    for name, t in (("mean", mean), ("var_biased", var_biased)):
        checks.placed(op, name, t, device)
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{op}: {name} must have unit stride in its last dimension")
    check_count(op, count, device)
    ranks, channels = mean.shape
    if count.shape[0] != ranks:
        raise ValueError(f"{op}: count has {count.shape[0]} elements, expected one per rank ({ranks})")
    if (running_mean is None) != (running_var is None):
        raise ValueError(f"{op}: running_mean and running_var must be given together")
    if running_mean is not None:
        if running_mean.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: running_mean has dtype {running_mean.dtype}; expected one of {_DTYPE_NAMES}")
        if running_var.dtype != running_mean.dtype:
            raise TypeError(
                f"{op}: running_var has dtype {running_var.dtype} but running_mean has {running_mean.dtype}"
            )
        for name, t in (("running_mean", running_mean), ("running_var", running_var)):
            if tuple(t.shape) != (channels,):
                raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected ({channels},)")
            checks.dense(op, name, t, device)
    return channels


def _empty_f32(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,), dtype=torch.float32)


def _stat(like: torch.Tensor, channels: int) -> torch.Tensor:
    return like.new_empty((channels,), dtype=torch.float32)


def _contiguous(*tensors):
    return tuple(None if t is None else t.contiguous() for t in tensors)


# welford_mean_var ------------------------------------------------------------------------------


def _define_welford(name: str, channel_last: bool):
    def reference(input):
        check_input(name, input, channel_last)
        return _contiguous(*_reference.welford_mean_var(input, channel_last))

    def fake(input):
        channels = check_input(name, input, channel_last)
        return _stat(input, channels), _stat(input, channels)

    return define(KERNELS, f"{name}(Tensor input) -> (Tensor mean, Tensor var_biased)", reference, fake)


welford_mean_var = _define_welford("welford_mean_var", channel_last=False)
welford_mean_var_c_last = _define_welford("welford_mean_var_c_last", channel_last=True)


# welford_parallel ------------------------------------------------------------------------------

PARALLEL_SCHEMA = (
    "welford_parallel(Tensor mean, Tensor var_biased, Tensor count, float eps, Tensor(a!)? running_mean=None, "
    "Tensor(b!)? running_var=None, float momentum=0.1) -> (Tensor merged_mean, Tensor invstd)"
)


def _parallel_reference(mean, var_biased, count, eps, running_mean=None, running_var=None, momentum=0.1):
    check_parallel("welford_parallel", mean, var_biased, count, running_mean, running_var)
    return _contiguous(*_reference.welford_parallel(mean, var_biased, count, eps, running_mean, running_var, momentum))


def _parallel_fake(mean, var_biased, count, eps, running_mean=None, running_var=None, momentum=0.1):
    channels = check_parallel("welford_parallel", mean, var_biased, count, running_mean, running_var)
    return _stat(mean, channels), _stat(mean, channels)


welford_parallel = define(KERNELS, PARALLEL_SCHEMA, _parallel_reference, _parallel_fake)


# batch_norm_forward ----------------------------------------------------------------------------


def _forward_reference(input, mean, invstd, weight, bias):
    check_stats("batch_norm_forward", input, mean, invstd, weight, bias, channel_last=False)
    return _reference.batch_norm_forward(input, None, mean, invstd, weight, bias, False, False).contiguous()


def _forward_fake(input, mean, invstd, weight, bias):
    check_stats("batch_norm_forward", input, mean, invstd, weight, bias, channel_last=False)
    return torch.empty_like(input, memory_format=torch.contiguous_format)


batch_norm_forward = define(
    KERNELS,
    "batch_norm_forward(Tensor input, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias) -> Tensor",
    _forward_reference,
    _forward_fake,
)


def _check_forward_c_last(input, z, mean, invstd, weight, bias):
    op = "batch_norm_forward_c_last"
    check_stats(op, input, mean, invstd, weight, bias, channel_last=True)
    if z is not None:
        check_like_input(op, "z", z, input)


def _forward_c_last_reference(input, z, mean, invstd, weight, bias, fuse_relu=False):
    _check_forward_c_last(input, z, mean, invstd, weight, bias)
    return _reference.batch_norm_forward(input, z, mean, invstd, weight, bias, fuse_relu, True).contiguous()


def _forward_c_last_fake(input, z, mean, invstd, weight, bias, fuse_relu=False):
    _check_forward_c_last(input, z, mean, invstd, weight, bias)
    return torch.empty_like(input, memory_format=torch.contiguous_format)


batch_norm_forward_c_last = define(
    KERNELS,
    "batch_norm_forward_c_last(Tensor input, Tensor? z, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias, "
    "bool fuse_relu=False) -> Tensor",
    _forward_c_last_reference,
    _forward_c_last_fake,
)


# reduce_bn -------------------------------------------------------------------------------------


def _define_reduce(name: str, channel_last: bool):
    def check(grad_output, input, mean, invstd, weight):
        channels = check_stats(name, input, mean, invstd, weight, None, channel_last)
        check_like_input(name, "grad_output", grad_output, input)
        return channels

    def reference(grad_output, input, mean, invstd, weight):
        check(grad_output, input, mean, invstd, weight)
        sum_dy, sum_dy_xmu, grad_weight, grad_bias = _reference.reduce_bn(
            grad_output, input, mean, invstd, weight, channel_last
        )
        if grad_weight is None:
            grad_weight, grad_bias = _empty_f32(input), _empty_f32(input)
        return _contiguous(sum_dy, sum_dy_xmu, grad_weight, grad_bias)

    def fake(grad_output, input, mean, invstd, weight):
        channels = check(grad_output, input, mean, invstd, weight)
        if weight is None:
            grads = (_empty_f32(input), _empty_f32(input))
        else:
            grads = (torch.empty_like(weight), torch.empty_like(weight))
        return (_stat(input, channels), _stat(input, channels), *grads)

    schema = (
        f"{name}(Tensor grad_output, Tensor input, Tensor mean, Tensor invstd, Tensor? weight) -> "
        "(Tensor sum_dy, Tensor sum_dy_xmu, Tensor grad_weight, Tensor grad_bias)"
    )
    return define(KERNELS, schema, reference, fake)


reduce_bn = _define_reduce("reduce_bn", channel_last=False)
reduce_bn_c_last = _define_reduce("reduce_bn_c_last", channel_last=True)


# batch_norm_backward ---------------------------------------------------------------------------


def _define_backward(name: str, channel_last: bool):
    def check(grad_output, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
        channels = check_stats(name, input, mean, invstd, weight, None, channel_last)
        check_like_input(name, "grad_output", grad_output, input)
        check_channel_stat(name, "sum_dy", sum_dy, channels, input.device)
        check_channel_stat(name, "sum_dy_xmu", sum_dy_xmu, channels, input.device)
        check_count(name, count, input.device)

    def reference(grad_output, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
        check(grad_output, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count)
        return _reference.batch_norm_backward(
            grad_output, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count, channel_last
        ).contiguous()

    def fake(grad_output, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
        check(grad_output, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count)
        return torch.empty_like(input, memory_format=torch.contiguous_format)

    schema = (
        f"{name}(Tensor grad_output, Tensor input, Tensor mean, Tensor invstd, Tensor? weight, Tensor sum_dy, "
        "Tensor sum_dy_xmu, Tensor count) -> Tensor"
    )
    return define(KERNELS, schema, reference, fake)


batch_norm_backward = _define_backward("batch_norm_backward", channel_last=False)
batch_norm_backward_c_last = _define_backward("batch_norm_backward_c_last", channel_last=True)


# relu_backward_c_last --------------------------------------------------------------------------


def _check_relu_backward(grad_output, input, z, mean, invstd, weight, bias):
    op = "relu_backward_c_last"
    check_stats(op, input, mean, invstd, weight, bias, channel_last=True)
    check_like_input(op, "grad_output", grad_output, input)
    if z is not None:
        check_like_input(op, "z", z, input)


def _relu_backward_reference(grad_output, input, z, mean, invstd, weight, bias):
    _check_relu_backward(grad_output, input, z, mean, invstd, weight, bias)
    return _reference.relu_backward(grad_output, input, z, mean, invstd, weight, bias, True).contiguous()


def _relu_backward_fake(grad_output, input, z, mean, invstd, weight, bias):
    _check_relu_backward(grad_output, input, z, mean, invstd, weight, bias)
    return torch.empty_like(input, memory_format=torch.contiguous_format)


relu_backward_c_last = define(
    KERNELS,
    "relu_backward_c_last(Tensor grad_output, Tensor input, Tensor? z, Tensor mean, Tensor invstd, Tensor? weight, "
    "Tensor? bias) -> Tensor",
    _relu_backward_reference,
    _relu_backward_fake,
)
