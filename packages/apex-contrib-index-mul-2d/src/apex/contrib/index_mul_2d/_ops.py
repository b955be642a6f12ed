"""apex_contrib_index_mul_2d's dispatcher ops: schemas, checks, references, fakes, and autograd.

Three ops (``torch.ops.apex_contrib_index_mul_2d.*``) on ``in1 [N1, F]``, ``in2 [N2, F]`` and
``idx1 [N2]`` (int64, every value in ``[0, N1)``):

- ``index_mul_2d(in1, in2, idx1) -> out``: ``out[i] = in1[idx1[i]] * in2[i]``;
- ``index_mul_2d_backward(grad_out, in1, in2, idx1) -> (grad_in1, grad_in2)``:
  ``grad_in2 = grad_out * in1[idx1]`` and ``grad_in1 = zeros.index_add(0, idx1, grad_out * in2)``;
- ``index_mul_2d_backward_backward(grad_grad_in1, grad_grad_in2, grad_out, in1, in2, idx1)
  -> (grad_grad_out, grad_in1, grad_in2)``, the backward of the backward:
  ``grad_grad_out = grad_grad_in1[idx1] * in2 + grad_grad_in2 * in1[idx1]``,
  ``grad_in1 = zeros.index_add(0, idx1, grad_grad_in2 * grad_out)``,
  ``grad_in2 = grad_grad_in1[idx1] * grad_out``.

Tensors are 2-D (``idx1`` 1-D), contiguous, on one device, of one dtype among float32, float16,
bfloat16 and float64. Math in float32 for the 16-bit types (float64 for float64), each output
rounded once; the row sums of ``grad_in1`` are accumulated in float32 too (see the CUDA kernel:
atomics into a float32 buffer). An index outside ``[0, N1)`` (negative ones included, which
PyTorch's indexing would wrap) is an error: IndexError on the CPU; on CUDA a device-side
assertion, as PyTorch's own indexing kernels do, since checking on the host would wait for the
device.

The CUDA kernels (``csrc/index_mul_2d.cu``) check the same things in the same words.
"""

from __future__ import annotations

import torch

from apex.contrib.index_mul_2d._plugin import KERNELS
from apex.core import checks
from apex.core.library import autograd, op

DTYPES = (*checks.FLOAT_DTYPES, torch.float64)
_DTYPE_NAMES = "float32, float16, bfloat16, float64"


# checks ----------------------------------------------------------------------------------------


def _check_rows(op: str, name: str, t: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> None:
    if dtype is None:
        if t.dtype not in DTYPES:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected one of {_DTYPE_NAMES}")
    elif t.dtype != dtype:
        raise TypeError(f"{op}: {name} has dtype {t.dtype} but in1 has dtype {dtype}")
    if t.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D, got shape {tuple(t.shape)}")
    checks.dense(op, name, t, device)


def _check_operands(a) -> None:
    """in1 [N1, F], in2 [N2, F], idx1 [N2] int64."""
    op, in1, in2, idx1 = a.op, a.in1, a.in2, a.idx1
    _check_rows(op, "in1", in1, in1.device, None)
    _check_rows(op, "in2", in2, in1.device, in1.dtype)
    if in2.shape[1] != in1.shape[1]:
        raise ValueError(
            f"{op}: in2 has {in2.shape[1]} features (shape {tuple(in2.shape)}) but in1 has {in1.shape[1]} "
            f"(shape {tuple(in1.shape)})"
        )
    if idx1.dtype != torch.int64:
        raise TypeError(f"{op}: idx1 has dtype {idx1.dtype}; expected int64")
    if idx1.dim() != 1 or idx1.shape[0] != in2.shape[0]:
        raise ValueError(
            f"{op}: idx1 must have shape ({in2.shape[0]},) (one index per row of in2), got {tuple(idx1.shape)}"
        )
    checks.dense(op, "idx1", idx1, in1.device)


def _check_like(op: str, name: str, t: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    _check_rows(op, name, t, like.device, like.dtype)
    if t.shape != like.shape:
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)} but {like_name} has shape {tuple(like.shape)}")


def _check_backward(a) -> None:
    _check_operands(a)
    _check_like(a.op, "grad_out", a.grad_out, "in2", a.in2)


def _check_backward_backward(a) -> None:
    _check_backward(a)
    _check_like(a.op, "grad_grad_in1", a.grad_grad_in1, "in1", a.in1)
    _check_like(a.op, "grad_grad_in2", a.grad_grad_in2, "in2", a.in2)


# references ------------------------------------------------------------------------------------


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _gathered(op: str, t: torch.Tensor, idx1: torch.Tensor) -> torch.Tensor:
    """t[idx1], a new tensor in t's dtype; indices out of [0, N1) raise (on the CPU; on CUDA
    index_select asserts on the device)."""
    if idx1.device.type == "cpu" and idx1.numel() and (int(idx1.min()) < 0 or int(idx1.max()) >= t.shape[0]):
        bad = idx1[(idx1 < 0) | (idx1 >= t.shape[0])][0]
        raise IndexError(f"{op}: idx1 has a value out of range: {int(bad)} is not in [0, {t.shape[0]}) (in1's rows)")
    return torch.index_select(t, 0, idx1)


# A product of two tensors of one dtype is taken in that dtype: torch's 16-bit multiplication computes
# in float32 and rounds once (the product of two 16-bit values is exact in float32), so this is the
# float32 math rounded once without float32 copies (which, and mixed-dtype products, took the CPU path
# 2x torch's time in bfloat16). Sums take the math dtype.


def _math_product(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x * y in the math dtype, a new tensor (exact for 16-bit x and y)."""
    math = _math_dtype(x.dtype)
    return torch.mul(x, y) if x.dtype == math else x.to(math).mul_(y)


def _scattered(rows: int, idx1: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """zeros([rows, F]).index_add(0, idx1, values), summed in values' (math) dtype, rounded once."""
    out = values.new_zeros((rows, values.shape[1]))
    return out.index_add_(0, idx1, values).to(dtype)


@op(
    KERNELS,
    "index_mul_2d(Tensor in1, Tensor in2, Tensor idx1) -> Tensor",
    check=_check_operands,
    fake=lambda a: torch.empty_like(a.in2),
)
def index_mul_2d(a):
    return _gathered(a.op, a.in1, a.idx1).mul_(a.in2)


@op(
    KERNELS,
    "index_mul_2d_backward(Tensor grad_out, Tensor in1, Tensor in2, Tensor idx1) -> (Tensor, Tensor)",
    check=_check_backward,
    fake=lambda a: (torch.empty_like(a.in1), torch.empty_like(a.in2)),
)
def index_mul_2d_backward(a):
    grad_in2 = _gathered(a.op, a.in1, a.idx1).mul_(a.grad_out)
    grad_in1 = _scattered(a.in1.shape[0], a.idx1, _math_product(a.grad_out, a.in2), a.in1.dtype)
    return grad_in1, grad_in2


@op(
    KERNELS,
    "index_mul_2d_backward_backward(Tensor grad_grad_in1, Tensor grad_grad_in2, Tensor grad_out, Tensor in1, "
    "Tensor in2, Tensor idx1) -> (Tensor, Tensor, Tensor)",
    check=_check_backward_backward,
    fake=lambda a: (torch.empty_like(a.grad_out), torch.empty_like(a.in1), torch.empty_like(a.in2)),
)
def index_mul_2d_backward_backward(a):
    gg1 = _gathered(a.op, a.grad_grad_in1, a.idx1)
    grad_grad_out = _math_product(gg1, a.in2).addcmul_(a.grad_grad_in2, _gathered(a.op, a.in1, a.idx1))
    grad_in1 = _scattered(a.in1.shape[0], a.idx1, _math_product(a.grad_grad_in2, a.grad_out), a.in1.dtype)
    grad_in2 = gg1.mul_(a.grad_out)
    return grad_grad_out.to(a.grad_out.dtype), grad_in1, grad_in2


# autograd --------------------------------------------------------------------------------------
# First and second derivatives, as upstream: the forward's backward is itself differentiable (its
# backward is index_mul_2d_backward_backward); a third derivative raises. Gradients may arrive
# expanded or transposed (the backward of sum(), of a matmul), the ops take contiguous tensors.


def _save_operands(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _third_derivative(ctx, *grads):
    raise RuntimeError(
        "index_mul_2d: a third derivative is not supported (first and second derivatives are, as upstream's)"
    )


_differentiable_backward_backward = autograd(
    index_mul_2d_backward_backward, _save_operands, _third_derivative, "IndexMul2dBackwardBackward"
)


def _backward_backward(ctx, grad_grad_in1, grad_grad_in2):
    grad_out, in1, in2, idx1 = ctx.saved_tensors
    grad_grad_out, grad_in1, grad_in2 = _differentiable_backward_backward(
        grad_grad_in1.contiguous(), grad_grad_in2.contiguous(), grad_out, in1, in2, idx1
    )
    return grad_grad_out, grad_in1, grad_in2, None


_differentiable_backward = autograd(index_mul_2d_backward, _save_operands, _backward_backward, "IndexMul2dBackward")


def _backward(ctx, grad_out):
    in1, in2, idx1 = ctx.saved_tensors
    grad_in1, grad_in2 = _differentiable_backward(grad_out.contiguous(), in1, in2, idx1)
    return grad_in1, grad_in2, None


differentiable_index_mul_2d = autograd(index_mul_2d, _save_operands, _backward, "IndexMul2d")
