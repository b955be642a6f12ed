"""apex-normalization's dispatcher ops (namespace ``apex_normalization``) and their autograd.

Three ops serve layer norm and RMS norm (``rms=True``), with or without affine parameters:

- ``norm_forward`` returns ``(output, mean, rstd)``; ``mean`` is empty for RMS norm;
- ``add_norm_forward`` normalizes ``input + residual`` (rounded to the input's dtype) and returns
  ``(output, residual_out, mean, rstd)``, ``residual_out`` being that sum;
- ``norm_backward`` returns ``(grad_input, grad_weight, grad_bias)``; gradients not computed come
  back as empty float32 tensors. ``saved`` is the input (or the residual sum), or with
  ``memory_efficient`` the output.

Conventions: input float32, float16 or bfloat16, contiguous, its last dimensions equal to
``normalized_shape``; weight (and bias, layer norm only) of ``normalized_shape``, in the input's
dtype or float32; the output in the input's dtype or, for the mixed-dtype modules, the weight's
(``output_dtype``); ``mean``/``rstd`` float32 with the input's leading shape. The math is in
``_reference.py``. The forward ops are differentiable (see "autograd" below);
``memory_efficient`` changes only what their autograd saves (the output instead of the input),
not what the forward computes.
"""

from __future__ import annotations

import math

import torch

from apex.core import checks
from apex.core.library import Args, autograd, direct, op, plain_cpu
from apex.normalization import _reference
from apex.normalization._plugin import KERNELS

FLOAT_DTYPES = (*checks.FLOAT_DTYPES, torch.float64)  # float64 as upstream (its statistics float64 too)
_DTYPE_NAMES = "float32, float16, bfloat16, float64"


def stats_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """mean and rstd's dtype: float32, float64 for float64 input (upstream's)."""
    return torch.float64 if input_dtype == torch.float64 else torch.float32


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


def _check_affine(a, input_dtype, device) -> None:
    op, weight, bias, normalized_shape = a.op, a.weight, a.bias, a.normalized_shape
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
        if a.rms:
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


def _check_forward(a, residual=None) -> None:
    """norm_forward's checks, and add_norm_forward's with its residual; sets ``a.out_dtype``."""
    op, input = a.op, a.input
    if input.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: input has dtype {input.dtype}; expected one of {_DTYPE_NAMES}")
    _check_normalized(op, "input", input, a.normalized_shape)
    checks.dense(op, "input", input, input.device)
    if residual is not None:
        if residual.dtype != input.dtype:
            raise TypeError(f"{op}: residual has dtype {residual.dtype} but input has {input.dtype}")
        if tuple(residual.shape) != tuple(input.shape):
            raise ValueError(f"{op}: residual has shape {tuple(residual.shape)} but input has {tuple(input.shape)}")
        checks.dense(op, "residual", residual, input.device)
    _check_affine(a, input.dtype, input.device)
    if a.output_dtype is not None and a.output_dtype not in _output_dtypes(input.dtype, a.weight):
        raise TypeError(
            f"{op}: output_dtype {a.output_dtype} is neither the input's dtype ({input.dtype}) nor the weight's"
            + ("" if a.weight is None else f" ({a.weight.dtype})")
        )
    a.out_dtype = input.dtype if a.output_dtype is None else a.output_dtype


def _check_add_forward(a) -> None:
    _check_forward(a, a.residual)


def _check_backward(a) -> None:
    op, saved, grad_output = a.op, a.saved, a.grad_output
    input_dtype, memory_efficient = a.input_dtype, a.memory_efficient
    if input_dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: input_dtype is {input_dtype}; expected one of {_DTYPE_NAMES}")
    _check_normalized(op, "saved", saved, a.normalized_shape)
    device = saved.device
    checks.dense(op, "saved", saved, device)
    _check_affine(a, input_dtype, device)
    allowed = _output_dtypes(input_dtype, a.weight)
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
    rows = math.prod(saved.shape[: saved.dim() - len(a.normalized_shape)])
    stats = [("rstd", a.rstd)] + ([] if a.rms or memory_efficient else [("mean", a.mean)])
    expected_stats = stats_dtype(input_dtype)
    for name, t in stats:
        if t.dtype != expected_stats:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected {str(expected_stats)[6:]}")
        if t.numel() != rows:
            raise ValueError(f"{op}: {name} has {t.numel()} elements, expected one per row ({rows})")
        checks.dense(op, name, t, device)
    grad_res = a.grad_residual_out
    if grad_res is not None:
        if grad_res.dtype != input_dtype:
            raise TypeError(f"{op}: grad_residual_out has dtype {grad_res.dtype}; expected {input_dtype}")
        if tuple(grad_res.shape) != tuple(saved.shape):
            raise ValueError(
                f"{op}: grad_residual_out has shape {tuple(grad_res.shape)} but saved has {tuple(saved.shape)}"
            )
        checks.dense(op, "grad_residual_out", grad_res, device)


# fakes -----------------------------------------------------------------------------------------


def _empty_f32(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,), dtype=torch.float32)


def _forward_fake(a):
    input = a.input
    lead = input.shape[: input.dim() - len(a.normalized_shape)]
    stats = stats_dtype(input.dtype)
    mean = _empty_f32(input) if a.rms else input.new_empty(lead, dtype=stats)
    return input.new_empty(input.shape, dtype=a.out_dtype), mean, input.new_empty(lead, dtype=stats)


def _add_forward_fake(a):
    out, mean, rstd = _forward_fake(a)
    return out, torch.empty_like(a.input), mean, rstd


def _backward_fake(a):
    saved = a.saved
    with_weight = a.weight_grads and a.weight is not None
    grad_weight = torch.empty_like(a.weight) if with_weight else _empty_f32(saved)
    grad_bias = torch.empty_like(a.bias) if with_weight and a.bias is not None else _empty_f32(saved)
    return saved.new_empty(saved.shape, dtype=a.input_dtype), grad_weight, grad_bias


# ops -------------------------------------------------------------------------------------------


def _stats(input, mean, rstd):
    return _empty_f32(input) if mean is None else mean.contiguous(), rstd.contiguous()


@op(
    KERNELS,
    "norm_forward(Tensor input, Tensor? weight, Tensor? bias, SymInt[] normalized_shape, float eps, bool rms, "
    "bool memory_efficient=False, ScalarType? output_dtype=None) -> (Tensor output, Tensor mean, Tensor rstd)",
    check=_check_forward,
    fake=_forward_fake,
)
def norm_forward(a):
    out, _, mean, rstd = _reference.fast_norm_forward(
        a.input, a.weight, a.bias, len(a.normalized_shape), a.eps, a.rms, a.out_dtype
    )
    return out.contiguous(), *_stats(a.input, mean, rstd)


@op(
    KERNELS,
    "add_norm_forward(Tensor input, Tensor residual, Tensor? weight, Tensor? bias, SymInt[] normalized_shape, "
    "float eps, bool rms, bool memory_efficient=False, ScalarType? output_dtype=None) -> "
    "(Tensor output, Tensor residual_out, Tensor mean, Tensor rstd)",
    check=_check_add_forward,
    fake=_add_forward_fake,
)
def add_norm_forward(a):
    out, total, mean, rstd = _reference.fast_norm_forward(
        a.input, a.weight, a.bias, len(a.normalized_shape), a.eps, a.rms, a.out_dtype, a.residual
    )
    return out.contiguous(), total.contiguous(), *_stats(a.input, mean, rstd)


@op(
    KERNELS,
    "norm_backward(Tensor grad_output, Tensor saved, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, "
    "SymInt[] normalized_shape, bool rms, bool memory_efficient, ScalarType input_dtype, bool weight_grads=True, "
    "Tensor? grad_residual_out=None) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)",
    check=_check_backward,
    fake=_backward_fake,
)
def norm_backward(a):
    grad_input, grad_weight, grad_bias = _reference.fast_norm_backward(
        a.grad_output,
        a.saved,
        a.weight,
        a.bias,
        None if a.rms or a.memory_efficient else a.mean,
        a.rstd,
        len(a.normalized_shape),
        a.rms,
        a.memory_efficient,
        a.input_dtype,
        a.weight_grads,
        a.grad_residual_out,
    )
    return (
        grad_input.contiguous(),
        _empty_f32(a.saved) if grad_weight is None else grad_weight.contiguous(),
        _empty_f32(a.saved) if grad_bias is None else grad_bias.contiguous(),
    )


# autograd --------------------------------------------------------------------------------------
# Registered on both forward ops with torch.library, for every device and for torch.compile. The
# CUDA library registers the same formula in C++ (csrc/norm_autograd.cpp, for AutogradCUDA), which
# the dispatcher prefers for CUDA tensors once it is loaded: a Python autograd layer costs tens of
# microseconds of host time per eager call (benchmarks/NOTES.md, host time). The two save the same
# tensors and call norm_backward with the same arguments.


def _setup_context(ctx, inputs, output):
    """What backward needs: the normalized tensor (the input, or the residual sum) and the
    statistics (mean is empty for RMS norm); with memory_efficient the output instead, and rstd
    alone (the normalized values come back from the output), so that autograd holds neither the
    input nor the means."""
    with_residual = len(output) == 4
    if with_residual:
        input, _, weight, bias, normalized_shape, eps, rms, memory_efficient, _ = inputs
        out, normalized, mean, rstd = output
    else:
        input, weight, bias, normalized_shape, eps, rms, memory_efficient, _ = inputs
        out, mean, rstd = output
        normalized = input
    save(ctx, normalized, out, weight, bias, mean, rstd, normalized_shape, eps, rms, memory_efficient, input.dtype)
    ctx.with_residual = with_residual


def save(ctx, normalized, out, weight, bias, mean, rstd, normalized_shape, eps, rms, memory_efficient, input_dtype):
    """What :func:`backward` reads, saved on ``ctx`` (also by fused_layer_norm's Functions)."""
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)
    if memory_efficient:
        ctx.save_for_backward(out, weight, bias, None, rstd)
    else:
        ctx.save_for_backward(normalized, weight, bias, mean if not rms else None, rstd)
    ctx.config = (tuple(normalized_shape), eps, rms, memory_efficient, input_dtype)
    ctx.with_residual = False


def _double_backward_grads(ctx, grad_output, grad_residual_out, saved, weight, bias):
    """The gradients as differentiable torch ops, for a backward that records a graph
    (``create_graph=True``): the statistics are recomputed from the saved input so that their
    dependence on it is differentiated too (the saved mean and rstd are constants to autograd)."""
    normalized_shape, eps, rms, memory_efficient, input_dtype = ctx.config
    if memory_efficient:
        raise RuntimeError(
            "apex_normalization.norm_forward: double backward (create_graph=True) is not supported with "
            "memory_efficient=True (the input is not saved); use memory_efficient=False"
        )
    ndim = len(normalized_shape)
    _, _, mean, rstd = _reference.norm_forward(saved, None, None, ndim, eps, rms, saved.dtype)
    return _reference.norm_backward(
        grad_output, saved, weight, bias, mean, rstd, ndim, rms, False, input_dtype, True, grad_residual_out
    )


def backward(ctx, grad_output, grad_residual_out=None):
    """(grad_input, grad_weight, grad_bias), each None where not needed, of a forward saved by
    :func:`save`; the weight is the forward's input 1 (2 with a residual) in ``needs_input_grad``."""
    saved, weight, bias, mean, rstd = ctx.saved_tensors
    normalized_shape, _, rms, memory_efficient, input_dtype = ctx.config
    needs = ctx.needs_input_grad
    w = 2 if ctx.with_residual else 1
    if grad_output is None:  # only the residual sum was used
        grad_input, grad_weight, grad_bias = grad_residual_out, None, None
    elif torch.is_grad_enabled():
        grad_input, grad_weight, grad_bias = _double_backward_grads(
            ctx, grad_output, grad_residual_out, saved, weight, bias
        )
        if weight is None or not needs[w]:
            grad_weight = None
        if bias is None or not needs[w + 1]:
            grad_bias = None
    else:
        weight_grads = weight is not None and (needs[w] or (bias is not None and needs[w + 1]))
        # plain CPU tensors skip the dispatcher, as the eager forward does (the op, its autograd
        # layer and the re-dispatch: tens of microseconds of host time a call, see above)
        call = _direct_backward if plain_cpu(grad_output, saved) else norm_backward
        grad_input, grad_weight, grad_bias = call(
            grad_output.contiguous(),
            saved,
            weight,
            bias,
            rstd.new_empty((0,)) if mean is None else mean,
            rstd,
            normalized_shape,
            rms,
            memory_efficient,
            input_dtype,
            weight_grads,
            None if grad_residual_out is None else grad_residual_out.contiguous(),
        )
        if not weight_grads:
            grad_weight = grad_bias = None
        elif bias is None:
            grad_bias = None
    return grad_input, grad_weight, grad_bias


def _backward(ctx, grad_output, *grads):
    """One gradient per forward input: (input, [residual,] weight, bias, then None for the rest)."""
    with_residual = ctx.with_residual
    grad_residual_out = grads[0] if with_residual else None  # grads: of residual_out (if any), mean, rstd
    grad_input, grad_weight, grad_bias = backward(ctx, grad_output, grad_residual_out)
    needs = ctx.needs_input_grad
    rest = (None,) * 5
    if with_residual:
        return grad_input if needs[0] else None, grad_input if needs[1] else None, grad_weight, grad_bias, *rest
    return grad_input, grad_weight, grad_bias, *rest


torch.library.register_autograd(norm_forward, _backward, setup_context=_setup_context)
torch.library.register_autograd(add_norm_forward, _backward, setup_context=_setup_context)


# The eager CPU path: the same check, reference and autograd formula as the ops', past the
# dispatcher. Through the op, a small CPU call paid 50-100 us of host time (the op, its Python
# autograd layer, the re-dispatch) against PyTorch's 5-20 us for F.layer_norm / F.rms_norm
# (benchmarks/NOTES.md). functional.py takes it for plain CPU tensors outside torch.compile and
# any torch function or dispatch mode (apex.core.library.plain_cpu); everything else gets the ops.
_direct_backward = direct(norm_backward)
eager_norm_forward = autograd(direct(norm_forward), _setup_context, _backward, "NormForward")
eager_add_norm_forward = autograd(direct(add_norm_forward), _setup_context, _backward, "AddNormForward")


def aten_layer_norm(input, weight, bias, normalized_shape, eps):
    """Layer norm of plain CPU tensors (rows of 32 elements or more, no residual, not
    memory-efficient) that is PyTorch's native_layer_norm with its own autograd: float32/float64
    with weight and bias in the input's dtype or none, float16/bfloat16 without weight and bias
    (given float32 ones as the weight, as the reference does, so that the statistics are float32).
    For these norm_forward's reference and backward are the same kernels with the same arguments
    (the 16-bit backward: PyTorch's kernel for the input gradient, nothing else to compute), so the
    same bits, without a Python autograd node (about 0.1 ms a call at 2048 x 1024: a bare
    autograd.Function around native_layer_norm costs that much more than F.layer_norm there).
    One difference: a double backward (create_graph=True) is PyTorch's formula, in the input's dtype
    for 16-bit input where the op's is float32 (64 bf16 rows of 1024: the second-order gradient
    1.5e-2 of its largest value off float64, against 4.4e-3)."""
    a = Args({"op": "norm_forward", "input": input, "weight": weight, "bias": bias})
    a.__dict__.update(normalized_shape=normalized_shape, eps=eps, rms=False, memory_efficient=False, output_dtype=None)
    _check_forward(a)
    weight, bias = _reference._params_for(input, weight, bias, normalized_shape)
    return torch.native_layer_norm(input, normalized_shape, weight, bias, eps)[0]
