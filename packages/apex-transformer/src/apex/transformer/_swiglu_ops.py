"""SwiGLU ops (namespace ``apex_transformer``): the gated activation of Llama-style MLPs.

- ``swiglu(input [*, 2n]) -> [*, n]``: ``silu(gate) * up`` with ``gate, up = input.chunk(2, -1)``,
  the layout of a fused gate-and-up projection (Megatron-Core's ``bias_swiglu_impl`` without a bias);
- ``swiglu_backward(grad_output [*, n], input [*, 2n]) -> [*, 2n]``: the gradient with respect to
  ``input``, both halves in one tensor (what the fused projection's backward takes):
  ``d_gate = g * up * s * (1 + gate * (1 - s))`` and ``d_up = g * silu(gate)``, ``s = sigmoid(gate)``.

Not in upstream Apex. What it saves against ``F.silu(gate) * up`` in eager mode: autograd there
keeps ``silu(gate)`` too (a third [*, n] tensor per layer), and the backward takes five passes
(the product's two gradients, silu's, and a ``cat`` of the two halves); these ops keep only the
input and make one pass each way. Math in float32 for every storage type; float32, float16,
bfloat16 on CUDA (csrc/swiglu.cu, the same checks in the same words); any float dtype through the
PyTorch reference here. Contiguous tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from apex.core import checks
from apex.core.library import op
from apex.transformer._plugin import KERNELS


def _check_input(op: str, input: torch.Tensor) -> int:
    """A contiguous float tensor with an even last dimension (zero included); returns its half."""
    if not input.dtype.is_floating_point:
        raise TypeError(f"{op}: input has dtype {input.dtype}; expected a floating-point dtype")
    if input.dim() == 0 or input.shape[-1] % 2 != 0:
        raise ValueError(
            f"{op}: input's last dimension must be even (gate and up halves), got shape {tuple(input.shape)}"
        )
    checks.dense(op, "input", input, input.device)
    return input.shape[-1] // 2


def _check_swiglu(a) -> None:
    _check_input(a.op, a.input)


def _check_swiglu_backward(a) -> None:
    half = _check_input(a.op, a.input)
    grad = a.grad_output
    if grad.dtype != a.input.dtype:
        raise TypeError(f"{a.op}: grad_output has dtype {grad.dtype} but input has {a.input.dtype}")
    expected = (*a.input.shape[:-1], half)
    if tuple(grad.shape) != expected:
        raise ValueError(f"{a.op}: grad_output has shape {tuple(grad.shape)}, expected {expected} (input's, halved)")
    checks.dense(a.op, "grad_output", grad, a.input.device)


def _halves(input: torch.Tensor):
    compute = torch.float64 if input.dtype == torch.float64 else torch.float32
    gate, up = input.to(compute).chunk(2, dim=-1)
    return gate, up


@op(
    KERNELS,
    "swiglu(Tensor input) -> Tensor",
    check=_check_swiglu,
    fake=lambda a: a.input.new_empty((*a.input.shape[:-1], a.input.shape[-1] // 2)),
)
def swiglu(a):
    gate, up = _halves(a.input)
    return (F.silu(gate) * up).to(a.input.dtype)


def _gradient(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(gate)
    return torch.cat((grad * up * s * (1 + gate * (1 - s)), grad * gate * s), dim=-1)


@op(
    KERNELS,
    "swiglu_backward(Tensor grad_output, Tensor input) -> Tensor",
    check=_check_swiglu_backward,
    fake=lambda a: torch.empty_like(a.input),
)
def swiglu_backward(a):
    gate, up = _halves(a.input)
    return _gradient(a.grad_output.to(gate.dtype), gate, up).to(a.input.dtype)


# autograd: registered on the op for every device and for torch.compile. A backward that records a
# graph (create_graph=True) computes the same expression with differentiable torch ops.


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    (input,) = ctx.saved_tensors
    if torch.is_grad_enabled():
        gate, up = _halves(input)
        return _gradient(grad.to(gate.dtype), gate, up).to(input.dtype)
    return swiglu_backward(grad.contiguous(), input)


torch.library.register_autograd(swiglu, _backward, setup_context=_setup_context)
