"""Upstream Apex's ``fast_layer_norm`` extension module, on apex-normalization's layer norm ops.

Code written against upstream (its ``apex.contrib.layer_norm`` and projects calling the kernels
directly) imports this module by that name. The functions keep upstream's names, argument orders
and returns, and call ``torch.ops.apex_normalization``, so they also run on the CPU (through the
PyTorch references):

- ``ln_fwd(x, gamma, beta, epsilon) -> [z, mu, rsigma]``: x is (rows, hidden_size), gamma and beta
  have hidden_size elements and one dtype; z has gamma's dtype, mu and rsigma (``1 / sqrt(var +
  epsilon)``) are float32 of shape (rows,);
- ``ln_bwd(dz, x_or_z, mu, rsigma, gamma, beta=None, memory_efficient=False) -> [dx, dgamma,
  dbeta, dgamma_part, dbeta_part]``: ``x_or_z`` is the forward's input, or with
  ``memory_efficient`` its output z (then beta is needed and mu may be None); dz has gamma's dtype;
  dx has x_or_z's dtype, dgamma and dbeta gamma's.

Differences from upstream: every hidden size works (upstream's kernels were compiled for 768,
1024, ..., 65536 only); float16/bfloat16 x with float32 gamma (a float32 z) and float64 are
accepted too; non-contiguous tensors are made contiguous instead of refused; bad arguments raise
errors that name them. ``dgamma_part`` and ``dbeta_part`` were upstream's per-block partial sums
(float32, ``(blocks, hidden_size)``); here they are one block's worth, ``(1, hidden_size)``
float32 copies of dgamma and dbeta, so that summing them over dimension 0 still gives the
gradients.
"""

from __future__ import annotations

import torch

from apex.contrib.layer_norm import layer_norm as _layer_norm


def ln_fwd(x, gamma, beta, epsilon):
    _layer_norm.check_forward("ln_fwd", x, gamma, beta, epsilon, True)
    return list(_layer_norm.forward(x, gamma, beta, float(epsilon)))


def ln_bwd(dz, x_or_z, mu, rsigma, gamma, beta=None, memory_efficient=False):
    memory_efficient = bool(memory_efficient)
    _layer_norm.check_backward("ln_bwd", dz, x_or_z, mu, rsigma, gamma, beta, memory_efficient)
    dx, dgamma, dbeta = _layer_norm.backward(dz, x_or_z, mu, rsigma, gamma, beta, memory_efficient, x_or_z.dtype)
    hidden = gamma.numel()
    parts = [g.to(torch.float32, copy=True).reshape(1, hidden) for g in (dgamma, dbeta)]
    return [dx, dgamma, dbeta, *parts]
