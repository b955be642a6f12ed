"""Upstream Apex's deprecated ``fused_adam_cuda`` extension module, on apex-contrib-optimizers' ops.

Upstream's function names and argument orders; every tensor argument is updated in place:

- ``adam(p, p_copy, m, v, g, lr, beta1, beta2, eps, grad_scale, step, mode, bias_correction, decay)``:
  one tensor's Adam step (``torch.ops.apex_contrib_optimizers.adam``; ``mode`` 0 puts eps under the
  square root, 1 outside; the bias corrections go into the step size). ``p_copy`` (empty, or the
  size of ``p``) receives the new ``p`` in its dtype, for 16-bit gradients only, as upstream.
- ``reversible_adam(...)``: the same arguments; elements whose scaled gradient is not finite stay
  unchanged and ``p_copy[0]`` becomes inf (``p_copy`` may be uint8 e5m2 codes).
- ``adam_mt(chunk_size, overflow_flag, tensor_lists, lr, beta1, beta2, eps, grad_scale, step, mode,
  bias_correction, decay)``: lists ``[p, m, v, g]`` or ``[p, m, v, g, p_copy]``.
- ``maybe_adam_undo(overflow_flag, p, m, v, g, lr, ...)``: inverts ``adam`` when the flag is set.
- ``strided_check_finite(overflow_flag, p_copy, stride, clear_overflow_first)``.
- ``maybe_cast(overflow_flag, p_in, p_out)`` / ``maybe_cast_mt(chunk_size, overflow_flag, [p_in, p_out])``:
  copy with conversion (fp32, fp16, bf16 or uint8 e5m2) unless the flag is set.

``overflow_flag`` is an int32 one-element tensor. CUDA kernels on GPUs (``csrc/legacy_adam.cu``), the
PyTorch references elsewhere. Differences from
upstream: ``m``/``v`` are fp32 for fp16/bf16 ``p`` (upstream refuses such ``p``) and fp64 for fp64
``p``; ``maybe_cast`` with an empty flag casts unconditionally, as upstream.
"""

from __future__ import annotations

import torch

from apex.contrib.optimizers import _ops
from apex.core import __version__

__all__ = [
    "__version__",
    "adam",
    "adam_mt",
    "maybe_adam_undo",
    "maybe_cast",
    "maybe_cast_mt",
    "reversible_adam",
    "strided_check_finite",
]

_REDUCED = (torch.float16, torch.bfloat16)


def _copy_if_reduced(p_copy, g):
    # Upstream writes the copy only for 16-bit gradients (an fp32 copy of fp32 would be a wasted write).
    return [p_copy] if p_copy.numel() > 0 and g.dtype in _REDUCED else []


def _flag(overflow_flag, like):
    """Upstream's empty flag means "no flag"; the ops take a one-element one."""
    if overflow_flag.numel() == 0:
        return torch.zeros(1, dtype=torch.int32, device=like.device)
    return overflow_flag


def strided_check_finite(overflow_flag, p_copy, stride, clear_overflow_first):
    _ops.strided_check_finite(overflow_flag, p_copy, int(stride), bool(clear_overflow_first))


def adam(p, p_copy, m, v, g, lr, beta1, beta2, eps, grad_scale, step, mode, bias_correction, decay):
    _ops.adam(
        [p], _copy_if_reduced(p_copy, g), [m], [v], [g], float(lr), float(beta1), float(beta2), float(eps),
        float(grad_scale), int(step), int(mode), bool(bias_correction), float(decay),
    )  # fmt: skip


def reversible_adam(p, p_copy, m, v, g, lr, beta1, beta2, eps, grad_scale, step, mode, bias_correction, decay):
    _ops.adam(
        [p], _copy_if_reduced(p_copy, g), [m], [v], [g], float(lr), float(beta1), float(beta2), float(eps),
        float(grad_scale), int(step), int(mode), bool(bias_correction), float(decay), True,
    )  # fmt: skip


def adam_mt(
    chunk_size, overflow_flag, tensor_lists, lr, beta1, beta2, eps, grad_scale, step, mode, bias_correction, decay
):
    if len(tensor_lists) not in (4, 5):
        raise ValueError(f"adam_mt: expected tensor lists of size 4 or 5, got {len(tensor_lists)}")
    p, m, v, g = tensor_lists[:4]
    p_copy = tensor_lists[4] if len(tensor_lists) == 5 else []
    _ops.adam(
        p, p_copy, m, v, g, float(lr), float(beta1), float(beta2), float(eps), float(grad_scale), int(step),
        int(mode), bool(bias_correction), float(decay),
    )  # fmt: skip


def maybe_adam_undo(overflow_flag, p, m, v, g, lr, beta1, beta2, eps, grad_scale, step, mode, bias_correction, decay):
    _ops.adam_undo(
        overflow_flag, [p], [m], [v], [g], float(lr), float(beta1), float(beta2), float(eps), float(grad_scale),
        int(step), int(mode), bool(bias_correction), float(decay),
    )  # fmt: skip


def maybe_cast(overflow_flag, p_in, p_out):
    _ops.maybe_cast(_flag(overflow_flag, p_in), [p_in], [p_out])


def maybe_cast_mt(chunk_size, overflow_flag, tensor_lists):
    if len(tensor_lists) != 2:
        raise ValueError(f"maybe_cast_mt: expected tensor lists of size 2, got {len(tensor_lists)}")
    p_in, p_out = tensor_lists
    if p_in:
        _ops.maybe_cast(_flag(overflow_flag, p_in[0]), list(p_in), list(p_out))
