"""apex_contrib_group_norm's dispatcher ops (namespace ``apex_contrib_group_norm``) and their autograd.

- ``group_norm_forward(x, weight, bias, num_groups, eps, act) -> (y, mean, rstd)``
- ``group_norm_backward(dy, x, weight, bias, mean, rstd, num_groups, act) -> (dx, dweight, dbias)``

``x`` is ``(N, *spatial, C)`` and contiguous: the memory of a channels-last ``(N, C, *spatial)``
tensor, which the Python API passes as ``input.movedim(1, -1)`` (a view, no copy). ``x`` float32,
float16 or bfloat16; ``weight`` and ``bias`` ``(C,)``, each optional, float32 or ``x``'s dtype
(both the same when both are given); ``act`` ``""`` (none), ``"silu"`` or ``"swish"`` (the same);
``mean`` and ``rstd`` float32 ``(N, G)``. ``dweight``/``dbias`` come back in the weight's/bias's
dtype, or as empty float32 tensors for an absent parameter. The math is in ``_reference.py``.

The forward op is differentiable (``torch.library.register_autograd``): its backward calls the
backward op, or, when a graph is being recorded (``create_graph=True``), the differentiable
reference with mean and rstd recomputed from ``x``.
"""

from __future__ import annotations

import math

import torch

from apex.contrib.group_norm import _reference
from apex.contrib.group_norm._plugin import KERNELS
from apex.core import checks
from apex.core.library import CONTIGUOUS_INPUTS, op

ACTIVATIONS = ("", "silu", "swish")


def is_silu(act: str) -> bool:
    return act in ("silu", "swish")


# checks ----------------------------------------------------------------------------------------


def _check_params(a, dtype, channels, device) -> None:
    op, weight, bias = a.op, a.weight, a.bias
    allowed = (dtype, torch.float32)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.dtype not in allowed:
            expected = "float32" if dtype == torch.float32 else f"{str(dtype)[6:]} or float32"
            raise TypeError(f"{op}: {name} has dtype {t.dtype} but x has {dtype}; {name} must be {expected}")
        if tuple(t.shape) != (channels,):
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected ({channels},) (the channel count)")
        checks.dense(op, name, t, device)
    if weight is not None and bias is not None and bias.dtype != weight.dtype:
        raise TypeError(f"{op}: bias has dtype {bias.dtype} but weight has {weight.dtype}")


def _check_x(a) -> None:
    op, x = a.op, a.x
    if x.dtype not in checks.FLOAT_DTYPES:
        raise TypeError(f"{op}: x has dtype {x.dtype}; expected one of float32, float16, bfloat16")
    if x.dim() < 2:
        raise ValueError(f"{op}: x must be (N, *spatial, C) with at least 2 dimensions, got shape {tuple(x.shape)}")
    checks.dense(op, "x", x, x.device)
    channels = x.shape[-1]
    if a.num_groups <= 0 or channels % a.num_groups != 0:
        raise ValueError(f"{op}: num_groups ({a.num_groups}) must be positive and divide the channel count {channels}")
    if a.act not in ACTIVATIONS:
        raise ValueError(f"{op}: act must be one of '', 'silu', 'swish', got {a.act!r}")
    _check_params(a, x.dtype, channels, x.device)


def _check_forward(a) -> None:
    _check_x(a)
    if not (math.isfinite(a.eps) and a.eps >= 0):
        raise ValueError(f"{a.op}: eps must be finite and non-negative, got {a.eps}")


def _check_backward(a) -> None:
    _check_x(a)
    op, x, dy = a.op, a.x, a.dy
    if dy.dtype != x.dtype:
        raise TypeError(f"{op}: dy has dtype {dy.dtype} but x has {x.dtype}")
    if tuple(dy.shape) != tuple(x.shape):
        raise ValueError(f"{op}: dy has shape {tuple(dy.shape)} but x has {tuple(x.shape)}")
    checks.dense(op, "dy", dy, x.device)
    stats_shape = (x.shape[0], a.num_groups)
    for name in ("mean", "rstd"):
        t = getattr(a, name)
        if t.dtype != torch.float32:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected float32")
        if tuple(t.shape) != stats_shape:
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected (N, num_groups) = {stats_shape}")
        checks.dense(op, name, t, x.device)


# fakes -----------------------------------------------------------------------------------------


def _forward_fake(a):
    x = a.x
    stats = (x.shape[0], a.num_groups)
    return torch.empty_like(x), x.new_empty(stats, dtype=torch.float32), x.new_empty(stats, dtype=torch.float32)


def _param_grad_fake(x, t):
    return x.new_empty((0,), dtype=torch.float32) if t is None else torch.empty_like(t)


def _backward_fake(a):
    return torch.empty_like(a.x), _param_grad_fake(a.x, a.weight), _param_grad_fake(a.x, a.bias)


# ops -------------------------------------------------------------------------------------------


@op(
    KERNELS,
    "group_norm_forward(Tensor x, Tensor? weight, Tensor? bias, int num_groups, float eps, str act='') -> "
    "(Tensor y, Tensor mean, Tensor rstd)",
    check=_check_forward,
    fake=_forward_fake,
    tags=CONTIGUOUS_INPUTS,
)
def group_norm_forward(a):
    y, mean, rstd = _reference.forward(a.x, a.weight, a.bias, a.num_groups, a.eps, is_silu(a.act))
    return y.contiguous(), mean.contiguous(), rstd.contiguous()


@op(
    KERNELS,
    "group_norm_backward(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, "
    "int num_groups, str act='') -> (Tensor dx, Tensor dweight, Tensor dbias)",
    check=_check_backward,
    fake=_backward_fake,
    tags=CONTIGUOUS_INPUTS,
)
def group_norm_backward(a):
    dx, dweight, dbias = _reference.backward(a.dy, a.x, a.weight, a.bias, a.mean, a.rstd, a.num_groups, is_silu(a.act))
    return (
        dx.contiguous(),
        _param_grad(a.x, dweight),
        _param_grad(a.x, dbias),
    )


def _param_grad(x, grad):
    return x.new_empty((0,), dtype=torch.float32) if grad is None else grad.contiguous()


# autograd --------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    x, weight, bias, num_groups, eps, act = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.config = (num_groups, eps, act)


def _backward(ctx, dy, _grad_mean=None, _grad_rstd=None):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    num_groups, eps, act = ctx.config
    needs = ctx.needs_input_grad
    if dy is None:
        return (None,) * 6
    if torch.is_grad_enabled():  # create_graph: differentiable math, statistics as functions of x
        mean, rstd = _reference.statistics(x, num_groups, eps)
        dx, dweight, dbias = _reference.backward(dy, x, weight, bias, mean, rstd, num_groups, is_silu(act))
    else:
        dx, dweight, dbias = group_norm_backward(dy.contiguous(), x, weight, bias, mean, rstd, num_groups, act)
    return (
        dx if needs[0] else None,
        dweight if weight is not None and needs[1] else None,
        dbias if bias is not None and needs[2] else None,
        None,
        None,
        None,
    )


torch.library.register_autograd(group_norm_forward, _backward, setup_context=_setup_context)
