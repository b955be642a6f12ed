"""``SoftmaxCrossEntropyLoss``: upstream Apex's fused softmax cross entropy with label smoothing."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from apex.contrib.xentropy import _ops

_NAME = "SoftmaxCrossEntropyLoss"

# Off CUDA (unless inplace_backward) the loss is torch's: F.cross_entropy of the float32 logits. The op's
# reference is Python written to check the kernels; its op calls and autograd Function cost host time that
# torch's C++ does not: 64x1000 forward + backward on 1 CPU thread 0.41 ms through the op (after its faster
# reference), 0.24 now, F.cross_entropy 0.21 (benchmarks/NOTES.md). At 1024x32000 float32 the op's
# reference is the faster (252 ms, torch 350): see the notes. The tests set this False to run the op.
_TORCH_OFF_CUDA = True


class SoftmaxCrossEntropyLoss:
    r"""Per-row softmax cross entropy with label smoothing, fused into one pass over the logits
    forward and one backward (``torch.ops.apex_contrib_xentropy.softmax_cross_entropy_*``).

    Call it as upstream's ``autograd.Function``::

        losses = SoftmaxCrossEntropyLoss.apply(logits, labels, smoothing, padding_idx, half_to_float)

    For row ``i`` with ``x = logits[i]``, ``V`` columns and smoothing ``s``:

    .. math::
        \text{loss}_i = \log\sum_j e^{x_j} - (1 - s)\,x_{\text{label}_i} - \frac{s}{V}\sum_j x_j

    (``F.cross_entropy(logits.float(), labels, label_smoothing=s, reduction="none")``), with
    gradient ``g_i (softmax(x) - (1 - s) onehot(label_i) - s / V)``. Rows whose label is
    ``padding_idx`` get loss 0 and gradient 0. The forward keeps only the per-row logsumexp
    (float32) besides its inputs; the backward rebuilds the softmax from the logits. Reductions
    run in float32; no float32 copy of the logits is made. Rows of any length are supported (the
    CUDA kernels stream a row; no shared-memory limit).

    Args:
        logits: ``[tokens, vocab]`` float32, float16 or bfloat16 (made contiguous if it is not).
        labels: ``[tokens]`` int64 class indices on the same device.
        smoothing: label smoothing ``s`` in ``[0, 1]`` (default 0.0).
        padding_idx: the label of rows to ignore (default 0, upstream's default: rows of class
            0 are then ignored). ``None`` ignores no row.
        half_to_float: return float32 losses for 16-bit logits (default: losses in ``logits``'
            dtype). No effect for float32 logits (upstream rejects that combination).
        inplace_backward: write the gradient into ``logits``' own storage during backward instead
            of allocating a new ``[tokens, vocab]`` tensor (not in upstream). This saves one
            logits-sized allocation, which is what memory-bound LLM training wants, but it costs
            the caller the logits: after ``backward`` the tensor passed as ``logits`` holds the
            gradient, not the logits. Do not read it afterwards, do not let any other autograd node
            save it (the backward then raises "modified by an inplace operation"), and do not run
            backward through this loss twice (``retain_graph``). ``logits`` must not be a leaf
            that requires grad (its ``.grad`` would share its storage): pass the output of the LM
            head. Non-contiguous logits are copied first, so the copy is overwritten, not them.

    Off CUDA, unless ``inplace_backward``, this is ``F.cross_entropy`` of ``logits.float()`` (with
    ``ignore_index=padding_idx``), after the op's checks: the same math, several times faster on the CPU
    than the op's PyTorch reference (padding rows with non-finite logits are zeroed first, so that they
    keep loss 0 and gradient 0 as on the op's path).

    Labels outside ``[0, vocab)`` that are not ``padding_idx``: the CPU path (and any path
    through the PyTorch reference) raises ValueError naming the first; the CUDA kernels never read
    out of bounds but cannot raise without synchronizing, so that row's loss (and gradient) is
    NaN instead.

    Returns:
        ``losses [tokens]``: float32 with ``half_to_float``, else ``logits``' dtype. (Upstream's
        current kernel returns float32 in both cases, after which its backward misreads a
        16-bit logsumexp; the flag is followed here.)
    """

    @staticmethod
    def apply(
        logits: torch.Tensor,
        labels: torch.Tensor,
        smoothing: float = 0.0,
        padding_idx: int | None = 0,
        half_to_float: bool = False,
        inplace_backward: bool = False,
    ) -> torch.Tensor:
        if inplace_backward and logits.is_leaf and logits.requires_grad and logits.is_contiguous():
            raise ValueError(
                f"{_NAME}: inplace_backward writes the gradient into logits, which is a leaf that "
                "requires grad (its .grad would share its storage); pass a non-leaf (the LM head's output)"
            )
        if _TORCH_OFF_CUDA and not inplace_backward and not logits.is_cuda:
            return _torch_losses(logits.contiguous(), labels.contiguous(), float(smoothing), padding_idx, half_to_float)
        losses, _ = _ops.softmax_cross_entropy(
            logits.contiguous(), labels.contiguous(), float(smoothing), padding_idx, half_to_float, inplace_backward
        )
        return losses


def _torch_losses(logits, labels, smoothing, padding_idx, half_to_float):
    """The losses through ``F.cross_entropy``, after the forward op's checks (the same errors)."""
    op = "softmax_cross_entropy_forward"
    _ops._check_forward(SimpleNamespace(op=op, logits=logits, labels=labels, smoothing=smoothing))
    vocab = logits.shape[1]
    bounds = labels.aminmax() if labels.numel() else None  # all in [0, vocab): one pass, no more to check
    if bounds is not None and (int(bounds.min) < 0 or int(bounds.max) >= vocab):
        _ops._safe_labels(op, labels, vocab, padding_idx, _ops.padding_rows(labels, padding_idx))
    # With every label checked in [0, vocab), -100 ignores no row when padding_idx is None.
    ignore_index = -100 if padding_idx is None else padding_idx
    x = logits.float()
    if padding_idx is not None:
        # F.cross_entropy reads a padding row's logits: a non-finite one would give that row a NaN
        # gradient. The op's path gives it 0, so such rows are zeroed first (a check of those rows alone).
        pad = labels == padding_idx
        if bool(pad.any()) and not bool(torch.isfinite(logits[pad]).all()):
            x = x.masked_fill(pad.unsqueeze(1), 0.0)
    losses = F.cross_entropy(x, labels, label_smoothing=smoothing, ignore_index=ignore_index, reduction="none")
    return losses.to(torch.float32 if half_to_float else logits.dtype)
