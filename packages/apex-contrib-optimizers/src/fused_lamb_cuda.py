"""Upstream Apex's deprecated ``fused_lamb_cuda`` extension module, on apex-optimizers' LAMB op.

``lamb(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, bias_correction,
weight_decay, grad_averaging, mode, global_grad_norm, max_grad_norm)``: one LAMB step of the lists
``[g, p, m, v]`` (``mode`` 1: decoupled weight decay; 0: L2 on the gradient), the gradients first
divided by ``global_grad_norm / max_grad_norm`` when that exceeds 1, the trust ratio applied to
tensors only with non-zero ``weight_decay`` (``torch.ops.apex_optimizers.fused_lamb``,
``use_nvlamb=False``). Needs apex-optimizers (a dependency of this package).

Differences from upstream: ``g`` is left as it was (upstream's kernel overwrites it with the
update); moments in fp16 (upstream's all-fp16 lists) are updated through fp32 copies;
``max_grad_norm <= 0`` disables clipping (upstream divides by it); ``noop_flag`` is not read.
"""

from __future__ import annotations

import torch

from apex.core import __version__
from apex.optimizers import _ops as _optimizer_ops  # noqa: F401  (registers torch.ops.apex_optimizers)

__all__ = ["__version__", "lamb"]


def lamb(
    chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, bias_correction, weight_decay,
    grad_averaging, mode, global_grad_norm, max_grad_norm,
):  # fmt: skip
    if len(tensor_lists) != 4:
        raise ValueError(f"lamb: expected tensor lists [g, p, m, v], got {len(tensor_lists)} lists")
    g, p, m, v = (list(t) for t in tensor_lists)
    if not p:
        return
    moments = [t if t.dtype == torch.float32 else t.float() for t in m + v]
    norm = torch.full((1,), float(global_grad_norm), dtype=torch.float32, device=p[0].device)
    torch.ops.apex_optimizers.fused_lamb(
        int(chunk_size), p, g, moments[: len(m)], moments[len(m) :], [], norm, float(lr), int(step),
        float(beta1), float(beta2), float(epsilon), float(weight_decay), bool(mode), bool(bias_correction),
        bool(grad_averaging), float(max_grad_norm), False,
    )  # fmt: skip
    for original, updated in zip(m + v, moments):
        if original is not updated:
            original.copy_(updated)
