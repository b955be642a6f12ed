"""apex_contrib_xentropy's dispatcher ops: schemas, checks, references, fakes, and their autograd.

Softmax cross entropy with label smoothing, one loss per row of ``logits [tokens, vocab]``:

    lse  = log(sum_j exp(x_j))
    loss = lse - (1 - s) * x[label] - s * mean_j(x_j)          (the s-term only when s != 0)
    dx   = g * (exp(x - lse) - (1 - s) * onehot(label) - s / vocab)

- ``softmax_cross_entropy_forward(logits, labels, smoothing=0.0, padding_idx=None,
  half_to_float=False) -> (losses, lse)``: ``losses`` in ``logits``' dtype, or float32 with
  ``half_to_float``; ``lse`` (the per-row logsumexp, all the backward needs besides the logits)
  always float32.
- ``softmax_cross_entropy_backward(grad_losses, logits, lse, labels, smoothing=0.0,
  padding_idx=None) -> grad_logits`` and ``softmax_cross_entropy_backward_`` (the same, written
  over ``logits``). ``grad_losses`` is float32 or ``logits``' dtype.

Rows whose label equals ``padding_idx`` (None: no padding) have loss 0, lse 0 and gradient 0, and
their logits are not read. Any other label outside ``[0, vocab)`` is an error: the references
(the CPU path) raise ValueError naming it; the CUDA kernels, which cannot raise without a host
sync, never read out of bounds and instead make that row's loss and lse NaN and its gradient
row NaN, so the bad label shows up in the loss.

Conventions: ``logits`` float32, float16 or bfloat16 with at least one column, its rows each
contiguous at any row stride (a view of a wider tensor's first columns, as Inductor's padded
matmuls give, is read in place; the gradient is contiguous);
``labels`` contiguous int64 of shape ``[tokens]``; ``smoothing`` in ``[0, 1]``. Every reduction
is computed in float32 and each output rounded once. The checks below and the CUDA kernels'
(``csrc/xentropy.cu``) make the same checks with the same words.
"""

from __future__ import annotations

import torch

from apex.contrib.xentropy._plugin import KERNELS
from apex.core import checks
from apex.core.library import autograd, op

# checks -----------------------------------------------------------------------------------------


def _check_logits(op: str, logits: torch.Tensor) -> None:
    if logits.dtype not in checks.FLOAT_DTYPES:
        raise TypeError(f"{op}: logits has dtype {logits.dtype}; expected one of float32, float16, bfloat16")
    if logits.dim() != 2:
        raise ValueError(f"{op}: logits must be 2-D [tokens, vocab], got shape {tuple(logits.shape)}")
    if logits.shape[1] == 0:
        raise ValueError(f"{op}: logits must have at least one column (class), got shape {tuple(logits.shape)}")
    checks.rows(op, "logits", logits, logits.device)


def _check_per_row(op: str, name: str, t: torch.Tensor, logits: torch.Tensor) -> None:
    if t.dim() != 1 or t.shape[0] != logits.shape[0]:
        raise ValueError(
            f"{op}: {name} has shape {tuple(t.shape)}; expected ({logits.shape[0]},) "
            f"for logits of shape {tuple(logits.shape)}"
        )
    checks.dense(op, name, t, logits.device)


def _check_labels(op: str, labels: torch.Tensor, logits: torch.Tensor) -> None:
    if labels.dtype != torch.int64:
        raise TypeError(f"{op}: labels has dtype {labels.dtype}; expected torch.int64")
    _check_per_row(op, "labels", labels, logits)


def _check_smoothing(op: str, smoothing: float) -> None:
    if not 0.0 <= smoothing <= 1.0:  # false for NaN too
        raise ValueError(f"{op}: smoothing must be in [0, 1], got {smoothing}")


def _check_forward(a) -> None:
    _check_logits(a.op, a.logits)
    _check_labels(a.op, a.labels, a.logits)
    _check_smoothing(a.op, a.smoothing)


def _check_backward(a) -> None:
    op, logits = a.op, a.logits
    _check_logits(op, logits)
    _check_labels(op, a.labels, logits)
    if a.grad_losses.dtype not in (torch.float32, logits.dtype):
        expected = "torch.float32" if logits.dtype == torch.float32 else f"torch.float32 or {logits.dtype}"
        raise TypeError(f"{op}: grad_losses has dtype {a.grad_losses.dtype}; expected {expected}")
    _check_per_row(op, "grad_losses", a.grad_losses, logits)
    if a.lse.dtype != torch.float32:
        raise TypeError(f"{op}: lse has dtype {a.lse.dtype}; expected torch.float32")
    _check_per_row(op, "lse", a.lse, logits)
    _check_smoothing(op, a.smoothing)


# references -------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for every storage dtype; float64 stays float64 (tests call the references with it)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def padding_rows(labels: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
    """True at the rows whose label is ``padding_idx`` (none when it is None)."""
    if padding_idx is None:
        return torch.zeros_like(labels, dtype=torch.bool)
    return labels == padding_idx


def _safe_labels(op: str, labels: torch.Tensor, vocab: int, padding_idx: int | None, padded: torch.Tensor):
    """The labels with padding rows' replaced by 0 (a column every row has); raises on any other
    label outside ``[0, vocab)``."""
    bad = ((labels < 0) | (labels >= vocab)) & ~padded
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        not_padding = "" if padding_idx is None else f" and is not padding_idx ({padding_idx})"
        raise ValueError(f"{op}: labels[{i}] = {int(labels[i])} is out of range [0, {vocab}){not_padding}")
    return labels.masked_fill(padded, 0)


# exp(x) as exp2(x log2(e)), as the kernels: torch's CPU exp2 takes half the time of its exp, and the
# product's rounding moves exp(x) by at most |x| 2^-24 relative (1e-6 where x > -16).
_LOG2E = 1.4426950408889634


def reference_forward(logits, labels, smoothing, padding_idx, half_to_float, op="softmax_cross_entropy_forward"):
    """The math of ``softmax_cross_entropy_forward`` in PyTorch: ``(losses, lse)``.

    Written for the CPU, where it is the path: 16-bit logits are read in place (no float32 copy), one
    float32 temporary of exponentials, in-place ops."""
    compute = _compute_dtype(logits.dtype)
    padded = padding_rows(labels, padding_idx)
    target = _safe_labels(op, labels, logits.shape[1], padding_idx, padded)
    # logsumexp as torch's: the row max shifted out, unless infinite (a row of -inf gives -inf, an inf gives inf)
    shift = logits.amax(dim=1, keepdim=True).to(compute)
    shift.masked_fill_(shift.isinf(), 0.0)
    exp = torch.sub(logits, shift)  # in the compute dtype, promoted from 16-bit logits
    mean = exp.mean(dim=1).add_(shift.squeeze(1)) if smoothing != 0.0 else None
    lse = exp.mul_(_LOG2E).exp2_().sum(dim=1).log_().add_(shift.squeeze(1))
    del exp
    picked = logits.gather(1, target.unsqueeze(1)).squeeze(1).to(compute)
    losses = lse - (1.0 - smoothing) * picked
    if mean is not None:
        losses.sub_(smoothing * mean)
    losses.masked_fill_(padded, 0.0)
    lse.masked_fill_(padded, 0.0)
    losses_dtype = torch.float32 if half_to_float and logits.dtype != torch.float64 else logits.dtype
    return losses.to(losses_dtype), lse


def reference_backward(grad_losses, logits, lse, labels, smoothing, padding_idx, op="softmax_cross_entropy_backward"):
    """The math of ``softmax_cross_entropy_backward`` in PyTorch, in ``logits``' dtype.

    With ``lse=None`` the logsumexp is recomputed from ``logits``: the result is then a
    differentiable function of ``logits`` and ``grad_losses`` (double backward). With ``lse``
    (the op's path) it takes three passes over a float32 temporary, in place."""
    compute = _compute_dtype(logits.dtype)
    vocab = logits.shape[1]
    padded = padding_rows(labels, padding_idx)
    target = _safe_labels(op, labels, vocab, padding_idx, padded).unsqueeze(1)
    g = grad_losses.to(compute).unsqueeze(1)
    if lse is None:
        x = logits.to(compute)
        probs = torch.softmax(x, dim=1)
        if smoothing != 0.0:
            probs = probs - smoothing / vocab
        grad = probs.scatter_add(1, target, g.new_full(g.shape, smoothing - 1.0)) * g
        # where, not a product with a mask: a padding row's lse is 0, so its exp may be inf
        return torch.where(padded.unsqueeze(1), 0.0, grad).to(logits.dtype)
    grad = torch.sub(logits, lse.to(compute).unsqueeze(1)).mul_(_LOG2E).exp2_()  # the softmax, in float32
    grad.mul_(g)  # g * (p - s / V); not addcmul, whose broadcast CPU loop is 5x slower than these two
    if smoothing != 0.0:
        grad.sub_(g * (smoothing / vocab))
    grad.scatter_add_(1, target, g * (smoothing - 1.0))
    # zeroed, not masked through g: a padding row's lse is 0, so its exp may be inf (and its logits are not read)
    rows = padded.nonzero().squeeze(1)
    if rows.numel():
        grad.index_fill_(0, rows, 0.0)
    return grad.to(logits.dtype)


def traced_backward(grad_losses, logits, lse, labels, smoothing, padding_idx):
    """The math of ``softmax_cross_entropy_backward`` as pointwise torch ops for a traced backward:
    no host sync and no in-place op, so that a compiler fuses it into one pass (the labels were
    checked by the forward op)."""
    compute = _compute_dtype(logits.dtype)
    vocab = logits.shape[1]
    g = grad_losses.to(compute).unsqueeze(1)
    probs = torch.exp(logits.to(compute) - lse.to(compute).unsqueeze(1))
    target = torch.arange(vocab, device=logits.device) == labels.unsqueeze(1)
    grad = g * (probs - smoothing / vocab + torch.where(target, smoothing - 1.0, 0.0))
    # where, not a product with a mask: a padding row's lse is 0, so its exp may be inf
    return torch.where(padding_rows(labels, padding_idx).unsqueeze(1), 0.0, grad).to(logits.dtype)


# ops --------------------------------------------------------------------------------------------


def _forward_fake(a):
    tokens = a.logits.shape[0]
    losses_dtype = torch.float32 if a.half_to_float else a.logits.dtype
    losses = a.logits.new_empty((tokens,), dtype=losses_dtype)
    return losses, a.logits.new_empty((tokens,), dtype=torch.float32)


def _backward_fake(a):
    return torch.empty_like(a.logits, memory_format=torch.contiguous_format)


@op(
    KERNELS,
    "softmax_cross_entropy_forward(Tensor logits, Tensor labels, float smoothing=0.0, int? padding_idx=None, "
    "bool half_to_float=False) -> (Tensor, Tensor)",
    check=_check_forward,
    fake=_forward_fake,
)
def softmax_cross_entropy_forward(a):
    losses, lse = reference_forward(a.logits, a.labels, a.smoothing, a.padding_idx, a.half_to_float, a.op)
    return losses.contiguous(), lse.contiguous()


@op(
    KERNELS,
    "softmax_cross_entropy_backward(Tensor grad_losses, Tensor logits, Tensor lse, Tensor labels, "
    "float smoothing=0.0, int? padding_idx=None) -> Tensor",
    check=_check_backward,
    fake=_backward_fake,
)
def softmax_cross_entropy_backward(a):
    return reference_backward(a.grad_losses, a.logits, a.lse, a.labels, a.smoothing, a.padding_idx, a.op).contiguous()


@op(
    KERNELS,
    "softmax_cross_entropy_backward_(Tensor grad_losses, Tensor(a!) logits, Tensor lse, Tensor labels, "
    "float smoothing=0.0, int? padding_idx=None) -> ()",
    check=_check_backward,
)
def softmax_cross_entropy_backward_(a):
    a.logits.copy_(reference_backward(a.grad_losses, a.logits, a.lse, a.labels, a.smoothing, a.padding_idx, a.op))


# autograd ---------------------------------------------------------------------------------------
# The forward saves the logits, the labels and the per-row lse: no softmax, no float32 copy.


def _forward(logits, labels, smoothing, padding_idx, half_to_float, inplace_backward):
    return softmax_cross_entropy_forward(logits, labels, smoothing, padding_idx, half_to_float)


def _setup_context(ctx, inputs, output):
    logits, labels, smoothing, padding_idx, _, inplace_backward = inputs
    _, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(logits, labels, lse)
    ctx.smoothing = smoothing
    ctx.padding_idx = padding_idx
    ctx.inplace_backward = inplace_backward


def _backward(ctx, grad_losses, _grad_lse):
    logits, labels, lse = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: differentiable torch ops (double backward)
        grad_logits = reference_backward(grad_losses, logits, None, labels, ctx.smoothing, ctx.padding_idx)
    elif torch.compiler.is_compiling():
        # Traced (torch.compile; Dynamo traces this backward itself): the formula as pointwise torch ops,
        # which Inductor fuses into one kernel that may write over the saved logits once they are dead.
        # Our out-of-place op there allocated a second [tokens, vocab] tensor (GPT-2's apex compiled
        # step, H100: peak 8.67 GiB against eager's 7.24); the in-place op was functionalized into a copy
        # of the logits first (1.09 ms a step), and Inductor on CUDA (torch 2.11) gave a gradient 22%
        # wrong where the logits were a row-strided view of its padded matmul.
        grad_logits = traced_backward(grad_losses, logits, lse, labels, ctx.smoothing, ctx.padding_idx)
    else:
        grad_losses = grad_losses.contiguous()
        if grad_losses.dtype not in (torch.float32, logits.dtype):
            grad_losses = grad_losses.float()
        if ctx.inplace_backward and type(logits) is torch.Tensor:
            softmax_cross_entropy_backward_(grad_losses, logits, lse, labels, ctx.smoothing, ctx.padding_idx)
            # A CUDA kernel's write is invisible to autograd: mark it, so that any later use of
            # the saved logits (a second backward, another node that saved them) raises.
            torch.autograd.graph.increment_version(logits)
            grad_logits = logits
        else:
            grad_logits = softmax_cross_entropy_backward(
                grad_losses, logits, lse, labels, ctx.smoothing, ctx.padding_idx
            )
    return grad_logits, None, None, None, None, None


softmax_cross_entropy = autograd(_forward, _setup_context, _backward, "SoftmaxCrossEntropy")
"""Differentiable ``softmax_cross_entropy(logits, labels, smoothing, padding_idx, half_to_float,
inplace_backward) -> (losses, lse)``; ``lse`` is not differentiable."""
