"""Upstream Apex's ``distributed_adam_cuda`` extension module, on apex-contrib-optimizers' ops.

Each function takes upstream's arguments in upstream's order and updates the tensors in place:

- ``multi_tensor_fused_adam(chunk_size, noop_flag, tensor_lists, grad_scale, lr, beta1, beta2, eps,
  step, mode, bias_correction, weight_decay)``: ``tensor_lists = [p_in, m, v, g, p_out]``; Adam on
  ``p_in`` (the state dtype, fp32/fp16/bf16, as ``m`` and ``v``), the result also written to ``p_out``;
- ``multi_tensor_fused_adam_capturable(...)``: the same with ``lr`` and ``step`` one-element fp32
  tensors on the device;
- ``multi_tensor_fused_adam_with_param_remainders(...)``: ``tensor_lists = [p_in, p_rem, m, v, g,
  p_out]``: bf16 ``p_in`` plus int16 remainders ``p_rem`` are the fp32 master values; fp32 ``m``,
  ``v``, ``g``; the new remainders go to ``p_rem`` and the new bf16 values to ``p_out``.

``grad_scale`` multiplies the gradients; ``mode`` 0 is L2 regularisation, 1 decoupled weight decay;
``bias_correction`` is 0 or 1. CUDA kernels on GPUs; runs on the CPU too (the PyTorch references).
Differences from upstream: the functions skip the update when ``noop_flag`` is non-zero (upstream's non-capturable
kernels ignore it; its callers pass zero); ``g`` may be of any float dtype (upstream: ``p_in``'s).
"""

from __future__ import annotations

import torch

from apex.contrib.optimizers import _distributed_adam_ops  # noqa: F401  (registers the ops)
from apex.core import __version__

__all__ = [
    "__version__",
    "multi_tensor_fused_adam",
    "multi_tensor_fused_adam_capturable",
    "multi_tensor_fused_adam_with_param_remainders",
]

_OPS = torch.ops.apex_contrib_optimizers


def _lists(tensor_lists, count: int, name: str):
    if len(tensor_lists) != count:
        raise ValueError(f"{name}: expected {count} tensor lists, got {len(tensor_lists)}")
    return [list(t) for t in tensor_lists]


def multi_tensor_fused_adam(
    chunk_size, noop_flag, tensor_lists, grad_scale, lr, beta1, beta2, eps, step, mode, bias_correction, weight_decay
):
    p_in, m, v, g, p_out = _lists(tensor_lists, 5, "multi_tensor_fused_adam")
    _OPS.distributed_adam(
        int(chunk_size), noop_flag, p_in, m, v, g, p_out, grad_scale, float(lr), float(beta1), float(beta2),
        float(eps), int(step), int(mode), bool(bias_correction), float(weight_decay),
    )  # fmt: skip


def multi_tensor_fused_adam_capturable(
    chunk_size, noop_flag, tensor_lists, grad_scale, lr, beta1, beta2, eps, step, mode, bias_correction, weight_decay
):
    p_in, m, v, g, p_out = _lists(tensor_lists, 5, "multi_tensor_fused_adam_capturable")
    lr_tensor = lr.float().reshape(1) if isinstance(lr, torch.Tensor) else None
    step_tensor = step.float().reshape(1) if isinstance(step, torch.Tensor) else None
    _OPS.distributed_adam(
        int(chunk_size), noop_flag, p_in, m, v, g, p_out, grad_scale,
        0.0 if lr_tensor is not None else float(lr), float(beta1), float(beta2), float(eps),
        0 if step_tensor is not None else int(step), int(mode), bool(bias_correction), float(weight_decay),
        lr_tensor, step_tensor,
    )  # fmt: skip


def multi_tensor_fused_adam_with_param_remainders(
    chunk_size, noop_flag, tensor_lists, grad_scale, lr, beta1, beta2, eps, step, mode, bias_correction, weight_decay
):
    p_in, p_rem, m, v, g, p_out = _lists(tensor_lists, 6, "multi_tensor_fused_adam_with_param_remainders")
    _OPS.distributed_adam_with_param_remainders(
        int(chunk_size), noop_flag, p_in, p_rem, m, v, g, p_out, grad_scale, float(lr), float(beta1),
        float(beta2), float(eps), int(step), int(mode), bool(bias_correction), float(weight_decay),
    )  # fmt: skip
