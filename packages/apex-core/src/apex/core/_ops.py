"""apex-core's dispatcher ops (namespace ``apex_core``): schemas, checks, references.

All multi-tensor ops take ``chunk_size`` (elements per CUDA block, ignored by the
reference) and a one-element int32 ``noop_flag`` on the tensors' device, which the ops that
check for overflow set to 1 when they meet an inf or NaN, without a host sync.
Arithmetic is done in float32 whatever the storage dtype. How an op is written:
``apex.core.library``.
"""

from __future__ import annotations

import math

import torch

from apex.core import checks
from apex.core._plugin import KERNELS
from apex.core.library import op

INT32 = (torch.int32,)
FLOAT32 = (torch.float32,)


def _check_flag(a) -> None:
    """chunk_size and noop_flag, shared by the multi-tensor ops; sets ``a.device``."""
    checks.positive_chunk_size(a.op, a.chunk_size)
    a.device = checks.scalar_tensor(a.op, "noop_flag", a.noop_flag, INT32, None)


def _check_outputs(a, inputs: str, outputs: str) -> None:
    """List ``outputs`` matches list ``inputs``, tensor by tensor, in length and element count."""
    checks.same_lengths(a.op, **{inputs: getattr(a, inputs), outputs: getattr(a, outputs)})
    checks.tensor_list(a.op, outputs, getattr(a, outputs), a.device)
    checks.same_layouts(a.op, **{inputs: getattr(a, inputs), outputs: getattr(a, outputs)})
    for i, (x, out) in enumerate(zip(getattr(a, inputs), getattr(a, outputs))):
        if x.numel() != out.numel():
            raise ValueError(f"{a.op}: {outputs}[{i}] has {out.numel()} elements but {inputs}[{i}] has {x.numel()}")


def _raise_flag(noop_flag: torch.Tensor, bad: torch.Tensor | None) -> None:
    if bad is not None:
        noop_flag.masked_fill_(bad.reshape(noop_flag.shape), 1)


def _any_nonfinite(tensors) -> torch.Tensor | None:
    """A bool tensor: whether any element of ``tensors`` is inf or NaN (None for no elements). Their
    max-abs norms, one fused pass a tensor (an inf or NaN element makes it inf or NaN; a 16-bit value
    is as finite as its float32)."""
    nonempty = [t for t in tensors if t.numel()]  # an empty tensor has no max-abs norm
    if not nonempty:
        return None
    return ~torch.isfinite(torch.stack([n.float() for n in torch._foreach_norm(nonempty, math.inf)])).all()


def _check_scale(a) -> None:
    _check_flag(a)
    checks.tensor_list(a.op, "inputs", a.inputs, a.device)
    _check_outputs(a, "inputs", "outputs")
    if a.scale_tensor is not None:
        checks.scalar_tensor(a.op, "scale_tensor", a.scale_tensor, FLOAT32, a.device)


@op(
    KERNELS,
    "multi_tensor_scale(int chunk_size, Tensor(a!) noop_flag, Tensor[] inputs, Tensor(b!)[] outputs, "
    "float scale, Tensor? scale_tensor=None) -> ()",
    check=_check_scale,
)
def multi_tensor_scale(a):
    if not a.inputs:
        return
    factor = a.scale if a.scale_tensor is None else a.scale_tensor.reshape(()) * a.scale
    bad = _any_nonfinite(a.inputs)
    for x, out in zip(a.inputs, a.outputs):  # float32 math, one rounding into out (one pass where it can)
        x = x.reshape(out.shape)
        if x.dtype == torch.float32 and out.dtype in (torch.float32, torch.float16, torch.bfloat16):
            torch.mul(x, factor, out=out)
        elif out.dtype == torch.float32:
            out.copy_(x).mul_(factor)
        else:
            out.copy_(x.float().mul_(factor))
    _raise_flag(a.noop_flag, bad)


def _check_axpby(a) -> None:
    _check_flag(a)
    checks.same_lengths(a.op, x=a.x, y=a.y, out=a.out)
    for name in ("x", "y", "out"):
        checks.tensor_list(a.op, name, getattr(a, name), a.device)
    checks.same_layouts(a.op, x=a.x, y=a.y, out=a.out)
    for i, (xi, yi, oi) in enumerate(zip(a.x, a.y, a.out)):
        if not (xi.numel() == yi.numel() == oi.numel()):
            raise ValueError(
                f"{a.op}: x[{i}], y[{i}] and out[{i}] must have the same number of elements "
                f"({xi.numel()}, {yi.numel()}, {oi.numel()})"
            )
    if a.arg_to_check not in (-1, 0, 1):
        raise ValueError(f"{a.op}: arg_to_check must be -1 (both), 0 (x) or 1 (y), got {a.arg_to_check}")


@op(
    KERNELS,
    "multi_tensor_axpby(int chunk_size, Tensor(a!) noop_flag, Tensor[] x, Tensor[] y, Tensor(b!)[] out, "
    "float a, float b, int arg_to_check) -> ()",
    check=_check_axpby,
)
def multi_tensor_axpby(a):
    if not a.x:
        return
    xf = [t.float() for t in a.x]
    yf = [t.float() for t in a.y]
    checked = {-1: xf + yf, 0: xf, 1: yf}[a.arg_to_check]
    bad = _any_nonfinite(checked)
    for xi, yi, oi in zip(xf, yf, a.out):
        oi.copy_((a.a * xi + a.b * yi.reshape(xi.shape)).reshape(oi.shape))
    _raise_flag(a.noop_flag, bad)


def _check_l2norm(a) -> None:
    _check_flag(a)
    checks.tensor_list(a.op, "inputs", a.inputs, a.device)


def _norm_outputs(a):
    total = a.noop_flag.new_empty((1,), dtype=torch.float32)
    per = a.noop_flag.new_empty((len(a.inputs) if a.per_tensor else 0,), dtype=torch.float32)
    return total, per


def _norms(upcast, per_tensor, device):
    if not upcast:
        return torch.zeros(1, dtype=torch.float32, device=device), torch.zeros(0, dtype=torch.float32, device=device)
    per = torch.stack([torch.linalg.vector_norm(t.reshape(-1)) for t in upcast])
    total = torch.linalg.vector_norm(per).reshape(1)
    return total, per if per_tensor else per.new_empty((0,))


@op(
    KERNELS,
    "multi_tensor_l2norm(int chunk_size, Tensor noop_flag, Tensor[] inputs, bool per_tensor) -> (Tensor, Tensor)",
    check=_check_l2norm,
    fake=_norm_outputs,
)
def multi_tensor_l2norm(a):
    return _norms([t.float() for t in a.inputs], a.per_tensor, a.device)


def _check_unscale_l2norm(a) -> None:
    _check_l2norm(a)
    if a.outputs:
        _check_outputs(a, "inputs", "outputs")
    checks.scalar_tensor(a.op, "inv_scale", a.inv_scale, FLOAT32, a.device)


@op(
    KERNELS,
    "multi_tensor_unscale_l2norm(int chunk_size, Tensor(a!) noop_flag, Tensor[] inputs, Tensor(b!)[] outputs, "
    "Tensor inv_scale, bool per_tensor) -> (Tensor, Tensor)",
    check=_check_unscale_l2norm,
    fake=_norm_outputs,
)
def multi_tensor_unscale_l2norm(a):
    factor = a.inv_scale.reshape(())
    unscaled = [t.float() * factor for t in a.inputs]
    bad = _any_nonfinite(unscaled)
    result = _norms(unscaled, a.per_tensor, a.device)
    for u, out in zip(unscaled, a.outputs):
        out.copy_(u.reshape(out.shape))
    _raise_flag(a.noop_flag, bad)
    return result


def _check_update_scale(a) -> None:
    device = checks.scalar_tensor(a.op, "current_scale", a.current_scale, FLOAT32, None)
    checks.scalar_tensor(a.op, "growth_tracker", a.growth_tracker, INT32, device)
    checks.scalar_tensor(a.op, "hysteresis_tracker", a.hysteresis_tracker, INT32, device)
    checks.scalar_tensor(a.op, "found_inf", a.found_inf, FLOAT32, device)
    if a.growth_interval <= 0:
        raise ValueError(f"{a.op}: growth_interval must be positive, got {a.growth_interval}")
    if a.hysteresis <= 0:
        raise ValueError(f"{a.op}: hysteresis must be positive, got {a.hysteresis}")
    if not (math.isfinite(a.growth_factor) and a.growth_factor >= 1.0):  # 1.0: the scale never grows
        raise ValueError(f"{a.op}: growth_factor must be finite and >= 1, got {a.growth_factor}")
    if not 0.0 < a.backoff_factor < 1.0:
        raise ValueError(f"{a.op}: backoff_factor must be in (0, 1), got {a.backoff_factor}")


@op(
    KERNELS,
    "update_scale_hysteresis(Tensor(a!) current_scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, "
    "Tensor found_inf, float growth_factor, float backoff_factor, int growth_interval, int hysteresis) -> ()",
    check=_check_update_scale,
)
def update_scale_hysteresis(a):
    found = a.found_inf > 0
    hysteresis_left = torch.where(found, a.hysteresis_tracker - 1, a.hysteresis_tracker)
    back_off = found & (hysteresis_left <= 0)
    successes = a.growth_tracker + 1
    grow = ~found & (successes == a.growth_interval)
    grown = a.current_scale * a.growth_factor
    new_scale = torch.where(
        back_off,
        a.current_scale * a.backoff_factor,
        torch.where(grow & torch.isfinite(grown), grown, a.current_scale),
    )
    a.growth_tracker.copy_(torch.where(found | grow, torch.zeros_like(successes), successes))
    a.hysteresis_tracker.copy_(torch.where(found, hysteresis_left, torch.full_like(hysteresis_left, a.hysteresis)))
    a.current_scale.copy_(new_scale)
