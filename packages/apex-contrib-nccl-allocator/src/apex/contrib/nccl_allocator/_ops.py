"""apex_contrib_nccl_allocator's dispatcher ops: schemas, checks, references, fakes, and their callers.

How an op is written: ``apex.core.library``. Pure PyTorch: the references run on every device.
"""

from __future__ import annotations

import math

import torch

from apex.contrib.nccl_allocator._plugin import KERNELS
from apex.core import checks
from apex.core.library import autograd, op


def _check_scale(a) -> None:
    if a.x.dtype not in checks.FLOAT_DTYPES:
        raise TypeError(f"{a.op}: x has dtype {a.x.dtype}; expected one of float32, float16, bfloat16")
    checks.dense(a.op, "x", a.x, a.x.device)
    if not math.isfinite(a.alpha):
        raise ValueError(f"{a.op}: alpha must be finite, got {a.alpha}")


def _scale_fake(a):
    return torch.empty_like(a.x)


@op(KERNELS, "scale(Tensor x, float alpha) -> Tensor", check=_check_scale, fake=_scale_fake)
def scale(a):
    # For 16-bit x torch computes in float32 and rounds once: the contract a CUDA kernel must keep too.
    return a.x * a.alpha


def _scale_setup_context(ctx, inputs, output) -> None:
    ctx.alpha = inputs[1]


def _scale_backward(ctx, grad):
    # Gradients may arrive expanded (the backward of sum()); the op takes contiguous tensors only.
    return scale(grad.contiguous(), ctx.alpha), None


differentiable_scale = autograd(scale, _scale_setup_context, _scale_backward, "Scale")
