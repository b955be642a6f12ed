"""Upstream's test oracles ``transducer_joint_reference`` and ``transducer_loss_reference`` (upstream
ships them as ``apex.contrib.transducer._transducer_ref``; its tests import them from there), in
plain PyTorch autograd. Same arguments and returns as upstream's; gradients accumulate into the
inputs' ``.grad`` as there (the inputs must be leaves that require grad)."""

from __future__ import annotations

import torch

from apex.contrib.transducer import _reference


def transducer_joint_reference(f, g, h_grad, f_len, g_len, pack_output, relu, dropout, dropout_prob=0, mask=None):
    """``(h, f.grad, g.grad)``: ``h = f[:, :, None] + g[:, None]``, then ReLU and dropout with the given
    ``mask``; the backward of ``h_grad`` over the whole padded ``h``, as upstream's oracle. ``h`` is
    -1 outside the lengths, or with ``pack_output`` only the valid rows."""
    if dropout and mask is None:
        raise NotImplementedError("mask needs to be supplied to test dropout.")
    h = f.unsqueeze(2) + g.unsqueeze(1)
    if relu:
        h = torch.nn.functional.relu(h)
    if dropout:
        h = h * mask * (1 / (1 - dropout_prob))
    h.backward(h_grad)
    h = h.detach()
    valid = _reference.valid_rows(f_len, g_len, f.shape[1], g.shape[1])
    if pack_output:
        return h[valid], f.grad, g.grad
    return h.masked_fill(~valid[..., None], -1), f.grad, g.grad


def transducer_loss_reference(x, label, f_len, y_len, blank_idx, loss_grad):
    """``(alpha, beta, x.grad, loss)`` for logits ``x [B, T, U, V]`` (log-softmax applied here):
    alpha and beta ``[B, T, U]`` float32 (float64 for float64 x), 0 outside the lattice; the loss in
    x's dtype; ``x.grad`` the gradient of ``sum(loss_grad * loss)``."""
    op = "transducer_loss_reference"
    with torch.no_grad():
        label, f_len, y_len = (t.to(torch.int32) for t in (label, f_len, y_len))
        alpha, beta, loss, lse = _reference.loss_forward(
            op, x, label, f_len, y_len, None, x.shape[1], blank_idx, normalize=True
        )
        grad = _reference.loss_backward(
            op, x, loss_grad.to(x.dtype), alpha, beta, lse, label, f_len, y_len, None, blank_idx, True
        )
    x.backward(grad)
    return alpha, beta, x.grad, loss
