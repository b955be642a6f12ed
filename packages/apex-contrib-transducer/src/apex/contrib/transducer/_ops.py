"""apex_contrib_transducer's dispatcher ops: schemas, checks, fakes, the references' callers, autograd.

- ``joint_forward(f, g, f_len, g_len, batch_offset=None, packed_batch=0, relu=False,
  dropout_prob=0.0, seed=None) -> (out, mask)``: ``out[b, t, u] = f[b, t] + g[b, u]``; padded
  ``[B, T, U, H]`` (rows outside ``(f_len, g_len)`` hold -1) or, with ``batch_offset``, packed
  ``[packed_batch, H]``. ReLU with ``relu``; dropout with ``seed`` (an int64 one-element tensor
  on f's device: the mask is a hash of the seed and each element's index, the same on every device).
  ``mask`` (uint8, out's shape) is 1 where the value was kept; empty when neither is asked.
- ``joint_backward(grad, mask, f_len, g_len, batch_offset, max_f_len, max_g_len, scale) ->
  (f_grad, g_grad)``: sums of ``grad * mask * scale`` over u and over t on the valid rows.
- ``loss_forward(x, label, f_len, y_len, batch_offset, max_f_len, blank_idx, normalize) ->
  (alpha, beta, loss, lse)``: the RNN-T forward-backward over the T x U lattice. x holds
  log-probabilities, or with ``normalize`` logits (then ``lse``, each row's log-sum-exp, is
  returned for the backward; otherwise ``lse`` is empty).
- ``loss_backward(x, loss_grad, alpha, beta, lse, label, f_len, y_len, batch_offset, blank_idx,
  fuse_softmax) -> x_grad``: the gradient w.r.t. the logits with ``fuse_softmax`` (the softmax's
  backward folded in), else w.r.t. the log-probabilities.

Lengths and labels are int32, offsets int64, all on x's (f's) device. The CUDA kernels
(``csrc/``) make the same checks with the same words.
"""

from __future__ import annotations

import math

import torch

from apex.contrib.transducer import _reference
from apex.contrib.transducer._plugin import KERNELS
from apex.core import checks
from apex.core.library import autograd, op

FLOAT_DTYPES = (*checks.FLOAT_DTYPES, torch.float64)
_DTYPE_NAMES = "float32, float16, bfloat16, float64"


# checks ----------------------------------------------------------------------------------------


def _float_tensor(op: str, name: str, t: torch.Tensor, device) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected one of {_DTYPE_NAMES}")
    checks.dense(op, name, t, device)


def _dims(op: str, name: str, t: torch.Tensor, dims: int, layout: str) -> None:
    if t.dim() != dims:
        raise ValueError(f"{op}: {name} must be {dims}-D {layout}, got shape {tuple(t.shape)}")


def _index_tensor(op: str, name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected {dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}; expected {tuple(shape)}")
    checks.dense(op, name, t, device)


def _lengths(op: str, a, first: str, second: str, B: int, device) -> None:
    _index_tensor(op, first, getattr(a, first), torch.int32, (B,), device)
    _index_tensor(op, second, getattr(a, second), torch.int32, (B,), device)
    if a.batch_offset is not None:
        _index_tensor(op, "batch_offset", a.batch_offset, torch.int64, (B,), device)


def _non_negative(op: str, name: str, value) -> None:
    if value < 0:
        raise ValueError(f"{op}: {name} must be >= 0, got {value}")


def _check_joint_forward(a) -> None:
    op, f, g = a.op, a.f, a.g
    _float_tensor(op, "f", f, f.device)
    _dims(op, "f", f, 3, "[B, T, H]")
    _float_tensor(op, "g", g, f.device)
    _dims(op, "g", g, 3, "[B, U, H]")
    if g.dtype != f.dtype:
        raise TypeError(f"{op}: g has dtype {g.dtype} but f has {f.dtype}")
    if g.shape[0] != f.shape[0] or g.shape[2] != f.shape[2]:
        raise ValueError(
            f"{op}: g has shape {tuple(g.shape)}; expected [{f.shape[0]}, U, {f.shape[2]}] "
            f"for f of shape {tuple(f.shape)}"
        )
    _lengths(op, a, "f_len", "g_len", f.shape[0], f.device)
    _non_negative(op, "packed_batch", a.packed_batch)
    if not (0.0 <= a.dropout_prob <= 1.0):
        raise ValueError(f"{op}: dropout_prob must lie in [0, 1], got {a.dropout_prob}")
    if a.seed is not None:
        _index_tensor(op, "seed", a.seed, torch.int64, (1,), f.device)


def _check_joint_backward(a) -> None:
    op, grad = a.op, a.grad
    _float_tensor(op, "grad", grad, grad.device)
    packed = a.batch_offset is not None
    if packed:
        _dims(op, "grad", grad, 2, "[rows, H] (packed)")
    else:
        _dims(op, "grad", grad, 4, "[B, T, U, H]")
    B = a.f_len.shape[0] if isinstance(a.f_len, torch.Tensor) and a.f_len.dim() == 1 else -1
    _lengths(op, a, "f_len", "g_len", B, grad.device)
    _non_negative(op, "max_f_len", a.max_f_len)
    _non_negative(op, "max_g_len", a.max_g_len)
    if not packed and tuple(grad.shape[:3]) != (B, a.max_f_len, a.max_g_len):
        raise ValueError(
            f"{op}: grad has shape {tuple(grad.shape)}; "
            f"expected [{B}, max_f_len={a.max_f_len}, max_g_len={a.max_g_len}, H]"
        )
    if a.mask is not None:
        if a.mask.dtype != torch.uint8:
            raise TypeError(f"{op}: mask has dtype {a.mask.dtype}; expected torch.uint8")
        if a.mask.shape != grad.shape:
            raise ValueError(f"{op}: mask has shape {tuple(a.mask.shape)} but grad has {tuple(grad.shape)}")
        checks.dense(op, "mask", a.mask, grad.device)
    if not math.isfinite(a.scale):
        raise ValueError(f"{op}: scale must be finite, got {a.scale}")


def _check_loss_input(op: str, a, x: torch.Tensor, max_f_len) -> int:
    """Checks x, label, the lengths and offsets and blank_idx; returns U."""
    _float_tensor(op, "x", x, x.device)
    label = a.label
    if not isinstance(label, torch.Tensor) or label.dtype != torch.int32:
        raise TypeError(f"{op}: label has dtype {getattr(label, 'dtype', type(label).__name__)}; expected torch.int32")
    _dims(op, "label", label, 2, "[B, max label length]")
    checks.dense(op, "label", label, x.device)
    B, U = label.shape[0], label.shape[1] + 1
    if a.batch_offset is not None:
        _dims(op, "x", x, 2, "[rows, V] (packed)")
    else:
        _dims(op, "x", x, 4, "[B, T, U, V]")
        if tuple(x.shape[:3]) != (B, max_f_len, U):
            raise ValueError(
                f"{op}: x has shape {tuple(x.shape)}; "
                f"expected [B={B}, max_f_len={max_f_len}, U={U} (label length + 1), V]"
            )
    _lengths(op, a, "f_len", "y_len", B, x.device)
    V = x.shape[-1]
    if not (0 <= a.blank_idx < V):
        raise ValueError(f"{op}: blank_idx must lie in [0, {V - 1}], got {a.blank_idx}")
    return U


def _check_loss_forward(a) -> None:
    _non_negative(a.op, "max_f_len", a.max_f_len)
    _check_loss_input(a.op, a, a.x, a.max_f_len)


def _check_loss_backward(a) -> None:
    op, x = a.op, a.x
    _float_tensor(op, "alpha", a.alpha, x.device)
    _dims(op, "alpha", a.alpha, 3, "[B, max_f_len, U]")
    U = _check_loss_input(op, a, x, a.alpha.shape[1])
    compute = _reference.compute_dtype(x.dtype)
    B = a.label.shape[0]
    expected = (B, a.alpha.shape[1], U)
    for name in ("alpha", "beta"):
        t = getattr(a, name)
        _float_tensor(op, name, t, x.device)
        if t.dtype != compute:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected {compute} for x of dtype {x.dtype}")
        if tuple(t.shape) != expected:
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}; expected {expected}")
    _float_tensor(op, "loss_grad", a.loss_grad, x.device)
    if a.loss_grad.dtype != x.dtype:
        raise TypeError(f"{op}: loss_grad has dtype {a.loss_grad.dtype} but x has {x.dtype}")
    if a.loss_grad.shape != (B,):
        raise ValueError(f"{op}: loss_grad has shape {tuple(a.loss_grad.shape)}; expected ({B},)")
    if a.lse is not None:
        if not a.fuse_softmax:
            raise ValueError(f"{op}: lse is only used with fuse_softmax (the gradient w.r.t. the logits)")
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        _index_tensor(op, "lse", a.lse, compute, (rows,), x.device)


# ops -------------------------------------------------------------------------------------------


def _joint_forward_fake(a):
    B, T, H = a.f.shape
    U = a.g.shape[1]
    shape = (a.packed_batch, H) if a.batch_offset is not None else (B, T, U, H)
    out = a.f.new_empty(shape)
    mask = a.f.new_empty(shape if a.relu or a.seed is not None else (0,), dtype=torch.uint8)
    return out, mask


@op(
    KERNELS,
    "joint_forward(Tensor f, Tensor g, Tensor f_len, Tensor g_len, Tensor? batch_offset=None, SymInt packed_batch=0, "
    "bool relu=False, float dropout_prob=0.0, Tensor? seed=None) -> (Tensor, Tensor)",
    check=_check_joint_forward,
    fake=_joint_forward_fake,
)
def joint_forward(a):
    return _reference.joint_forward(
        a.op, a.f, a.g, a.f_len, a.g_len, a.batch_offset, a.packed_batch, a.relu, a.dropout_prob, a.seed
    )


def _joint_backward_fake(a):
    B = a.f_len.shape[0]
    H = a.grad.shape[-1]
    return a.grad.new_empty((B, a.max_f_len, H)), a.grad.new_empty((B, a.max_g_len, H))


@op(
    KERNELS,
    "joint_backward(Tensor grad, Tensor? mask, Tensor f_len, Tensor g_len, Tensor? batch_offset, SymInt max_f_len, "
    "SymInt max_g_len, float scale=1.0) -> (Tensor, Tensor)",
    check=_check_joint_backward,
    fake=_joint_backward_fake,
)
def joint_backward(a):
    return _reference.joint_backward(
        a.op, a.grad, a.mask, a.f_len, a.g_len, a.batch_offset, a.max_f_len, a.max_g_len, a.scale
    )


def _loss_forward_fake(a):
    x = a.x
    B, U = a.label.shape[0], a.label.shape[1] + 1
    compute = _reference.compute_dtype(x.dtype)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    alpha = x.new_empty((B, a.max_f_len, U), dtype=compute)
    beta = x.new_empty((B, a.max_f_len, U), dtype=compute)
    lse = x.new_empty((rows,) if a.normalize else (0,), dtype=compute)
    return alpha, beta, x.new_empty((B,)), lse


@op(
    KERNELS,
    "loss_forward(Tensor x, Tensor label, Tensor f_len, Tensor y_len, Tensor? batch_offset, SymInt max_f_len, "
    "int blank_idx, bool normalize=False) -> (Tensor, Tensor, Tensor, Tensor)",
    check=_check_loss_forward,
    fake=_loss_forward_fake,
)
def loss_forward(a):
    return _reference.loss_forward(
        a.op, a.x, a.label, a.f_len, a.y_len, a.batch_offset, a.max_f_len, a.blank_idx, a.normalize
    )


def _loss_backward_fake(a):
    return torch.empty_like(a.x, memory_format=torch.contiguous_format)


@op(
    KERNELS,
    "loss_backward(Tensor x, Tensor loss_grad, Tensor alpha, Tensor beta, Tensor? lse, Tensor label, Tensor f_len, "
    "Tensor y_len, Tensor? batch_offset, int blank_idx, bool fuse_softmax=True) -> Tensor",
    check=_check_loss_backward,
    fake=_loss_backward_fake,
)
def loss_backward(a):
    return _reference.loss_backward(
        a.op,
        a.x,
        a.loss_grad,
        a.alpha,
        a.beta,
        a.lse,
        a.label,
        a.f_len,
        a.y_len,
        a.batch_offset,
        a.blank_idx,
        a.fuse_softmax,
    )


# autograd --------------------------------------------------------------------------------------


def _joint_setup_context(ctx, inputs, output):
    f, g, f_len, g_len, batch_offset, _, relu, dropout_prob, seed = inputs
    _, mask = output
    masked = relu or seed is not None
    ctx.mark_non_differentiable(mask)
    ctx.save_for_backward(mask if masked else None, f_len, g_len, batch_offset)
    ctx.max_lens = (f.shape[1], g.shape[1])
    ctx.scale = _reference.dropout_scale(dropout_prob) if seed is not None else 1.0


def _joint_backward(ctx, grad, _grad_mask):
    mask, f_len, g_len, batch_offset = ctx.saved_tensors
    f_grad, g_grad = joint_backward(grad.contiguous(), mask, f_len, g_len, batch_offset, *ctx.max_lens, ctx.scale)
    return f_grad, g_grad, None, None, None, None, None, None, None


joint = autograd(joint_forward, _joint_setup_context, _joint_backward, "TransducerJoint")
"""Differentiable ``joint(f, g, f_len, g_len, batch_offset, packed_batch, relu, dropout_prob, seed)
-> (out, mask)`` (gradients for f and g)."""


def _loss_setup_context(ctx, inputs, output):
    x, label, f_len, y_len, batch_offset, _, blank_idx, normalize = inputs
    alpha, beta, _, lse = output
    ctx.mark_non_differentiable(alpha, beta, lse)
    ctx.save_for_backward(x, alpha, beta, lse if normalize else None, label, f_len, y_len, batch_offset)
    ctx.blank_idx = blank_idx
    ctx.normalize = normalize


def _loss_backward(ctx, _grad_alpha, _grad_beta, grad_loss, _grad_lse):
    x, alpha, beta, lse, label, f_len, y_len, batch_offset = ctx.saved_tensors
    # Normalised inside: the gradient w.r.t. the logits. Log-probabilities in: w.r.t. them (autograd
    # carries it through whatever produced them, as upstream's fuse_softmax_backward=False does).
    x_grad = loss_backward(
        x, grad_loss.contiguous(), alpha, beta, lse, label, f_len, y_len, batch_offset, ctx.blank_idx, ctx.normalize
    )
    return x_grad, None, None, None, None, None, None, None


loss = autograd(loss_forward, _loss_setup_context, _loss_backward, "TransducerLoss")
"""Differentiable ``loss(x, label, f_len, y_len, batch_offset, max_f_len, blank_idx, normalize)
-> (alpha, beta, loss, lse)`` (the gradient for x)."""
