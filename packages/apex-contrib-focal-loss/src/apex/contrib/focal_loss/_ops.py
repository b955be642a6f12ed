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
no term cancels: the kernels take ``e = exp(-|x|)`` and ``l = log1p(e)``, ``-log p = max(-x, 0) + l``,
``-log(1 - p) = max(x, 0) + l`` and ``p^gamma = exp(-gamma * (-log p))``; the reference (the CPU
path) the same quantities as ``softplus(-x)``, ``softplus(x)``, ``sigmoid(+-x) ** gamma``. The CUDA
kernels (``csrc/focal_loss.cu``) check the same things in the same words.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

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


def _terms(x, positive: bool, gamma: float, half_smooth: float):
    """(loss, gradient) of each element of ``x`` (the math dtype) taken as a positive (``positive``) or as
    a negative, without ``alpha_t``: new tensors, four allocations and in-place passes (the CPU path).

    No term cancels: ``-log p`` and ``-log(1 - p)`` are softpluses, ``p`` and ``1 - p`` sigmoids."""
    target = 1 - half_smooth if positive else half_smooth  # the cross entropy's
    minus_x = torch.neg(x)
    neg_log_p = F.softplus(minus_x)
    one_minus_p = minus_x.sigmoid_()
    bce = F.softplus(x)  # -log(1 - p)
    if target != 0:  # target * -log(p) + (1 - target) * -log(1 - p)
        bce.lerp_(neg_log_p, target)
    del neg_log_p
    p = torch.sigmoid(x)
    # the modulating factor q^gamma with q the probability of the wrong answer; dq^gamma/dx
    # = gamma * q^gamma * (1 - p) for a negative (q = p) and -gamma * q^gamma * p for a positive
    # (q = 1 - p): gradient q^gamma (slope * bce + p - target)
    if positive:
        q, grad = one_minus_p, torch.addcmul(p, p, bce, value=-gamma, out=p)
    else:
        q, grad = p, torch.addcmul(p, one_minus_p, bce, value=gamma, out=one_minus_p)
    if target != 0:
        grad.sub_(target)
    factor = q.pow_(gamma)
    grad.mul_(factor)
    return factor.mul_(bce), grad


def focal_terms(x, targets, num_real_classes, alpha, gamma, label_smoothing):
    """(loss, gradient) of ``x`` (already in the math dtype), un-normalised: the loss summed (0-d).

    Every element is first taken as a negative; the one positive of a row (at most one: its target,
    when in ``[0, num_real_classes)``) is then computed apart and put in its place, so that the
    whole-tensor math has no masks or ``where``."""
    classes = x.shape[-1]
    rows = targets.numel()
    x = x.reshape(rows, classes)
    targets = targets.reshape(rows, 1)
    if x.numel() == 0:
        return x.new_zeros(()), x.new_zeros(x.shape)
    half_smooth = label_smoothing / 2
    loss, grad = _terms(x, False, gamma, half_smooth)
    column = targets.clamp(0, classes - 1)
    positive = (targets >= 0) & (targets < num_real_classes)
    loss_p, grad_p = _terms(x.gather(1, column), True, gamma, half_smooth)
    loss.scatter_(1, column, torch.where(positive, 0, loss.gather(1, column)))
    row_loss = loss[:, :num_real_classes].sum(1, keepdim=True) * (1 - alpha)
    row_loss += torch.where(positive, alpha * loss_p, 0)
    ignored = targets == IGNORE
    total = row_loss.masked_fill_(ignored, 0).sum()
    grad.mul_(1 - alpha)
    grad.scatter_(1, column, torch.where(positive, alpha * grad_p, grad.gather(1, column)))
    grad[:, num_real_classes:] = 0
    # the ignored rows by index, not a broadcast mask (a 5x slower CPU loop); exact zeros whatever their logits
    grad.index_fill_(0, ignored.view(rows).nonzero().view(-1), 0)
    return total, grad


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
    total = loss / a.num_positives_sum.reshape(()).to(math_dtype)
    return total, grad.to(x.dtype).view(x.shape)


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
    # (not read while Dynamo traces the backward: torch 2.6's refuses .requires_grad there)
    if not torch.compiler.is_compiling() and grad_loss.requires_grad:
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
