"""Upstream Apex's ``xentropy_cuda`` extension module, on apex-contrib-xentropy's ops.

- ``forward(logits, labels, smoothing, half_to_float) -> [losses, max_log_sum_exp]``: per-row
  label-smoothed cross entropy of ``logits [tokens, vocab]`` and int64 ``labels [tokens]``, and
  the per-row logsumexp that ``backward`` needs. No row is ignored (upstream's Python class masks
  its padding rows afterwards).
- ``backward(grad_loss, logits, max_log_sum_exp, labels, smoothing) -> grad_logits``: a new
  tensor in ``logits``' dtype.

Runs on the CPU too (the PyTorch reference). Differences from upstream: ``losses`` is float32
with ``half_to_float`` and in ``logits``' dtype without it (upstream's current kernel always
returns float32); ``max_log_sum_exp`` is always float32 (upstream: ``logits``' dtype without
``half_to_float``, which loses most of the precision of a 16-bit softmax), and ``backward`` takes
it in any float dtype; a label outside ``[0, vocab)`` raises ValueError on the CPU and gives a NaN
loss on CUDA (upstream reads out of bounds).
"""

from __future__ import annotations

import torch

from apex.contrib.xentropy import _ops  # noqa: F401  (registers the ops)
from apex.core import __version__

__all__ = ["__version__", "backward", "forward"]

_OPS = torch.ops.apex_contrib_xentropy


def forward(logits, labels, smoothing, half_to_float):
    losses, max_log_sum_exp = _OPS.softmax_cross_entropy_forward(
        logits.contiguous(), labels.contiguous(), float(smoothing), None, bool(half_to_float)
    )
    return [losses, max_log_sum_exp]


def backward(grad_loss, logits, max_log_sum_exp, labels, smoothing):
    grad = grad_loss.contiguous().reshape(-1)  # upstream takes a 0-d grad_loss for one row
    if grad.dtype not in (torch.float32, logits.dtype):
        grad = grad.float()
    return _OPS.softmax_cross_entropy_backward(
        grad, logits.contiguous(), max_log_sum_exp.float().contiguous(), labels.contiguous(), float(smoothing), None
    )
