"""``fused_swiglu``: SwiGLU over a fused gate-and-up projection, one kernel each way (not in upstream Apex)."""

from __future__ import annotations

import torch

from apex.transformer import _swiglu_ops


def fused_swiglu(input: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` with ``gate, up = input.chunk(2, dim=-1)``.

    Args:
        input: ``[*, 2n]``, the output of a projection to the gate and the up halves together
            (Llama's ``w1`` and ``w3`` as one ``Linear``; Megatron-Core's ``linear_fc1`` with
            ``gated_linear_unit``); float32, float16 or bfloat16 on CUDA, any float dtype on the CPU.

    Returns ``[*, n]`` in ``input``'s dtype. Differentiable: autograd keeps only ``input`` (not
    ``silu(gate)`` as the eager expression does), and the backward writes both halves' gradients
    into one ``[*, 2n]`` tensor in one pass. Under CUDA autocast the input is used in its own dtype
    (as the eager expression's elementwise ops do).
    """
    return _swiglu_ops.swiglu(input.contiguous())
