"""apex-normalization's dispatcher ops (namespace ``apex_normalization``): schemas, references, fakes, autograd.

Three ops serve layer norm and RMS norm (``rms=True``), with or without affine parameters:

- ``norm_forward(input, weight, bias, normalized_shape, eps, rms, memory_efficient, output_dtype)``
  returns ``(output, mean, rstd)``; ``mean`` is empty for RMS norm;
- ``add_norm_forward(input, residual, ...)`` normalizes ``input + residual`` (rounded to the
  input's dtype) and returns ``(output, residual_out, mean, rstd)``, ``residual_out`` being that sum;
- ``norm_backward(grad_output, saved, weight, bias, mean, rstd, normalized_shape, rms,
  memory_efficient, input_dtype, weight_grads, grad_residual_out)`` returns
  ``(grad_input, grad_weight, grad_bias)``; gradients not computed come back as empty float32 tensors.

Conventions: input float32, float16 or bfloat16, contiguous, its last dimensions equal to
``normalized_shape``; weight (and bias, layer norm only) of ``normalized_shape``, in the input's
dtype or float32; the output in the input's dtype or, for the mixed-dtype modules, the weight's
(``output_dtype``); ``mean``/``rstd`` float32 with the input's leading shape. ``memory_efficient``
only changes what autograd saves: the output instead of the input. The forward ops carry their
backward (``apex.core.library.register_autograd``); the math is in ``_reference.py``. The Python
API calls them through ``call_norm_forward`` / ``call_add_norm_forward``: the same backward, less
host time per eager call.
"""

from __future__ import annotations

import math

import torch

from apex.core import checks
from apex.core.library import define, register_autograd
from apex.normalization import _reference
from apex.normalization._plugin import KERNELS

FLOAT_DTYPES = checks.FLOAT_DTYPES
_DTYPE_NAMES = "float32, float16, bfloat16"


# checks ----------------------------------------------------------------------------------------


def _check_normalized(op: str, name: str, t: torch.Tensor, normalized_shape) -> None:
    ndim = len(normalized_shape)
    if ndim == 0:
        raise ValueError(f"{op}: normalized_shape must have at least one dimension")
    if t.dim() < ndim or tuple(t.shape[t.dim() - ndim :]) != tuple(normalized_shape):
        raise ValueError(
            f"{op}: {name} of shape {tuple(t.shape)} does not end with normalized_shape {tuple(normalized_shape)}"
        )
    if math.prod(normalized_shape) == 0:
        raise ValueError(f"{op}: normalized_shape {tuple(normalized_shape)} has no elements")


def _check_affine(op: str, input_dtype, device, weight, bias, normalized_shape, rms: bool) -> None:
    if weight is not None:
        if weight.dtype not in (input_dtype, torch.float32):
            allowed = "float32" if input_dtype == torch.float32 else f"{str(input_dtype)[6:]} or float32"
            raise TypeError(
                f"{op}: weight has dtype {weight.dtype} but the input has {input_dtype}; weight must be {allowed}"
            )
        if tuple(weight.shape) != tuple(normalized_shape):
            raise ValueError(
                f"{op}: weight has shape {tuple(weight.shape)}, expected normalized_shape {tuple(normalized_shape)}"
            )
        checks.dense(op, "weight", weight, device)
    if bias is not None:
        if rms:
            raise ValueError(f"{op}: RMS norm takes no bias")
        if weight is None:
            raise ValueError(f"{op}: bias given without weight")
        if bias.dtype != weight.dtype:
            raise TypeError(f"{op}: bias has dtype {bias.dtype} but weight has {weight.dtype}")
        if tuple(bias.shape) != tuple(normalized_shape):
            raise ValueError(
                f"{op}: bias has shape {tuple(bias.shape)}, expected normalized_shape {tuple(normalized_shape)}"
            )
        checks.dense(op, "bias", bias, device)


def _output_dtypes(input_dtype, weight) -> tuple:
    return (input_dtype,) if weight is None or weight.dtype == input_dtype else (input_dtype, weight.dtype)


def check_forward(op, input, residual, weight, bias, normalized_shape, rms, output_dtype) -> torch.dtype:
    """The forward ops' argument checks (metadata only); returns the output dtype."""
    if input.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: input has dtype {input.dtype}; expected one of {_DTYPE_NAMES}")
    _check_normalized(op, "input", input, normalized_shape)
    checks.dense(op, "input", input, input.device)
    if residual is not None:
        if residual.dtype != input.dtype:
            raise TypeError(f"{op}: residual has dtype {residual.dtype} but input has {input.dtype}")
        if tuple(residual.shape) != tuple(input.shape):
            raise ValueError(f"{op}: residual has shape {tuple(residual.shape)} but input has {tuple(input.shape)}")
        checks.dense(op, "residual", residual, input.device)
    _check_affine(op, input.dtype, input.device, weight, bias, normalized_shape, rms)
    allowed = _output_dtypes(input.dtype, weight)
    if output_dtype is not None and output_dtype not in allowed:
        raise TypeError(
            f"{op}: output_dtype {output_dtype} is neither the input's dtype ({input.dtype}) nor the weight's"
            + ("" if weight is None else f" ({weight.dtype})")
        )
    return input.dtype if output_dtype is None else output_dtype


def check_backward(
    op, grad_output, saved, weight, bias, mean, rstd, normalized_shape, rms, memory_efficient, input_dtype, grad_res
) -> None:
    if input_dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: input_dtype is {input_dtype}; expected one of {_DTYPE_NAMES}")
    _check_normalized(op, "saved", saved, normalized_shape)
    device = saved.device
    checks.dense(op, "saved", saved, device)
    _check_affine(op, input_dtype, device, weight, bias, normalized_shape, rms)
    allowed = _output_dtypes(input_dtype, weight)
    if grad_output.dtype not in allowed:
        raise TypeError(
            f"{op}: grad_output has dtype {grad_output.dtype}; expected the output's dtype, one of "
            + ", ".join(str(d) for d in allowed)
        )
    if tuple(grad_output.shape) != tuple(saved.shape):
        raise ValueError(f"{op}: grad_output has shape {tuple(grad_output.shape)} but saved has {tuple(saved.shape)}")
    checks.dense(op, "grad_output", grad_output, device)
    expected_saved = grad_output.dtype if memory_efficient else input_dtype
    if saved.dtype != expected_saved:
        what = "the output, like grad_output" if memory_efficient else "the input, input_dtype"
        raise TypeError(f"{op}: saved has dtype {saved.dtype}; expected {expected_saved} ({what})")
    rows = math.prod(saved.shape[: saved.dim() - len(normalized_shape)])
    stats = [("rstd", rstd)] + ([] if rms or memory_efficient else [("mean", mean)])
    for name, t in stats:
        if t.dtype != torch.float32:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected float32")
        if t.numel() != rows:
            raise ValueError(f"{op}: {name} has {t.numel()} elements, expected one per row ({rows})")
        checks.dense(op, name, t, device)
    if grad_res is not None:
        if grad_res.dtype != input_dtype:
            raise TypeError(f"{op}: grad_residual_out has dtype {grad_res.dtype}; expected {input_dtype}")
        if tuple(grad_res.shape) != tuple(saved.shape):
            raise ValueError(
                f"{op}: grad_residual_out has shape {tuple(grad_res.shape)} but saved has {tuple(saved.shape)}"
            )
        checks.dense(op, "grad_residual_out", grad_res, device)


def _lead(t: torch.Tensor, normalized_shape) -> tuple:
    return tuple(t.shape[: t.dim() - len(normalized_shape)])


def _empty_f32(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,), dtype=torch.float32)


# norm_forward ----------------------------------------------------------------------------------

FORWARD_SCHEMA = (
    "norm_forward(Tensor input, Tensor? weight, Tensor? bias, SymInt[] normalized_shape, float eps, bool rms, "
    "bool memory_efficient=False, ScalarType? output_dtype=None) -> (Tensor output, Tensor mean, Tensor rstd)"
)


def _forward_reference(input, weight, bias, normalized_shape, eps, rms, memory_efficient=False, output_dtype=None):
    dtype = check_forward("norm_forward", input, None, weight, bias, normalized_shape, rms, output_dtype)
    out, _, mean, rstd = _reference.norm_forward(input, weight, bias, len(normalized_shape), eps, rms, dtype)
    return out.contiguous(), _empty_f32(input) if mean is None else mean.contiguous(), rstd.contiguous()


def _empty_forward_outputs(input, normalized_shape, rms, dtype):
    lead = _lead(input, normalized_shape)
    mean = _empty_f32(input) if rms else input.new_empty(lead, dtype=torch.float32)
    return input.new_empty(input.shape, dtype=dtype), mean, input.new_empty(lead, dtype=torch.float32)


def _forward_fake(input, weight, bias, normalized_shape, eps, rms, memory_efficient=False, output_dtype=None):
    dtype = check_forward("norm_forward", input, None, weight, bias, normalized_shape, rms, output_dtype)
    return _empty_forward_outputs(input, normalized_shape, rms, dtype)


norm_forward = define(KERNELS, FORWARD_SCHEMA, _forward_reference, _forward_fake)


# add_norm_forward ------------------------------------------------------------------------------

ADD_FORWARD_SCHEMA = (
    "add_norm_forward(Tensor input, Tensor residual, Tensor? weight, Tensor? bias, SymInt[] normalized_shape, "
    "float eps, bool rms, bool memory_efficient=False, ScalarType? output_dtype=None) -> "
    "(Tensor output, Tensor residual_out, Tensor mean, Tensor rstd)"
)


def _add_forward_reference(
    input, residual, weight, bias, normalized_shape, eps, rms, memory_efficient=False, output_dtype=None
):
    dtype = check_forward("add_norm_forward", input, residual, weight, bias, normalized_shape, rms, output_dtype)
    out, total, mean, rstd = _reference.norm_forward(
        input, weight, bias, len(normalized_shape), eps, rms, dtype, residual=residual
    )
    mean = _empty_f32(input) if mean is None else mean.contiguous()
    return out.contiguous(), total.contiguous(), mean, rstd.contiguous()


def _add_forward_fake(
    input, residual, weight, bias, normalized_shape, eps, rms, memory_efficient=False, output_dtype=None
):
    dtype = check_forward("add_norm_forward", input, residual, weight, bias, normalized_shape, rms, output_dtype)
    out, mean, rstd = _empty_forward_outputs(input, normalized_shape, rms, dtype)
    return out, torch.empty_like(input), mean, rstd


add_norm_forward = define(KERNELS, ADD_FORWARD_SCHEMA, _add_forward_reference, _add_forward_fake)


# norm_backward ---------------------------------------------------------------------------------

BACKWARD_SCHEMA = (
    "norm_backward(Tensor grad_output, Tensor saved, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, "
    "SymInt[] normalized_shape, bool rms, bool memory_efficient, ScalarType input_dtype, bool weight_grads=True, "
    "Tensor? grad_residual_out=None) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)"
)


def _backward_reference(
    grad_output,
    saved,
    weight,
    bias,
    mean,
    rstd,
    normalized_shape,
    rms,
    memory_efficient,
    input_dtype,
    weight_grads=True,
    grad_residual_out=None,
):
    check_backward(
        "norm_backward",
        grad_output,
        saved,
        weight,
        bias,
        mean,
        rstd,
        normalized_shape,
        rms,
        memory_efficient,
        input_dtype,
        grad_residual_out,
    )
    grad_input, grad_weight, grad_bias = _reference.norm_backward(
        grad_output,
        saved,
        weight,
        bias,
        None if rms or memory_efficient else mean,
        rstd,
        len(normalized_shape),
        rms,
        memory_efficient,
        input_dtype,
        weight_grads,
        grad_residual_out,
    )
    return (
        grad_input.contiguous(),
        _empty_f32(saved) if grad_weight is None else grad_weight.contiguous(),
        _empty_f32(saved) if grad_bias is None else grad_bias.contiguous(),
    )


def _backward_fake(
    grad_output,
    saved,
    weight,
    bias,
    mean,
    rstd,
    normalized_shape,
    rms,
    memory_efficient,
    input_dtype,
    weight_grads=True,
    grad_residual_out=None,
):
    check_backward(
        "norm_backward",
        grad_output,
        saved,
        weight,
        bias,
        mean,
        rstd,
        normalized_shape,
        rms,
        memory_efficient,
        input_dtype,
        grad_residual_out,
    )
    grad_input = saved.new_empty(saved.shape, dtype=input_dtype)
    with_weight = weight_grads and weight is not None
    grad_weight = torch.empty_like(weight) if with_weight else _empty_f32(saved)
    grad_bias = torch.empty_like(bias) if with_weight and bias is not None else _empty_f32(saved)
    return grad_input, grad_weight, grad_bias


norm_backward = define(KERNELS, BACKWARD_SCHEMA, _backward_reference, _backward_fake)


# autograd --------------------------------------------------------------------------------------


def _save_for_backward(ctx, normalized, output, weight, bias, mean, rstd, normalized_shape, rms, memory_efficient):
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)
    saved = output if memory_efficient else normalized
    keep_mean = not (rms or memory_efficient)
    ctx.save_for_backward(saved, weight, bias, mean if keep_mean else None, rstd)
    ctx.normalized_shape = tuple(normalized_shape)
    ctx.rms = rms
    ctx.memory_efficient = memory_efficient
    ctx.input_dtype = normalized.dtype


def _grads(ctx, grad_output, grad_residual_out, weight_index: int):
    """(grad_input, grad_weight, grad_bias) of a forward op whose weight is input ``weight_index``."""
    saved, weight, bias, mean, rstd = ctx.saved_tensors
    if grad_output is None:  # only the residual sum was used
        return grad_residual_out, None, None
    needs = ctx.needs_input_grad
    weight_grads = weight is not None and (needs[weight_index] or (bias is not None and needs[weight_index + 1]))
    grad_input, grad_weight, grad_bias = norm_backward(
        grad_output.contiguous(),
        saved,
        weight,
        bias,
        rstd.new_empty((0,)) if mean is None else mean,
        rstd,
        ctx.normalized_shape,
        ctx.rms,
        ctx.memory_efficient,
        ctx.input_dtype,
        weight_grads,
        None if grad_residual_out is None else grad_residual_out.contiguous(),
    )
    if not weight_grads:
        return grad_input, None, None
    return grad_input, grad_weight, grad_bias if bias is not None else None


def _forward_setup_context(ctx, inputs, output):
    input, weight, bias, normalized_shape, _eps, rms, memory_efficient, _output_dtype = inputs
    out, mean, rstd = output
    _save_for_backward(ctx, input, out, weight, bias, mean, rstd, normalized_shape, rms, memory_efficient)


def _forward_backward(ctx, grad_output, _grad_mean, _grad_rstd):
    grad_input, grad_weight, grad_bias = _grads(ctx, grad_output, None, weight_index=1)
    return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _add_forward_setup_context(ctx, inputs, output):
    _input, _residual, weight, bias, normalized_shape, _eps, rms, memory_efficient, _output_dtype = inputs
    out, residual_out, mean, rstd = output
    _save_for_backward(ctx, residual_out, out, weight, bias, mean, rstd, normalized_shape, rms, memory_efficient)


def _add_forward_backward(ctx, grad_output, grad_residual_out, _grad_mean, _grad_rstd):
    grad_sum, grad_weight, grad_bias = _grads(ctx, grad_output, grad_residual_out, weight_index=2)
    needs = ctx.needs_input_grad
    return (
        grad_sum if needs[0] else None,
        grad_sum if needs[1] else None,
        grad_weight,
        grad_bias,
        None,
        None,
        None,
        None,
        None,
    )


# What the Python API calls: the ops, with less host time per eager call (see register_autograd).
call_norm_forward = register_autograd(norm_forward, _forward_backward, _forward_setup_context)
call_add_norm_forward = register_autograd(add_norm_forward, _add_forward_backward, _add_forward_setup_context)
