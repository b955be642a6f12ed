"""Upstream Apex's ``fused_index_mul_2d`` extension module, on apex-contrib-index-mul-2d's ops.

Upstream's functions, argument orders and in-place outputs (each returns None); the math is in
``apex.contrib.index_mul_2d._ops``. These run on the CPU too (the PyTorch references), and take
bfloat16 as well. As upstream, ``*_backward`` and ``*_backward_backward`` add the gradient of
``in1`` into ``grad_in1`` (the caller passes zeros); the other outputs are overwritten.

- ``float_forward(out, in1, in2, idx1)`` / ``half_forward(...)``: ``out = in1[idx1] * in2``;
- ``float_backward(grad_in1, grad_in2, grad_out, in1, in2, idx1)`` / ``half_backward(...)``;
- ``float_backward_backward(grad_grad_out, grad_in1, grad_in2, grad_out, grad_grad_in1,
  grad_grad_in2, in1, in2, idx1)`` / ``half_backward_backward(...)``.

The ``float_`` functions take float32 tensors, the ``half_`` ones float16 (or bfloat16); another
dtype raises TypeError naming the argument.
"""

from __future__ import annotations

import torch

import apex.contrib.index_mul_2d._ops  # noqa: F401  (registers the ops)

_ops = torch.ops.apex_contrib_index_mul_2d


def _require(function: str, dtypes: tuple, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype not in dtypes:
            expected = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise TypeError(f"fused_index_mul_2d.{function}: {name} has dtype {t.dtype}; expected {expected}")


def _forward(function, dtypes, out, in1, in2, idx1) -> None:
    _require(function, dtypes, out=out, in1=in1)
    out.copy_(_ops.index_mul_2d(in1, in2, idx1))


def _backward(function, dtypes, grad_in1, grad_in2, grad_out, in1, in2, idx1) -> None:
    _require(function, dtypes, grad_in1=grad_in1, grad_in2=grad_in2, in1=in1)
    d_in1, d_in2 = _ops.index_mul_2d_backward(grad_out, in1, in2, idx1)
    grad_in1.add_(d_in1)
    grad_in2.copy_(d_in2)


def _backward_backward(function, dtypes, outputs, inputs) -> None:
    grad_grad_out, grad_in1, grad_in2 = outputs
    _require(function, dtypes, grad_grad_out=grad_grad_out, grad_in1=grad_in1, grad_in2=grad_in2, in1=inputs[3])
    grad_out, grad_grad_in1, grad_grad_in2, in1, in2, idx1 = inputs
    d_grad_out, d_in1, d_in2 = _ops.index_mul_2d_backward_backward(
        grad_grad_in1, grad_grad_in2, grad_out, in1, in2, idx1
    )
    grad_grad_out.copy_(d_grad_out)
    grad_in1.add_(d_in1)
    grad_in2.copy_(d_in2)


_FLOAT = (torch.float32,)
_HALF = (torch.float16, torch.bfloat16)


def float_forward(out, in1, in2, idx1) -> None:
    _forward("float_forward", _FLOAT, out, in1, in2, idx1)


def half_forward(out, in1, in2, idx1) -> None:
    _forward("half_forward", _HALF, out, in1, in2, idx1)


def float_backward(grad_in1, grad_in2, grad_out, in1, in2, idx1) -> None:
    _backward("float_backward", _FLOAT, grad_in1, grad_in2, grad_out, in1, in2, idx1)


def half_backward(grad_in1, grad_in2, grad_out, in1, in2, idx1) -> None:
    _backward("half_backward", _HALF, grad_in1, grad_in2, grad_out, in1, in2, idx1)


def float_backward_backward(
    grad_grad_out, grad_in1, grad_in2, grad_out, grad_grad_in1, grad_grad_in2, in1, in2, idx1
) -> None:
    outputs, inputs = (grad_grad_out, grad_in1, grad_in2), (grad_out, grad_grad_in1, grad_grad_in2, in1, in2, idx1)
    _backward_backward("float_backward_backward", _FLOAT, outputs, inputs)


def half_backward_backward(
    grad_grad_out, grad_in1, grad_in2, grad_out, grad_grad_in1, grad_grad_in2, in1, in2, idx1
) -> None:
    outputs, inputs = (grad_grad_out, grad_in1, grad_in2), (grad_out, grad_grad_in1, grad_grad_in2, in1, in2, idx1)
    _backward_backward("half_backward_backward", _HALF, outputs, inputs)


__all__ = [
    "float_backward",
    "float_backward_backward",
    "float_forward",
    "half_backward",
    "half_backward_backward",
    "half_forward",
]
