"""apex_fused_dense's dispatcher ops: schemas, checks, references, fakes, and their autograd.

The ops take 2-D, contiguous ``input`` ``[rows, in_features]`` (the public functions flatten any
leading shape into rows) and weights ``[out_features, in_features]`` as ``nn.Linear``:

- ``linear_forward(input, weight, bias?) -> out``: ``input @ weight.T (+ bias)``;
- ``linear_backward(input, weight, grad_output, bias_grad) -> (d_input, d_weight, d_bias)``;
  ``d_bias`` is empty unless ``bias_grad``;
- ``linear_gelu_linear_forward(input, weight1, bias1, weight2, bias2) -> (output1, output2,
  gelu_in)``: ``gelu_in = input @ weight1.T + bias1``, ``output1 = gelu_tanh(gelu_in)``,
  ``output2 = output1 @ weight2.T + bias2``;
- ``linear_gelu_linear_backward(input, gelu_in, output1, weight1, weight2, grad_output) ->
  (d_input, d_weight1, d_bias1, d_weight2, d_bias2)``;
- ``wgrad_gemm_accum_fp32_(input, d_output, main_grad)`` and ``wgrad_gemm_accum_fp16_``:
  ``main_grad += d_output_rows.T @ input_rows`` in place, the rows being all leading dimensions
  (Megatron's ``[s, b, h]`` tensors); float32 ``main_grad`` for the first, ``main_grad`` of the
  16-bit input's dtype for the second.

Dtypes: float32, float16, bfloat16, and float64 (through the reference on every device). The CUDA
kernels (``csrc/fused_dense.cu``) make the same checks with the same words.
"""

from __future__ import annotations

import torch

from apex.core import checks
from apex.core.library import op
from apex.fused_dense._plugin import KERNELS

MATMUL_DTYPES = (*checks.FLOAT_DTYPES, torch.float64)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def _shape(t) -> tuple:
    return tuple(t.shape)


def _check_first(op, name, t, dtypes, contiguous=True) -> None:
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected one of {_names(dtypes)}")
    if t.layout != torch.strided:
        raise ValueError(f"{op}: {name} has layout {t.layout}; only dense (strided) tensors are supported")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{op}: {name} is not contiguous")


def _check_like(op, name, t, first_name, first, contiguous=True) -> None:
    if t.dtype != first.dtype:
        raise TypeError(f"{op}: {name} has dtype {t.dtype} but {first_name} has {first.dtype}")
    if contiguous:
        checks.dense(op, name, t, first.device)
    else:
        checks.placed(op, name, t, first.device)


def _check_ndim(op, name, t, ndim) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D, got shape {_shape(t)}")


def _check_size(op, name, t, dim, expected, what) -> None:
    if t.size(dim) != expected:
        raise ValueError(f"{op}: {name}.size({dim}) is {t.size(dim)}, expected {expected} ({what})")


def _check_linear(op, input, weight) -> None:
    _check_first(op, "input", input, MATMUL_DTYPES)
    _check_like(op, "weight", weight, "input", input)
    _check_ndim(op, "input", input, 2)
    _check_ndim(op, "weight", weight, 2)
    _check_size(op, "weight", weight, 1, input.size(1), "input.size(1)")


def _check_bias(op, name, bias, input, weight) -> None:
    _check_like(op, name, bias, "input", input)
    _check_ndim(op, name, bias, 1)
    _check_size(op, name, bias, 0, weight.size(0), "out features")


# ---------------------------------------------------------------- one dense layer


def _check_linear_forward(a) -> None:
    _check_linear(a.op, a.input, a.weight)
    if a.bias is not None:
        _check_bias(a.op, "bias", a.bias, a.input, a.weight)


def _linear_forward_fake(a):
    return a.input.new_empty((a.input.size(0), a.weight.size(0)))


@op(
    KERNELS,
    "linear_forward(Tensor input, Tensor weight, Tensor? bias) -> Tensor",
    check=_check_linear_forward,
    fake=_linear_forward_fake,
)
def linear_forward(a):
    if a.bias is None:
        return torch.mm(a.input, a.weight.t())
    return torch.addmm(a.bias, a.input, a.weight.t())


def _check_linear_backward(a) -> None:
    _check_linear(a.op, a.input, a.weight)
    _check_like(a.op, "grad_output", a.grad_output, "input", a.input)
    _check_ndim(a.op, "grad_output", a.grad_output, 2)
    _check_size(a.op, "grad_output", a.grad_output, 0, a.input.size(0), "input.size(0)")
    _check_size(a.op, "grad_output", a.grad_output, 1, a.weight.size(0), "weight.size(0)")


def _linear_backward_fake(a):
    d_bias = a.weight.new_empty((a.weight.size(0) if a.bias_grad else 0,))
    return torch.empty_like(a.input), torch.empty_like(a.weight), d_bias


@op(
    KERNELS,
    "linear_backward(Tensor input, Tensor weight, Tensor grad_output, bool bias_grad) -> (Tensor, Tensor, Tensor)",
    check=_check_linear_backward,
    fake=_linear_backward_fake,
)
def linear_backward(a):
    grad = a.grad_output
    d_bias = grad.sum(0) if a.bias_grad else a.weight.new_empty((0,))
    return grad.mm(a.weight), grad.t().mm(a.input), d_bias


# Autograd: registered on the forward ops with torch.library, for every device and for
# torch.compile. The CUDA library registers the same formula in C++ (csrc/fused_dense_autograd.cpp,
# for AutogradCUDA), which the dispatcher prefers for CUDA tensors once it is loaded: an eager call
# then pays no Python autograd layer (benchmarks/NOTES.md, host time). The two save the same tensors
# and call the same backward op.


def _dense_setup_context(ctx, inputs, output) -> None:
    input, weight, bias = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(input, weight)


def _dense_backward(ctx, grad):
    input, weight = ctx.saved_tensors
    d_input, d_weight, d_bias = linear_backward(input, weight, grad.contiguous(), ctx.has_bias)
    return d_input, d_weight, d_bias if ctx.has_bias else None


torch.library.register_autograd(linear_forward, _dense_backward, setup_context=_dense_setup_context)


# ---------------------------------------------------------------- dense -> GELU -> dense


def _check_gelu_layers(op, input, weight1, weight2) -> None:
    _check_linear(op, input, weight1)
    _check_like(op, "weight2", weight2, "input", input)
    _check_ndim(op, "weight2", weight2, 2)
    _check_size(op, "weight2", weight2, 1, weight1.size(0), "weight1.size(0)")


def _check_gelu_forward(a) -> None:
    _check_gelu_layers(a.op, a.input, a.weight1, a.weight2)
    _check_bias(a.op, "bias1", a.bias1, a.input, a.weight1)
    _check_bias(a.op, "bias2", a.bias2, a.input, a.weight2)


def _gelu_forward_fake(a):
    rows, hidden = a.input.size(0), a.weight1.size(0)
    return (
        a.input.new_empty((rows, hidden)),
        a.input.new_empty((rows, a.weight2.size(0))),
        a.input.new_empty((rows, hidden)),
    )


@op(
    KERNELS,
    "linear_gelu_linear_forward(Tensor input, Tensor weight1, Tensor bias1, Tensor weight2, Tensor bias2) "
    "-> (Tensor, Tensor, Tensor)",
    check=_check_gelu_forward,
    fake=_gelu_forward_fake,
)
def linear_gelu_linear_forward(a):
    gelu_in = torch.addmm(a.bias1, a.input, a.weight1.t())
    output1 = torch.nn.functional.gelu(gelu_in, approximate="tanh")
    return output1, torch.addmm(a.bias2, output1, a.weight2.t()), gelu_in


def _check_gelu_backward(a) -> None:
    _check_gelu_layers(a.op, a.input, a.weight1, a.weight2)
    rows, hidden = a.input.size(0), a.weight1.size(0)
    for name in ("gelu_in", "output1"):
        t = getattr(a, name)
        _check_like(a.op, name, t, "input", a.input)
        _check_ndim(a.op, name, t, 2)
        _check_size(a.op, name, t, 0, rows, "input.size(0)")
        _check_size(a.op, name, t, 1, hidden, "weight1.size(0)")
    _check_like(a.op, "grad_output", a.grad_output, "input", a.input)
    _check_ndim(a.op, "grad_output", a.grad_output, 2)
    _check_size(a.op, "grad_output", a.grad_output, 0, rows, "input.size(0)")
    _check_size(a.op, "grad_output", a.grad_output, 1, a.weight2.size(0), "weight2.size(0)")


def _gelu_backward_fake(a):
    w1, w2 = a.weight1, a.weight2
    return (
        torch.empty_like(a.input),
        torch.empty_like(w1),
        w1.new_empty((w1.size(0),)),
        torch.empty_like(w2),
        w2.new_empty((w2.size(0),)),
    )


@op(
    KERNELS,
    "linear_gelu_linear_backward(Tensor input, Tensor gelu_in, Tensor output1, Tensor weight1, Tensor weight2, "
    "Tensor grad_output) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    check=_check_gelu_backward,
    fake=_gelu_backward_fake,
)
def linear_gelu_linear_backward(a):
    grad = a.grad_output
    d_weight2, d_bias2 = grad.t().mm(a.output1), grad.sum(0)
    d_gelu_in = torch.ops.aten.gelu_backward(grad.mm(a.weight2), a.gelu_in, approximate="tanh")
    d_weight1, d_bias1 = d_gelu_in.t().mm(a.input), d_gelu_in.sum(0)
    return d_gelu_in.mm(a.weight1), d_weight1, d_bias1, d_weight2, d_bias2


def _gelu_setup_context(ctx, inputs, output) -> None:
    input, weight1, _, weight2, _ = inputs
    output1, _, gelu_in = output
    ctx.save_for_backward(input, gelu_in, output1, weight1, weight2)
    ctx.mark_non_differentiable(output1, gelu_in)
    # No zero-filled gradients for the two outputs kept for the backward (two [rows, hidden]
    # fills per step otherwise: 41 us of 0.75 ms at 8192 x 1024 x 4096 bf16 on the H200).
    ctx.set_materialize_grads(False)


def _gelu_backward(ctx, _grad_output1, grad, _grad_gelu_in):
    if grad is None:
        return None, None, None, None, None
    return linear_gelu_linear_backward(*ctx.saved_tensors, grad.contiguous())


torch.library.register_autograd(linear_gelu_linear_forward, _gelu_backward, setup_context=_gelu_setup_context)


# ---------------------------------------------------------------- Megatron's weight-gradient accumulation


def _rows(t) -> int:
    rows = 1
    for size in t.shape[:-1]:
        rows *= size
    return rows


def _check_wgrad(a, input_dtypes, fp32_accumulator: bool) -> None:
    op, input, d_output, main_grad = a.op, a.input, a.d_output, a.main_grad
    _check_first(op, "input", input, input_dtypes, contiguous=False)
    _check_like(op, "d_output", d_output, "input", input, contiguous=False)
    for name, t in (("input", input), ("d_output", d_output)):
        if t.dim() < 2:
            raise ValueError(f"{op}: {name} must have at least 2 dimensions, got shape {_shape(t)}")
    if _rows(input) != _rows(d_output):
        raise ValueError(
            f"{op}: d_output has shape {_shape(d_output)} and input has {_shape(input)}; "
            "their leading dimensions must hold as many rows"
        )
    if fp32_accumulator:
        if main_grad.dtype != torch.float32:
            raise TypeError(f"{op}: main_grad has dtype {main_grad.dtype}; expected torch.float32")
    elif main_grad.dtype != input.dtype:
        raise TypeError(f"{op}: main_grad has dtype {main_grad.dtype} but input has {input.dtype}")
    checks.dense(op, "main_grad", main_grad, input.device)
    expected = (d_output.size(-1), input.size(-1))
    if _shape(main_grad) != expected:
        raise ValueError(
            f"{op}: main_grad has shape {_shape(main_grad)}, expected {expected} (d_output.size(-1), input.size(-1))"
        )


def _wgrad_reference(a) -> None:
    input = a.input.reshape(-1, a.input.size(-1))
    d_output = a.d_output.reshape(-1, a.d_output.size(-1))
    # The product in the accumulator's precision, added once (beta = 1).
    dtype = a.main_grad.dtype
    a.main_grad.addmm_(d_output.t().to(dtype), input.to(dtype))


@op(
    KERNELS,
    "wgrad_gemm_accum_fp32(Tensor input, Tensor d_output, Tensor(a!) main_grad) -> ()",
    check=lambda a: _check_wgrad(a, checks.FLOAT_DTYPES, True),
)
def wgrad_gemm_accum_fp32(a):
    _wgrad_reference(a)


@op(
    KERNELS,
    "wgrad_gemm_accum_fp16(Tensor input, Tensor d_output, Tensor(a!) main_grad) -> ()",
    check=lambda a: _check_wgrad(a, HALF_DTYPES, False),
)
def wgrad_gemm_accum_fp16(a):
    _wgrad_reference(a)
