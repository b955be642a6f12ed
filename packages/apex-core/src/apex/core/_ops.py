"""apex-core's dispatcher ops (namespace ``apex_core``): schemas, references, fakes.

All multi-tensor ops take ``chunk_size`` (elements per CUDA block, ignored by the
reference) and a one-element int32 ``noop_flag`` on the tensors' device, which the ops that
check for overflow set to 1 when they meet an inf or NaN, without a host sync.
Arithmetic is done in float32 whatever the storage dtype.
"""

from __future__ import annotations

import torch

from apex.core import checks
from apex.core._plugin import KERNELS
from apex.core.library import define

INT32 = (torch.int32,)
FLOAT32 = (torch.float32,)


def _flag_device(op: str, noop_flag: torch.Tensor) -> torch.device:
    return checks.scalar_tensor(op, "noop_flag", noop_flag, INT32, None)


def _raise_flag(noop_flag: torch.Tensor, bad: torch.Tensor | None) -> None:
    if bad is not None:
        noop_flag.masked_fill_(bad.reshape(noop_flag.shape), 1)


def _any_nonfinite(tensors_f32) -> torch.Tensor | None:
    bad = None
    for t in tensors_f32:
        t_bad = ~torch.isfinite(t).all()
        bad = t_bad if bad is None else bad | t_bad
    return bad


# multi_tensor_scale ---------------------------------------------------------------------


def _check_scale(chunk_size, noop_flag, inputs, outputs, scale, scale_tensor):
    op = "multi_tensor_scale"
    checks.positive_chunk_size(op, chunk_size)
    device = _flag_device(op, noop_flag)
    checks.same_lengths(op, inputs=inputs, outputs=outputs)
    checks.tensor_list(op, "inputs", inputs, device)
    checks.tensor_list(op, "outputs", outputs, device)
    for i, (x, out) in enumerate(zip(inputs, outputs)):
        if x.numel() != out.numel():
            raise ValueError(f"{op}: outputs[{i}] has {out.numel()} elements but inputs[{i}] has {x.numel()}")
    if scale_tensor is not None:
        checks.scalar_tensor(op, "scale_tensor", scale_tensor, FLOAT32, device)


def _scale_reference(chunk_size, noop_flag, inputs, outputs, scale, scale_tensor=None):
    _check_scale(chunk_size, noop_flag, inputs, outputs, scale, scale_tensor)
    if not inputs:
        return
    factor = scale if scale_tensor is None else scale_tensor.reshape(()) * scale
    upcast = [x.float() for x in inputs]
    bad = _any_nonfinite(upcast)
    for xf, out in zip(upcast, outputs):
        out.view(-1).copy_((xf * factor).view(-1))
    _raise_flag(noop_flag, bad)


def _scale_fake(chunk_size, noop_flag, inputs, outputs, scale, scale_tensor=None):
    _check_scale(chunk_size, noop_flag, inputs, outputs, scale, scale_tensor)


multi_tensor_scale = define(
    KERNELS,
    "multi_tensor_scale(int chunk_size, Tensor(a!) noop_flag, Tensor[] inputs, Tensor(b!)[] outputs, "
    "float scale, Tensor? scale_tensor=None) -> ()",
    _scale_reference,
    _scale_fake,
)


# multi_tensor_axpby ---------------------------------------------------------------------


def _check_axpby(chunk_size, noop_flag, x, y, out, a, b, arg_to_check):
    op = "multi_tensor_axpby"
    checks.positive_chunk_size(op, chunk_size)
    device = _flag_device(op, noop_flag)
    checks.same_lengths(op, x=x, y=y, out=out)
    for name, tensors in (("x", x), ("y", y), ("out", out)):
        checks.tensor_list(op, name, tensors, device)
    for i, (xi, yi, oi) in enumerate(zip(x, y, out)):
        if not (xi.numel() == yi.numel() == oi.numel()):
            raise ValueError(
                f"{op}: x[{i}], y[{i}] and out[{i}] must have the same number of elements "
                f"({xi.numel()}, {yi.numel()}, {oi.numel()})"
            )
    if arg_to_check not in (-1, 0, 1):
        raise ValueError(f"{op}: arg_to_check must be -1 (both), 0 (x) or 1 (y), got {arg_to_check}")


def _axpby_reference(chunk_size, noop_flag, x, y, out, a, b, arg_to_check):
    _check_axpby(chunk_size, noop_flag, x, y, out, a, b, arg_to_check)
    if not x:
        return
    xf = [t.float() for t in x]
    yf = [t.float() for t in y]
    checked = {-1: xf + yf, 0: xf, 1: yf}[arg_to_check]
    bad = _any_nonfinite(checked)
    for xi, yi, oi in zip(xf, yf, out):
        oi.view(-1).copy_((a * xi + b * yi).view(-1))
    _raise_flag(noop_flag, bad)


def _axpby_fake(chunk_size, noop_flag, x, y, out, a, b, arg_to_check):
    _check_axpby(chunk_size, noop_flag, x, y, out, a, b, arg_to_check)


multi_tensor_axpby = define(
    KERNELS,
    "multi_tensor_axpby(int chunk_size, Tensor(a!) noop_flag, Tensor[] x, Tensor[] y, Tensor(b!)[] out, "
    "float a, float b, int arg_to_check) -> ()",
    _axpby_reference,
    _axpby_fake,
)


# multi_tensor_l2norm --------------------------------------------------------------------


def _check_l2norm(chunk_size, noop_flag, inputs, per_tensor):
    op = "multi_tensor_l2norm"
    checks.positive_chunk_size(op, chunk_size)
    device = _flag_device(op, noop_flag)
    checks.tensor_list(op, "inputs", inputs, device)
    return device


def _norm_outputs(like: torch.Tensor, n: int, per_tensor: bool):
    total = like.new_empty((1,), dtype=torch.float32)
    per = like.new_empty((n if per_tensor else 0,), dtype=torch.float32)
    return total, per


def _norms(upcast, per_tensor, device):
    if not upcast:
        return torch.zeros(1, dtype=torch.float32, device=device), torch.zeros(0, dtype=torch.float32, device=device)
    per = torch.stack([torch.linalg.vector_norm(t.reshape(-1)) for t in upcast])
    total = torch.linalg.vector_norm(per).reshape(1)
    return total, per if per_tensor else per.new_empty((0,))


def _l2norm_reference(chunk_size, noop_flag, inputs, per_tensor):
    device = _check_l2norm(chunk_size, noop_flag, inputs, per_tensor)
    return _norms([t.float() for t in inputs], per_tensor, device)


def _l2norm_fake(chunk_size, noop_flag, inputs, per_tensor):
    _check_l2norm(chunk_size, noop_flag, inputs, per_tensor)
    return _norm_outputs(noop_flag, len(inputs), per_tensor)


multi_tensor_l2norm = define(
    KERNELS,
    "multi_tensor_l2norm(int chunk_size, Tensor noop_flag, Tensor[] inputs, bool per_tensor) -> (Tensor, Tensor)",
    _l2norm_reference,
    _l2norm_fake,
)


# multi_tensor_unscale_l2norm ------------------------------------------------------------


def _check_unscale_l2norm(chunk_size, noop_flag, inputs, outputs, inv_scale, per_tensor):
    op = "multi_tensor_unscale_l2norm"
    checks.positive_chunk_size(op, chunk_size)
    device = _flag_device(op, noop_flag)
    checks.tensor_list(op, "inputs", inputs, device)
    if outputs:
        checks.same_lengths(op, inputs=inputs, outputs=outputs)
        checks.tensor_list(op, "outputs", outputs, device)
        for i, (x, out) in enumerate(zip(inputs, outputs)):
            if x.numel() != out.numel():
                raise ValueError(f"{op}: outputs[{i}] has {out.numel()} elements but inputs[{i}] has {x.numel()}")
    checks.scalar_tensor(op, "inv_scale", inv_scale, FLOAT32, device)
    return device


def _unscale_l2norm_reference(chunk_size, noop_flag, inputs, outputs, inv_scale, per_tensor):
    device = _check_unscale_l2norm(chunk_size, noop_flag, inputs, outputs, inv_scale, per_tensor)
    factor = inv_scale.reshape(())
    unscaled = [t.float() * factor for t in inputs]
    bad = _any_nonfinite(unscaled)
    result = _norms(unscaled, per_tensor, device)
    for u, out in zip(unscaled, outputs):
        out.view(-1).copy_(u.view(-1))
    _raise_flag(noop_flag, bad)
    return result


def _unscale_l2norm_fake(chunk_size, noop_flag, inputs, outputs, inv_scale, per_tensor):
    _check_unscale_l2norm(chunk_size, noop_flag, inputs, outputs, inv_scale, per_tensor)
    return _norm_outputs(noop_flag, len(inputs), per_tensor)


multi_tensor_unscale_l2norm = define(
    KERNELS,
    "multi_tensor_unscale_l2norm(int chunk_size, Tensor(a!) noop_flag, Tensor[] inputs, Tensor(b!)[] outputs, "
    "Tensor inv_scale, bool per_tensor) -> (Tensor, Tensor)",
    _unscale_l2norm_reference,
    _unscale_l2norm_fake,
)


# update_scale_hysteresis ----------------------------------------------------------------


def _check_update_scale(
    current_scale,
    growth_tracker,
    hysteresis_tracker,
    found_inf,
    growth_factor,
    backoff_factor,
    growth_interval,
    hysteresis,
):
    op = "update_scale_hysteresis"
    device = checks.scalar_tensor(op, "current_scale", current_scale, FLOAT32, None)
    checks.scalar_tensor(op, "growth_tracker", growth_tracker, INT32, device)
    checks.scalar_tensor(op, "hysteresis_tracker", hysteresis_tracker, INT32, device)
    checks.scalar_tensor(op, "found_inf", found_inf, FLOAT32, device)
    if growth_interval <= 0:
        raise ValueError(f"{op}: growth_interval must be positive, got {growth_interval}")
    if hysteresis <= 0:
        raise ValueError(f"{op}: hysteresis must be positive, got {hysteresis}")
    if not growth_factor > 1.0:
        raise ValueError(f"{op}: growth_factor must be > 1, got {growth_factor}")
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"{op}: backoff_factor must be in (0, 1), got {backoff_factor}")


def _update_scale_reference(
    current_scale,
    growth_tracker,
    hysteresis_tracker,
    found_inf,
    growth_factor,
    backoff_factor,
    growth_interval,
    hysteresis,
):
    _check_update_scale(
        current_scale,
        growth_tracker,
        hysteresis_tracker,
        found_inf,
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis,
    )
    found = found_inf > 0
    hysteresis_left = torch.where(found, hysteresis_tracker - 1, hysteresis_tracker)
    back_off = found & (hysteresis_left <= 0)
    successes = growth_tracker + 1
    grow = ~found & (successes == growth_interval)
    grown = current_scale * growth_factor
    new_scale = torch.where(
        back_off,
        current_scale * backoff_factor,
        torch.where(grow & torch.isfinite(grown), grown, current_scale),
    )
    growth_tracker.copy_(torch.where(found | grow, torch.zeros_like(successes), successes))
    hysteresis_tracker.copy_(torch.where(found, hysteresis_left, torch.full_like(hysteresis_left, hysteresis)))
    current_scale.copy_(new_scale)


def _update_scale_fake(
    current_scale,
    growth_tracker,
    hysteresis_tracker,
    found_inf,
    growth_factor,
    backoff_factor,
    growth_interval,
    hysteresis,
):
    _check_update_scale(
        current_scale,
        growth_tracker,
        hysteresis_tracker,
        found_inf,
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis,
    )


update_scale_hysteresis = define(
    KERNELS,
    "update_scale_hysteresis(Tensor(a!) current_scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, "
    "Tensor found_inf, float growth_factor, float backoff_factor, int growth_interval, int hysteresis) -> ()",
    _update_scale_reference,
    _update_scale_fake,
)
