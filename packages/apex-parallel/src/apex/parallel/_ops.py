"""apex-parallel's dispatcher ops (namespace ``apex_parallel``): the kernels of SyncBatchNorm.

Two layouts: channels-first ops take a contiguous ``(N, C, *spatial)`` input; the ``_c_last``
ops take a contiguous input whose last dimension is the channels (``(N, H, W, C)``, or any
``(..., C)``; a 2-D ``(N, C)`` input is both). Inputs are float32, float16, bfloat16 or float64.
Per-channel statistics and sums are float32 of shape ``(C,)`` (float64 for a float64 input);
weight and bias are float32 or the input's dtype; counts are float32 (or float64); outputs and
gradients of the input have the input's dtype. The math is in ``_reference.py``; how an op is
written: ``apex.core.library``.

- ``welford_mean_var[_c_last](input) -> (mean, var_biased)``: this rank's statistics;
- ``welford_parallel(mean, var_biased, count, eps, running_mean, running_var, momentum)
  -> (mean, invstd)``: merges ``[W, C]`` per-rank statistics with per-rank element counts
  ``count`` (``[W]``, float32), and updates the running statistics in place when given;
- ``batch_norm_forward(input, mean, invstd, weight, bias)``, ``batch_norm_forward_c_last(input,
  z, mean, invstd, weight, bias, fuse_relu)``: the normalized output (``relu(bn(x) + z)``);
- ``reduce_bn[_c_last](grad_output, input, mean, invstd, weight) -> (sum_dy, sum_dy_xmu,
  grad_weight, grad_bias)``; the weight gradients are empty (statistics dtype) without a weight;
- ``batch_norm_backward[_c_last](grad_output, input, mean, invstd, weight, sum_dy, sum_dy_xmu,
  count) -> grad_input``, ``count`` being the per-rank counts (their sum is the group's);
- ``relu_backward_c_last(grad_output, input, z, mean, invstd, weight, bias)``: ``grad_output``
  masked where the recomputed pre-activation is not positive;
- ``reduce_bn_relu_c_last(grad_output, input, z, mean, invstd, weight, bias, masked) ->
  (sum_dy, sum_dy_xmu, grad_weight, grad_bias, masked)`` and
  ``batch_norm_backward_relu_c_last(grad_output, input, z, mean, invstd, weight, bias, sum_dy,
  sum_dy_xmu, count, grad_z) -> (grad_input, grad_z)``: ``reduce_bn_c_last`` and
  ``batch_norm_backward_c_last`` of that masked gradient, masking on the fly; the masked gradient
  (z's gradient) is also returned when ``masked`` / ``grad_z`` asks for it, else an empty tensor;
- ``batch_norm_train(input, z, weight, bias, mean, invstd, count, c_last, relu)``: the output of
  ``batch_norm_forward[_c_last]`` (``c_last`` picks; z and relu need it) as one differentiable op,
  whose backward is SyncBatchNorm's without collectives (its reductions and input-gradient ops).

Every op accepts an empty batch: the statistics of no elements are 0 and the outputs are empty.
"""

from __future__ import annotations

import torch

from apex.core import checks
from apex.core.library import CONTIGUOUS_INPUTS, op
from apex.parallel import _reference
from apex.parallel._plugin import KERNELS

FLOAT_DTYPES = (*checks.FLOAT_DTYPES, torch.float64)
_DTYPE_NAMES = "float32, float16, bfloat16, float64"
_COUNT_DTYPES = (torch.float32, torch.float64)


# checks ----------------------------------------------------------------------------------------


def _check_input(a) -> None:
    """The input; sets ``a.channel_last`` (the op's name, or its ``c_last``, says the layout) and ``a.channels``."""
    a.channel_last = a.op.endswith("_c_last") or getattr(a, "c_last", False)
    input = a.input
    if input.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{a.op}: input has dtype {input.dtype}; expected one of {_DTYPE_NAMES}")
    if input.dim() < 2:
        raise ValueError(f"{a.op}: input must have at least 2 dimensions, got shape {tuple(input.shape)}")
    checks.dense(a.op, "input", input, input.device)
    a.channels = input.shape[-1] if a.channel_last else input.shape[1]


def _check_like_input(a, name: str) -> None:
    t, input = getattr(a, name), a.input
    if t.dtype != input.dtype:
        raise TypeError(f"{a.op}: {name} has dtype {t.dtype} but input has {input.dtype}")
    if tuple(t.shape) != tuple(input.shape):
        raise ValueError(f"{a.op}: {name} has shape {tuple(t.shape)} but input has {tuple(input.shape)}")
    checks.dense(a.op, name, t, input.device)


def _check_per_channel(op: str, name: str, t: torch.Tensor, channels: int, device: torch.device) -> None:
    if tuple(t.shape) != (channels,):
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected ({channels},)")
    checks.dense(op, name, t, device)


def _stat_dtype_error(op: str, name: str, dtype: torch.dtype, expected: torch.dtype) -> TypeError:
    why = " (the input's statistics)" if expected == torch.float64 else ""
    return TypeError(f"{op}: {name} has dtype {dtype}; expected {expected}{why}")


def _check_channel_stat(a, name: str) -> None:
    t, expected = getattr(a, name), _reference.compute_dtype(a.input.dtype)
    if t.dtype != expected:
        raise _stat_dtype_error(a.op, name, t.dtype, expected)
    _check_per_channel(a.op, name, t, a.channels, a.input.device)


def _check_affine(a, bias) -> None:
    weight, input_dtype = a.weight, a.input.dtype
    if weight is not None:
        if weight.dtype not in (input_dtype, torch.float32):
            allowed = "float32" if input_dtype == torch.float32 else f"{str(input_dtype)[6:]} or float32"
            raise TypeError(
                f"{a.op}: weight has dtype {weight.dtype} but the input has {input_dtype}; weight must be {allowed}"
            )
        _check_per_channel(a.op, "weight", weight, a.channels, a.input.device)
    if bias is not None:
        if weight is None:
            raise ValueError(f"{a.op}: bias given without weight")
        if bias.dtype != weight.dtype:
            raise TypeError(f"{a.op}: bias has dtype {bias.dtype} but weight has {weight.dtype}")
        _check_per_channel(a.op, "bias", bias, a.channels, a.input.device)


def _check_count(op: str, count: torch.Tensor, device: torch.device) -> None:
    if count.dtype not in _COUNT_DTYPES:
        raise TypeError(f"{op}: count has dtype {count.dtype}; expected torch.float32 or torch.float64")
    if count.dim() != 1:
        raise ValueError(f"{op}: count must be 1-D (one count per rank), got shape {tuple(count.shape)}")
    checks.placed(op, "count", count, device)


def _check_stats(a, bias) -> None:
    """input, mean, invstd, weight and ``bias`` (None for the ops without one)."""
    _check_input(a)
    _check_channel_stat(a, "mean")
    _check_channel_stat(a, "invstd")
    _check_affine(a, bias)


def _check_gradient(a) -> None:
    """The ops of the backward without a bias: the statistics and ``grad_output``."""
    _check_stats(a, None)
    _check_like_input(a, "grad_output")


def _check_z(a) -> None:
    if a.z is not None:
        _check_like_input(a, "z")


def _stat(like: torch.Tensor, channels: int) -> torch.Tensor:
    """A per-channel statistic of the input ``like`` (or of statistics ``like``)."""
    return like.new_empty((channels,), dtype=_reference.compute_dtype(like.dtype))


def _empty_stat(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,), dtype=_reference.compute_dtype(like.dtype))


def _like_input(a) -> torch.Tensor:
    """The fake of every op whose output is shaped like the input."""
    return torch.empty_like(a.input, memory_format=torch.contiguous_format)


def _contiguous(*tensors):
    return tuple(None if t is None else t.contiguous() for t in tensors)


def _in_both_layouts(name: str, signature: str, reference, **helpers):
    """The op ``name`` and its channels-last twin ``name_c_last``, which share everything but the name."""
    return tuple(
        op(KERNELS, f"{n}{signature}", tags=CONTIGUOUS_INPUTS, **helpers)(reference) for n in (name, f"{name}_c_last")
    )


# welford_mean_var ------------------------------------------------------------------------------


def _welford_mean_var(a):
    return _contiguous(*_reference.welford_mean_var(a.input, a.channel_last))


welford_mean_var, welford_mean_var_c_last = _in_both_layouts(
    "welford_mean_var",
    "(Tensor input) -> (Tensor mean, Tensor var_biased)",
    _welford_mean_var,
    check=_check_input,
    fake=lambda a: (_stat(a.input, a.channels), _stat(a.input, a.channels)),
)


# welford_parallel ------------------------------------------------------------------------------


def _check_parallel(a) -> None:
    """Sets ``a.channels``."""
    op, mean, var_biased, count = a.op, a.mean, a.var_biased, a.count
    if mean.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{op}: mean has dtype {mean.dtype}; expected torch.float32 or torch.float64")
    if var_biased.dtype != mean.dtype:
        raise TypeError(f"{op}: var_biased has dtype {var_biased.dtype} but mean has {mean.dtype}")
    if mean.dim() != 2:
        raise ValueError(f"{op}: mean must be 2-D (ranks, channels), got shape {tuple(mean.shape)}")
    if tuple(var_biased.shape) != tuple(mean.shape):
        raise ValueError(f"{op}: var_biased has shape {tuple(var_biased.shape)} but mean has {tuple(mean.shape)}")
    device = mean.device
    for name, t in (("mean", mean), ("var_biased", var_biased)):
        checks.placed(op, name, t, device)
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{op}: {name} must have unit stride in its last dimension")
    _check_count(op, count, device)
    ranks, a.channels = mean.shape
    if count.shape[0] != ranks:
        raise ValueError(f"{op}: count has {count.shape[0]} elements, expected one per rank ({ranks})")
    running_mean, running_var = a.running_mean, a.running_var
    if (running_mean is None) != (running_var is None):
        raise ValueError(f"{op}: running_mean and running_var must be given together")
    if running_mean is not None:
        if running_mean.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: running_mean has dtype {running_mean.dtype}; expected one of {_DTYPE_NAMES}")
        if running_var.dtype != running_mean.dtype:
            raise TypeError(
                f"{op}: running_var has dtype {running_var.dtype} but running_mean has {running_mean.dtype}"
            )
        _check_per_channel(op, "running_mean", running_mean, a.channels, device)
        _check_per_channel(op, "running_var", running_var, a.channels, device)


@op(
    KERNELS,
    "welford_parallel(Tensor mean, Tensor var_biased, Tensor count, float eps, Tensor(a!)? running_mean=None, "
    "Tensor(b!)? running_var=None, float momentum=0.1) -> (Tensor merged_mean, Tensor invstd)",
    check=_check_parallel,
    fake=lambda a: (_stat(a.mean, a.channels), _stat(a.mean, a.channels)),
)
def welford_parallel(a):
    merged = _reference.welford_parallel(
        a.mean, a.var_biased, a.count, a.eps, a.running_mean, a.running_var, a.momentum
    )
    return _contiguous(*merged)


# batch_norm_forward ----------------------------------------------------------------------------


@op(
    KERNELS,
    "batch_norm_forward(Tensor input, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias) -> Tensor",
    check=lambda a: _check_stats(a, a.bias),
    fake=_like_input,
    tags=CONTIGUOUS_INPUTS,
)
def batch_norm_forward(a):
    return _reference.batch_norm_forward(a.input, None, a.mean, a.invstd, a.weight, a.bias, False, False).contiguous()


def _check_forward_c_last(a) -> None:
    _check_stats(a, a.bias)
    _check_z(a)


@op(
    KERNELS,
    "batch_norm_forward_c_last(Tensor input, Tensor? z, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias, "
    "bool fuse_relu=False) -> Tensor",
    check=_check_forward_c_last,
    fake=_like_input,
    tags=CONTIGUOUS_INPUTS,
)
def batch_norm_forward_c_last(a):
    y = _reference.batch_norm_forward(a.input, a.z, a.mean, a.invstd, a.weight, a.bias, a.fuse_relu, True)
    return y.contiguous()


# reduce_bn -------------------------------------------------------------------------------------


def _reduce_bn(a, grad_output=None):
    """reduce_bn's outputs of ``grad_output`` (default: the op's)."""
    grad_output = a.grad_output if grad_output is None else grad_output
    sum_dy, sum_dy_xmu, grad_weight, grad_bias = _reference.reduce_bn(
        grad_output, a.input, a.mean, a.invstd, a.weight, a.channel_last
    )
    if grad_weight is None:
        grad_weight, grad_bias = _empty_stat(a.input), _empty_stat(a.input)
    return _contiguous(sum_dy, sum_dy_xmu, grad_weight, grad_bias)


def _reduce_bn_fake(a):
    if a.weight is None:
        grads = (_empty_stat(a.input), _empty_stat(a.input))
    else:
        grads = (torch.empty_like(a.weight), torch.empty_like(a.weight))
    return (_stat(a.input, a.channels), _stat(a.input, a.channels), *grads)


reduce_bn, reduce_bn_c_last = _in_both_layouts(
    "reduce_bn",
    "(Tensor grad_output, Tensor input, Tensor mean, Tensor invstd, Tensor? weight) -> "
    "(Tensor sum_dy, Tensor sum_dy_xmu, Tensor grad_weight, Tensor grad_bias)",
    _reduce_bn,
    check=_check_gradient,
    fake=_reduce_bn_fake,
)


# batch_norm_backward ---------------------------------------------------------------------------


def _check_sums(a) -> None:
    """The group's sums and per-rank counts that an input gradient's op takes."""
    _check_channel_stat(a, "sum_dy")
    _check_channel_stat(a, "sum_dy_xmu")
    _check_count(a.op, a.count, a.input.device)


def _check_backward(a) -> None:
    _check_gradient(a)
    _check_sums(a)


def _batch_norm_backward(a):
    grad_input = _reference.batch_norm_backward(
        a.grad_output, a.input, a.mean, a.invstd, a.weight, a.sum_dy, a.sum_dy_xmu, a.count, a.channel_last
    )
    return grad_input.contiguous()


batch_norm_backward, batch_norm_backward_c_last = _in_both_layouts(
    "batch_norm_backward",
    "(Tensor grad_output, Tensor input, Tensor mean, Tensor invstd, Tensor? weight, Tensor sum_dy, "
    "Tensor sum_dy_xmu, Tensor count) -> Tensor",
    _batch_norm_backward,
    check=_check_backward,
    fake=_like_input,
)


# relu_backward_c_last --------------------------------------------------------------------------


def _check_relu_backward(a) -> None:
    _check_stats(a, a.bias)
    _check_like_input(a, "grad_output")
    _check_z(a)


@op(
    KERNELS,
    "relu_backward_c_last(Tensor grad_output, Tensor input, Tensor? z, Tensor mean, Tensor invstd, Tensor? weight, "
    "Tensor? bias) -> Tensor",
    check=_check_relu_backward,
    fake=_like_input,
    tags=CONTIGUOUS_INPUTS,
)
def relu_backward_c_last(a):
    masked = _reference.relu_backward(a.grad_output, a.input, a.z, a.mean, a.invstd, a.weight, a.bias, True)
    return masked.contiguous()


# reduce_bn_relu_c_last, batch_norm_backward_relu_c_last ------------------------------------------
# The backward of a norm with a fused ReLU (forward's fuse_relu) in two passes instead of three:
# relu_backward_c_last's masking (where bn(x) [+ z] <= 0, recomputed) done inside the reduction and
# the input gradient's kernel, so the masked gradient is only written when z needs it. Same values as
# relu_backward_c_last followed by reduce_bn_c_last / batch_norm_backward_c_last. When z needs it, the
# reduction can write it (masked=True) and batch_norm_backward_c_last read it, instead of the second
# kernel reading dy, x and z again (SyncBatchNorm's choice: sync_batchnorm._MASKED_IN_REDUCE).


def _masked(a) -> torch.Tensor:
    return _reference.relu_backward(a.grad_output, a.input, a.z, a.mean, a.invstd, a.weight, a.bias, True)


def _reduce_bn_relu_fake(a):
    return (*_reduce_bn_fake(a), _like_input(a) if a.masked else a.input.new_empty((0,)))


@op(
    KERNELS,
    "reduce_bn_relu_c_last(Tensor grad_output, Tensor input, Tensor? z, Tensor mean, Tensor invstd, Tensor? weight, "
    "Tensor? bias, bool masked=False) -> "
    "(Tensor sum_dy, Tensor sum_dy_xmu, Tensor grad_weight, Tensor grad_bias, Tensor masked)",
    check=_check_relu_backward,
    fake=_reduce_bn_relu_fake,
    tags=CONTIGUOUS_INPUTS,
)
def reduce_bn_relu_c_last(a):
    masked = _masked(a)
    return (*_reduce_bn(a, masked), masked.contiguous() if a.masked else a.input.new_empty((0,)))


def _check_backward_relu(a) -> None:
    _check_relu_backward(a)
    _check_sums(a)


def _backward_relu_fake(a):
    grad_z = _like_input(a) if a.grad_z else a.input.new_empty((0,))
    return _like_input(a), grad_z


@op(
    KERNELS,
    "batch_norm_backward_relu_c_last(Tensor grad_output, Tensor input, Tensor? z, Tensor mean, Tensor invstd, "
    "Tensor? weight, Tensor? bias, Tensor sum_dy, Tensor sum_dy_xmu, Tensor count, bool grad_z=False) -> "
    "(Tensor grad_input, Tensor grad_z)",
    check=_check_backward_relu,
    fake=_backward_relu_fake,
    tags=CONTIGUOUS_INPUTS,
)
def batch_norm_backward_relu_c_last(a):
    masked = _masked(a)
    grad_input = _reference.batch_norm_backward(
        masked, a.input, a.mean, a.invstd, a.weight, a.sum_dy, a.sum_dy_xmu, a.count, True
    )
    grad_z = masked.contiguous() if a.grad_z else a.input.new_empty((0,))
    return grad_input.contiguous(), grad_z


# batch_norm_train --------------------------------------------------------------------------------
# The normalization of a training step without collectives, as one differentiable op: its autograd
# formula (SyncBatchNorm's backward at world 1) is registered in Python in sync_batchnorm.py and in
# C++ for AutogradCUDA (csrc/syncbn_autograd.cpp), which the dispatcher prefers for CUDA tensors: a
# Python autograd.Function around the kernels costs tens of microseconds of host time per eager call,
# and a ResNet-50 step runs 53 norms forward and backward.


def _check_train(a) -> None:
    """batch_norm_forward[_c_last]'s check in the layout ``c_last`` says, and the count."""
    _check_forward_c_last(a)
    if not a.c_last and (a.z is not None or a.relu):
        raise ValueError(f"{a.op}: z and relu need c_last=True (the channels-last kernels fuse them)")
    _check_count(a.op, a.count, a.input.device)


@op(
    KERNELS,
    "batch_norm_train(Tensor input, Tensor? z, Tensor? weight, Tensor? bias, Tensor mean, Tensor invstd, "
    "Tensor count, bool c_last, bool relu) -> Tensor",
    check=_check_train,
    fake=_like_input,
    tags=CONTIGUOUS_INPUTS,
)
def batch_norm_train(a):
    if a.c_last:
        return batch_norm_forward_c_last(a.input, a.z, a.mean, a.invstd, a.weight, a.bias, a.relu)
    return batch_norm_forward(a.input, a.mean, a.invstd, a.weight, a.bias)
