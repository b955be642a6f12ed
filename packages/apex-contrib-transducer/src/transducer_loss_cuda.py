"""Upstream Apex's ``transducer_loss_cuda`` extension module, on apex-contrib-transducer's ops.

- ``forward(x, label, f_len, y_len, batch_offset, max_f_len, blank_idx, opt, packed_input) ->
  [alpha, beta, loss]``: x holds log-probabilities (upstream's caller applies ``log_softmax``),
  ``[B, T, U, V]`` or packed ``[rows, V]``; alpha and beta ``[B, max_f_len, U]`` float32 (float64
  for float64 x; 0 outside the valid lattice, where upstream leaves them unwritten), the loss
  ``[B]`` in x's dtype.
- ``backward(x, loss_grad, alpha, beta, f_len, y_len, label, batch_offset, max_f_len, blank_idx,
  opt, fuse_softmax_backward, packed_input) -> x_grad``: w.r.t. the logits that x is the
  log-softmax of with ``fuse_softmax_backward``, else w.r.t. x.

``batch_offset`` is read only with ``packed_input``. Runs on the CPU too and takes float32,
float16, bfloat16 and float64 (upstream: no bfloat16). ``opt`` is checked as upstream, then unused.
Unlike upstream's kernel, a ``loss_grad`` of 0 or below gives a finite gradient (upstream takes its log).
"""

from __future__ import annotations

from apex.contrib.transducer import _ops


def _check_opt(function: str, opt) -> None:
    if opt not in (-1, 0, 1):
        raise ValueError(f"transducer_loss_cuda.{function}: got an invalid optimization level {opt}")


def forward(x, label, f_len, y_len, batch_offset, max_f_len, blank_idx, opt, packed_input):
    _check_opt("forward", opt)
    alpha, beta, loss, _ = _ops.loss_forward(
        x, label, f_len, y_len, batch_offset if packed_input else None, max_f_len, blank_idx, False
    )
    return [alpha, beta, loss]


def backward(
    x,
    loss_grad,
    alpha,
    beta,
    f_len,
    y_len,
    label,
    batch_offset,
    max_f_len,
    blank_idx,
    opt,
    fuse_softmax_backward,
    packed_input,
):
    _check_opt("backward", opt)
    if alpha.shape[1] != max_f_len:
        raise ValueError(
            f"transducer_loss_cuda.backward: alpha has {alpha.shape[1]} time steps but max_f_len is {max_f_len}"
        )
    return _ops.loss_backward(
        x,
        loss_grad,
        alpha,
        beta,
        None,
        label,
        f_len,
        y_len,
        batch_offset if packed_input else None,
        blank_idx,
        fuse_softmax_backward,
    )
