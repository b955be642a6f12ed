"""The fused scale-mask softmax family as dispatcher ops (namespace ``apex_transformer``).

- ``scaled_softmax_forward(input, mask=None, scale=1.0, causal=False) -> output``:
  ``y = softmax(scale * x, masked)`` over the last dimension, computed in float32, returned in
  the input's dtype. ``input`` is ``[..., sq, sk]`` at any strides (the kernel reads a contiguous copy of a
  strided one), float16, bfloat16 or float32
  (upstream's kernels take only the 16-bit types; float32 is accepted here on every path, so
  the functional API and the CPU reference work for it too). Masking is one of:

  - none;
  - ``causal=True``: element ``j > i`` of row ``i`` of each ``[sq, sk]`` matrix is excluded
    (output 0); needs ``sq == sk``, as upstream;
  - ``mask``: bool or uint8 of shape ``[b or 1, 1, sq, sk]`` for a 4-D ``input [b, np, sq, sk]``;
    a nonzero element is masked: its score becomes -10000 (upstream's value, not -inf), and a
    row whose every element is masked gives 0 (upstream's current kernels; older ones gave
    ``1/sk``). Upstream reads only the value 1 as masked; here any nonzero byte is, as for bool.

- ``scaled_softmax_backward(grad_output, output, scale, causal=False) -> grad_input`` and
  ``scaled_softmax_backward_`` (the same, written into ``grad_output``, as upstream's modules
  do): ``dx = scale * y * (dy - sum(dy * y))`` over the last dimension, in float32. With
  ``causal`` only the elements ``j <= i`` of ``y`` and ``dy`` are read (the rest of a causal
  softmax output is zero) and the others of ``dx`` are 0.

Every ``sk >= 1`` and any number of rows are supported on every path (the CUDA kernels keep a
row in registers up to 32768 16-bit elements and stream longer ones). The references below are
the CPU path and the specification.
"""

from __future__ import annotations

import torch

from apex.core import checks
from apex.core.library import autograd, op
from apex.transformer._plugin import KERNELS

MASKED_SCORE = -10000.0
MASK_DTYPES = (torch.bool, torch.uint8)


# checks (the same, in the same order and words, as csrc/softmax_common.cuh) ------------------


def _float_input(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in checks.FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected one of float32, float16, bfloat16")


def _rows_layout(op: str, name: str, t: torch.Tensor) -> None:
    if t.dim() < 2:
        raise ValueError(f"{op}: {name} must have at least 2 dimensions [..., sq, sk], got shape {tuple(t.shape)}")


def _square(op: str, name: str, t: torch.Tensor) -> None:
    if t.shape[-2] != t.shape[-1]:
        raise ValueError(f"{op}: causal masking needs a square {name} (sq == sk), got {name} of shape {tuple(t.shape)}")


def check_forward(a) -> None:
    op, input, mask = a.op, a.input, a.mask
    _float_input(op, "input", input)
    _rows_layout(op, "input", input)
    # Any strides (read from a contiguous copy when needed): Inductor hands on views, e.g. of a
    # matmul it padded, mm(a, pad(b))[..., :sk], where eager code had a contiguous tensor.
    checks.placed(op, "input", input, input.device)
    if a.causal:
        if mask is not None:
            raise ValueError(f"{op}: causal masking takes no mask (got a mask)")
        _square(op, "input", input)
    if mask is not None:
        if mask.dtype not in MASK_DTYPES:
            raise TypeError(f"{op}: mask has dtype {mask.dtype}; expected bool or uint8")
        if input.dim() != 4:
            raise ValueError(f"{op}: input must be 4-D [b, np, sq, sk] with a mask, got shape {tuple(input.shape)}")
        b, _, sq, sk = input.shape
        ok = mask.dim() == 4 and mask.shape[0] in (1, b) and mask.shape[1] == 1 and tuple(mask.shape[2:]) == (sq, sk)
        if not ok:
            raise ValueError(
                f"{op}: mask has shape {tuple(mask.shape)}; expected ({b} or 1, 1, {sq}, {sk}) "
                f"for input of shape {tuple(input.shape)}"
            )
        checks.dense(op, "mask", mask, input.device)


def _check_backward(a) -> None:
    op, grad_output, output = a.op, a.grad_output, a.output
    _float_input(op, "grad_output", grad_output)
    _float_input(op, "output", output)
    if grad_output.dtype != output.dtype:
        raise TypeError(f"{op}: grad_output has dtype {grad_output.dtype} but output has {output.dtype}")
    _rows_layout(op, "output", output)
    if tuple(grad_output.shape) != tuple(output.shape):
        raise ValueError(f"{op}: grad_output has shape {tuple(grad_output.shape)} but output has {tuple(output.shape)}")
    checks.dense(op, "output", output, output.device)
    checks.dense(op, "grad_output", grad_output, output.device)
    if a.causal:
        _square(op, "output", output)


# references ------------------------------------------------------------------------------------


def causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """True above the diagonal: the elements a causal row excludes."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu_(1)


def reference_forward(input, mask, scale, causal):
    """The math of ``scaled_softmax_forward`` in PyTorch (float32, or float64 for float64 input)."""
    compute = torch.float64 if input.dtype == torch.float64 else torch.float32
    scores = input.to(compute) * scale
    if causal:
        scores = scores.masked_fill(causal_mask(input.shape[-2], input.shape[-1], input.device), float("-inf"))
    if mask is not None:
        masked = mask.bool()
        scores = scores.masked_fill(masked, MASKED_SCORE)
    out = torch.softmax(scores, dim=-1)
    if mask is not None:
        out = out.masked_fill(masked.all(dim=-1, keepdim=True), 0.0)
    return out.to(input.dtype)


def reference_backward(grad_output, output, scale, causal):
    """The math of ``scaled_softmax_backward`` in PyTorch (float32, or float64 for float64 input)."""
    compute = torch.float64 if output.dtype == torch.float64 else torch.float32
    y = output.to(compute)
    dy = grad_output.to(compute)
    if causal:  # neither is read above the diagonal, where a causal output is 0
        above = causal_mask(y.shape[-2], y.shape[-1], y.device)
        y = y.masked_fill(above, 0.0)
        dy = dy.masked_fill(above, 0.0)
    dot = (y * dy).sum(dim=-1, keepdim=True)
    return (scale * y * (dy - dot)).to(output.dtype)


# ops -------------------------------------------------------------------------------------------


def _forward_fake(a):
    return torch.empty_like(a.input, memory_format=torch.contiguous_format)


def _backward_fake(a):
    return torch.empty_like(a.output, memory_format=torch.contiguous_format)


@op(
    KERNELS,
    "scaled_softmax_forward(Tensor input, Tensor? mask=None, float scale=1.0, bool causal=False) -> Tensor",
    check=check_forward,
    fake=_forward_fake,
)
def scaled_softmax_forward(a):
    return reference_forward(a.input, a.mask, a.scale, a.causal).contiguous()


@op(
    KERNELS,
    "scaled_softmax_backward(Tensor grad_output, Tensor output, float scale, bool causal=False) -> Tensor",
    check=_check_backward,
    fake=_backward_fake,
)
def scaled_softmax_backward(a):
    return reference_backward(a.grad_output, a.output, a.scale, a.causal).contiguous()


@op(
    KERNELS,
    "scaled_softmax_backward_(Tensor(a!) grad_output, Tensor output, float scale, bool causal=False) -> ()",
    check=_check_backward,
)
def scaled_softmax_backward_(a):
    a.grad_output.copy_(reference_backward(a.grad_output, a.output, a.scale, a.causal))


# autograd --------------------------------------------------------------------------------------
# The forward saves its output; the backward writes a new tensor (autograd may share the incoming
# gradient with other consumers, so it is not overwritten here as the legacy modules do).


def _setup_context(ctx, inputs, output):
    _, _, scale, causal = inputs
    ctx.save_for_backward(output)
    ctx.scale = scale
    ctx.causal = causal


def _backward(ctx, grad_output):
    (output,) = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: differentiable torch ops (double backward)
        grad_input = reference_backward(grad_output, output, ctx.scale, ctx.causal)
    else:
        grad_input = scaled_softmax_backward(grad_output.contiguous(), output, ctx.scale, ctx.causal)
    return grad_input, None, None, None


scaled_softmax = autograd(scaled_softmax_forward, _setup_context, _backward, "ScaledSoftmax")
"""Differentiable ``scaled_softmax(input, mask, scale, causal)`` (the forward op with its backward)."""


# upstream's extension modules (scaled_*softmax_cuda.py) ---------------------------------------


def legacy_scale(module: str, scale) -> float:
    """``scale`` as upstream's modules take it: a number, or a one-element (0-d) tensor, which
    Megatron-Core passes (``torch.tensor([scale])[0]``)."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(
                f"{module}: scale must be a number or a one-element tensor, got shape {tuple(scale.shape)}"
            )
        return float(scale.item())
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{module}: scale must be a number or a one-element tensor, got {type(scale).__name__}")
    return float(scale)


def legacy_dims(module: str, name: str, t: torch.Tensor, dims: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{module}: {name} must be a Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{module}: {name} must be a {dims}-D tensor {layout}, got shape {tuple(t.shape)}")


MASK_LAYOUT = "[b or 1, 1, sq, sk]"


def legacy_forward(module: str, input, mask, scale, causal: bool, dims: int, layout: str):
    """The legacy modules' ``forward``: their shape checks, then the op on contiguous tensors."""
    legacy_dims(module, "input", input, dims, layout)
    if mask is not None:
        legacy_dims(module, "mask", mask, 4, MASK_LAYOUT)
        mask = mask.contiguous()
    return scaled_softmax_forward(input.contiguous(), mask, legacy_scale(module, scale), causal)


def legacy_backward(module: str, output_grads, softmax_results, scale, causal: bool, dims: int, layout: str):
    """``dx`` written into ``output_grads`` (a contiguous copy of it when it is not contiguous),
    which is returned, as upstream's ``backward`` does."""
    legacy_dims(module, "output_grads", output_grads, dims, layout)
    legacy_dims(module, "softmax_results", softmax_results, dims, layout)
    grads = output_grads.contiguous()
    scaled_softmax_backward_(grads, softmax_results.contiguous(), legacy_scale(module, scale), causal)
    return grads
