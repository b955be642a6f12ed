"""apex_contrib_focal_loss's dispatcher ops: schemas, checks, references, fakes, and autograd.

The sigmoid focal loss of RetinaNet over logits ``cls_output [..., C]`` with one class index per
row in ``cls_targets_at_level [...]`` (int64):

- a row whose target is ``-2`` is ignored (no loss, zero gradient);
- columns ``c >= num_real_classes`` are padding (no loss, zero gradient);
- element ``(row, c)`` is positive when ``c`` equals the row's target, negative otherwise (a
  target of ``-1``, or any other value outside ``[0, num_real_classes)``, makes the whole row
  negative: background, as upstream's kernel treats it);
- with ``p = sigmoid(x)``, a positive adds ``alpha * (1 - p)^gamma * bce(x, 1 - s/2)`` and a
  negative ``(1 - alpha) * p^gamma * bce(x, s/2)``, where ``s`` is ``label_smoothing`` and
  ``bce(x, t) = -t log p - (1 - t) log(1 - p)`` (the modulating factor uses the hard label);
- the loss is the sum over every element divided by ``num_positives_sum[0]``, a one-element
  float32 tensor on the logits' device (read by the kernels on the device: no host sync).

Ops:

- ``focal_loss_forward(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes,
  alpha, gamma, label_smoothing=0.0) -> (loss, partial_grad)``: ``loss`` is a 0-d float32 tensor
  (float64 for float64 logits); ``partial_grad`` (the logits' shape and dtype) is the gradient of
  the un-normalised sum, computed here because it shares the forward's transcendentals;
- ``focal_loss_backward(grad_output, partial_grad, num_positives_sum) -> grad_input``:
  ``partial_grad * grad_output / num_positives_sum`` (float32 math, rounded once);
- ``focal_loss_backward_(partial_grad, grad_output, num_positives_sum) -> ()``: the same in
  place, as upstream's ``focal_loss_cuda.backward``.

Math in float32 for float32, float16 and bfloat16 logits (float64 for float64), written so that
no term cancels: with ``e = exp(-|x|)`` and ``l = log1p(e)``, ``-log p = max(-x, 0) + l``,
``-log(1 - p) = max(x, 0) + l`` and ``p^gamma = exp(-gamma * (-log p))``. The CUDA kernels
(``csrc/focal_loss.cu``) check the same things in the same words.
"""

from __future__ import annotations

import math

import torch

from apex.contrib.focal_loss._plugin import KERNELS
from apex.core import checks
from apex.core.library import autograd, op

DTYPES = (*checks.FLOAT_DTYPES, torch.float64)
_DTYPE_NAMES = "float32, float16, bfloat16, float64"
IGNORE = -2  # a target that drops its row


# checks ----------------------------------------------------------------------------------------


def _check_num_positives_sum(op: str, t: torch.Tensor, device: torch.device) -> None:
    checks.scalar_tensor(op, "num_positives_sum", t, (torch.float32,), device)


def _check_forward(a) -> None:
    op, x, y = a.op, a.cls_output, a.cls_targets_at_level
    if x.dtype not in DTYPES:
        raise TypeError(f"{op}: cls_output has dtype {x.dtype}; expected one of {_DTYPE_NAMES}")
    if x.dim() < 1:
        raise ValueError(f"{op}: cls_output must have a class dimension (at least 1-D), got shape {tuple(x.shape)}")
    checks.dense(op, "cls_output", x, x.device)
    if y.dtype != torch.int64:
        raise TypeError(f"{op}: cls_targets_at_level has dtype {y.dtype}; expected int64")
    if y.shape != x.shape[:-1]:
        raise ValueError(
            f"{op}: cls_targets_at_level must have cls_output's shape without the class dimension, "
            f"{tuple(x.shape[:-1])}, got {tuple(y.shape)}"
        )
    checks.dense(op, "cls_targets_at_level", y, x.device)
    _check_num_positives_sum(op, a.num_positives_sum, x.device)
    classes = x.shape[-1]
    if not 0 <= a.num_real_classes <= classes:
        raise ValueError(
            f"{op}: num_real_classes must be in [0, {classes}] (cls_output's last dimension), got {a.num_real_classes}"
        )
    for name in ("alpha", "gamma", "label_smoothing"):
        value = getattr(a, name)
        if not math.isfinite(value):
            raise ValueError(f"{op}: {name} must be finite, got {value}")


def _check_partial_grad(op: str, partial_grad: torch.Tensor) -> None:
    if partial_grad.dtype not in DTYPES:
        raise TypeError(f"{op}: partial_grad has dtype {partial_grad.dtype}; expected one of {_DTYPE_NAMES}")
    checks.dense(op, "partial_grad", partial_grad, partial_grad.device)


def _check_backward(a) -> None:
    _check_partial_grad(a.op, a.partial_grad)
    loss_dtype = _loss_dtype(a.partial_grad.dtype)
    checks.scalar_tensor(a.op, "grad_output", a.grad_output, (loss_dtype,), a.partial_grad.device)
    _check_num_positives_sum(a.op, a.num_positives_sum, a.partial_grad.device)


# references ------------------------------------------------------------------------------------


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def focal_terms(x, targets, num_real_classes, alpha, gamma, label_smoothing):
    """(loss, gradient) of every element of ``x`` (already in the math dtype), un-normalised."""
    classes = torch.arange(x.shape[-1], device=x.device)
    targets = targets.unsqueeze(-1)
    positive = classes == targets
    counted = (classes < num_real_classes) & (targets != IGNORE)
    e = torch.exp(-x.abs())
    l = torch.log1p(e)  # noqa: E741
    neg_log_p = torch.clamp(-x, min=0) + l  # -log(p) = softplus(-x)
    neg_log_1mp = torch.clamp(x, min=0) + l  # -log(1 - p) = softplus(x)
    p = torch.where(x >= 0, 1, e) / (1 + e)
    half_smooth = label_smoothing / 2
    target = torch.full_like(x, half_smooth).masked_fill_(positive, 1 - half_smooth)
    alpha_t = torch.full_like(x, 1 - alpha).masked_fill_(positive, alpha)
    bce = target * neg_log_p + (1 - target) * neg_log_1mp
    # the modulating factor q^gamma with q the probability of the wrong answer; dq^gamma/dx
    # = gamma * q^gamma * (1 - p) for a negative (q = p) and -gamma * q^gamma * p for a positive
    factor = alpha_t * torch.exp(-gamma * torch.where(positive, neg_log_1mp, neg_log_p))
    slope = torch.where(positive, -gamma * p, gamma * (1 - p))
    loss = torch.where(counted, factor * bce, 0)
    grad = torch.where(counted, factor * (slope * bce + p - target), 0)
    return loss, grad


def _forward_fake(a):
    x = a.cls_output
    return x.new_empty((), dtype=_loss_dtype(x.dtype)), torch.empty_like(x)


@op(
    KERNELS,
    "focal_loss_forward(Tensor cls_output, Tensor cls_targets_at_level, Tensor num_positives_sum, "
    "int num_real_classes, float alpha, float gamma, float label_smoothing=0.0) -> (Tensor, Tensor)",
    check=_check_forward,
    fake=_forward_fake,
)
def focal_loss_forward(a):
    x = a.cls_output
    math_dtype = _loss_dtype(x.dtype)
    loss, grad = focal_terms(
        x.to(math_dtype), a.cls_targets_at_level, a.num_real_classes, a.alpha, a.gamma, a.label_smoothing
    )
    total = loss.sum() / a.num_positives_sum.reshape(()).to(math_dtype)
    return total, grad.to(x.dtype)


def _normaliser(a) -> torch.Tensor:
    math_dtype = _loss_dtype(a.partial_grad.dtype)
    return a.grad_output.reshape(()).to(math_dtype) / a.num_positives_sum.reshape(()).to(math_dtype)


@op(
    KERNELS,
    "focal_loss_backward(Tensor grad_output, Tensor partial_grad, Tensor num_positives_sum) -> Tensor",
    check=_check_backward,
    fake=lambda a: torch.empty_like(a.partial_grad),
)
def focal_loss_backward(a):
    return (a.partial_grad * _normaliser(a)).to(a.partial_grad.dtype)


@op(
    KERNELS,
    "focal_loss_backward_(Tensor(a!) partial_grad, Tensor grad_output, Tensor num_positives_sum) -> ()",
    check=_check_backward,
)
def focal_loss_backward_(a):
    a.partial_grad.copy_(a.partial_grad * _normaliser(a))


# autograd --------------------------------------------------------------------------------------
# The forward op returns the loss and the partial gradient; the differentiable caller returns
# both, the second marked non-differentiable and saved for the backward. The backward scales a
# copy (upstream scales in place, which breaks a second backward through the same graph). The
# gradient of num_positives_sum, -grad * loss / num_positives_sum, is returned too (upstream
# returns none); the targets and the scalars get none. The backward is not itself differentiable:
# a second derivative raises.


def _setup_context(ctx, inputs, output) -> None:
    loss, partial_grad = output
    ctx.mark_non_differentiable(partial_grad)
    ctx.save_for_backward(partial_grad, inputs[2], loss)


def _backward(ctx, grad_loss, _grad_partial):
    partial_grad, num_positives_sum, loss = ctx.saved_tensors
    if grad_loss.requires_grad:
        raise RuntimeError("focal_loss: a second derivative is not supported")
    grad_loss = grad_loss.reshape(())
    grad_input = None
    if ctx.needs_input_grad[0]:
        grad_input = focal_loss_backward(grad_loss, partial_grad, num_positives_sum)
    grad_num = None
    if ctx.needs_input_grad[2]:
        grad_num = (-grad_loss * loss / num_positives_sum.reshape(())).reshape(num_positives_sum.shape)
        grad_num = grad_num.to(num_positives_sum.dtype)
    return grad_input, None, grad_num, None, None, None, None


differentiable_focal_loss = autograd(focal_loss_forward, _setup_context, _backward, "FocalLoss")
