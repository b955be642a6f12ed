"""Megatron's fused scale-mask softmax, as upstream Apex's ``apex.transformer.functional``.

Functions (differentiable; ``scale`` a Python number):

- ``scaled_upper_triang_masked_softmax(inputs, _, scale)``: causal softmax of
  ``inputs [b, np, sq, sk]`` (``sq == sk``); the second argument is ignored, as upstream.
- ``scaled_masked_softmax(inputs, mask, scale)``: padding-masked softmax of ``[b, np, sq, sk]``
  with a bool/uint8 ``mask [b or 1, 1, sq, sk]`` (nonzero = masked, score -10000; a fully masked
  row gives 0); ``mask=None`` is :func:`scaled_softmax`.
- ``scaled_softmax(inputs, scale)``: unmasked.
- ``generic_scaled_masked_softmax(inputs, mask, scale)``: as ``scaled_masked_softmax`` (upstream
  kept a separate, slower kernel for long rows; ours covers every ``sk`` with one).

Under ``torch.autocast`` the inputs are first cast to the autocast dtype, as upstream does. The
math and the accepted shapes and dtypes are those of ``apex.transformer._softmax_ops``
(float32 input is accepted too, where upstream's kernels took only float16 and bfloat16).

The autograd Functions upstream applied (``ScaledUpperTriangMaskedSoftmax``, ``ScaledMaskedSoftmax``,
``GenericScaledMaskedSoftmax``, ``ScaledSoftmax``) are here with upstream's ``forward`` arguments, for code
that applies them itself.

``FusedScaleMaskSoftmax`` and ``GenericFusedScaleMaskSoftmax`` keep upstream's constructor
checks and its rule for when the fused function runs and when the PyTorch path
(``mask_func`` + ``torch.softmax``) does, so a model picks the same path for the same shapes.
"""

from __future__ import annotations

import torch

from apex.core.library import Args
from apex.transformer import _softmax_ops
from apex.transformer.enums import AttnMaskType

# Off CUDA the functions take torch's softmax (torch_scaled_softmax, differentiated by torch's autograd):
# the op's reference there is Python written to check the kernels. On 1 CPU thread, forward + backward of
# [4, 16, 256, 256] bf16 causal: 40.1 ms through the op, 21.3 through torch_scaled_softmax (torch's
# masked_fill + softmax 22.0); [2, 4, 32, 32] 0.205 -> 0.124 (0.098). The tests set this False to run the
# op's path on the CPU.
_TORCH_OFF_CUDA = True


def _autocast(inputs: torch.Tensor) -> torch.Tensor:
    device_type = inputs.device.type
    compiling = torch.compiler.is_compiling()
    if (compiling or torch.amp.is_autocast_available(device_type)) and torch.is_autocast_enabled(device_type):
        return inputs.to(torch.get_autocast_dtype(device_type))
    return inputs


def torch_scaled_softmax(inputs, mask, scale, causal):
    """``scaled_softmax(inputs, mask, scale, causal)`` in torch ops (float32 math, the input's dtype out),
    differentiated by torch's autograd; the same values and gradients as the op (the checks too).

    The masked scores are written in place without autograd: as by the op's backward, the gradient is
    ``scale * y * (dy - sum(dy * y))`` at every element, masked ones included (0 where ``y`` is). A
    causal gradient reads no ``dy`` above the diagonal (``tril``), and fully masked rows give 0 (a
    multiply by 0/1, so their gradient is 0 too)."""
    _softmax_ops.check_forward(
        Args({"op": "scaled_softmax_forward", "input": inputs, "mask": mask, "scale": scale, "causal": causal})
    )
    scores = inputs.float() * scale  # a new tensor; its backward (times scale) does not read it
    with torch.no_grad():
        if causal:
            above = _softmax_ops.causal_mask(inputs.shape[-2], inputs.shape[-1], inputs.device)
            scores.masked_fill_(above, float("-inf"))
        if mask is not None:
            masked = mask.bool()
            scores.masked_fill_(masked, _softmax_ops.MASKED_SCORE)
            keep = (~masked.all(dim=-1, keepdim=True)).float()
    out = torch.softmax(scores, dim=-1)
    if causal:
        out = out.tril()
    if mask is not None:
        out = out * keep
    return out.to(inputs.dtype)


def _softmax(inputs, mask, scale, causal):
    inputs = _autocast(inputs)
    if mask is not None:
        mask = mask.contiguous()
    if _TORCH_OFF_CUDA and not inputs.is_cuda:
        return torch_scaled_softmax(inputs, mask, float(scale), causal)
    inputs = inputs.contiguous()
    return _softmax_ops.scaled_softmax(inputs, mask, float(scale), causal)


def scaled_upper_triang_masked_softmax(inputs, _, scale):
    """Causal softmax of ``scale * inputs`` over the last dimension; ``inputs`` is [b, np, sq, sk]."""
    if inputs.dim() != 4:
        raise ValueError(
            f"scaled_upper_triang_masked_softmax: inputs must be 4-D [b, np, sq, sk], got shape {tuple(inputs.shape)}"
        )
    sq, sk = inputs.shape[-2:]
    if sq != sk:
        raise ValueError(
            f"scaled_upper_triang_masked_softmax: causal mask is only for self attention (sq {sq} != sk {sk})"
        )
    return _softmax(inputs, None, scale, True)


def scaled_masked_softmax(inputs, mask, scale):
    """Softmax of ``scale * inputs`` with the padding ``mask`` (None: unmasked) over the last dimension."""
    return _softmax(inputs, mask, scale, False)


def scaled_softmax(inputs, scale):
    """Softmax of ``scale * inputs`` over the last dimension."""
    return _softmax(inputs, None, scale, False)


def generic_scaled_masked_softmax(inputs, mask, scale):
    """As :func:`scaled_masked_softmax`, for any ``sk`` (upstream's separate long-row module)."""
    return _softmax(inputs, mask, scale, False)


# Upstream's autograd Functions, which its functions above applied and which code written for it may apply
# itself (``ScaledUpperTriangMaskedSoftmax.apply(inputs, scale)``): forward(ctx, inputs, [mask,] scale), the
# input and layout rules of upstream's extension modules (the causal one 3-D [attn_batches, sq, sk], the
# others 4-D), ``scale`` a number or a one-element tensor. The backward returns a new tensor (upstream's
# wrote into the incoming gradient, which autograd may share with other consumers). No autocast cast:
# upstream's functions did that before applying them.


def _function_forward(ctx, module, inputs, mask, scale, causal, dims, layout):
    _softmax_ops.legacy_dims(module, "inputs", inputs, dims, layout)
    if mask is not None:
        _softmax_ops.legacy_dims(module, "mask", mask, 4, _softmax_ops.MASK_LAYOUT)
        mask = mask.contiguous()
    scale = _softmax_ops.legacy_scale(module, scale)
    output = _softmax_ops.scaled_softmax_forward(inputs.contiguous(), mask, scale, causal)
    ctx.save_for_backward(output)
    ctx.scale, ctx.causal = scale, causal
    return output


def _function_backward(ctx, output_grads):
    (output,) = ctx.saved_tensors
    return _softmax_ops.scaled_softmax_backward(output_grads.contiguous(), output, ctx.scale, ctx.causal)


class ScaledUpperTriangMaskedSoftmax(torch.autograd.Function):
    """Causal softmax of ``scale * inputs``, ``inputs [attn_batches, sq, sk]`` with ``sq == sk``."""

    @staticmethod
    def forward(ctx, inputs, scale):
        return _function_forward(
            ctx, "ScaledUpperTriangMaskedSoftmax", inputs, None, scale, True, 3, "[attn_batches, sq, sk]"
        )

    @staticmethod
    def backward(ctx, output_grads):
        return _function_backward(ctx, output_grads), None


class ScaledMaskedSoftmax(torch.autograd.Function):
    """Softmax of ``scale * inputs [b, np, sq, sk]`` with the padding ``mask [b or 1, 1, sq, sk]``."""

    @staticmethod
    def forward(ctx, inputs, mask, scale):
        return _function_forward(ctx, "ScaledMaskedSoftmax", inputs, mask, scale, False, 4, "[b, np, sq, sk]")

    @staticmethod
    def backward(ctx, output_grads):
        return _function_backward(ctx, output_grads), None, None


class GenericScaledMaskedSoftmax(ScaledMaskedSoftmax):
    """:class:`ScaledMaskedSoftmax` for any ``sk`` (upstream's separate kernel; ours is the same op)."""

    @staticmethod
    def forward(ctx, inputs, mask, scale):
        return _function_forward(ctx, "GenericScaledMaskedSoftmax", inputs, mask, scale, False, 4, "[b, np, sq, sk]")


class ScaledSoftmax(torch.autograd.Function):
    """Softmax of ``scale * inputs [b, np, sq, sk]``, unmasked."""

    @staticmethod
    def forward(ctx, inputs, scale):
        return _function_forward(ctx, "ScaledSoftmax", inputs, None, scale, False, 4, "[b, np, sq, sk]")

    @staticmethod
    def backward(ctx, output_grads):
        return _function_backward(ctx, output_grads), None


def get_batch_per_block(sq: int, sk: int, b: int, np: int) -> int:
    """Rows a 128-thread block of upstream's warp kernels handles for row length ``sk``.

    Upstream's eligibility rule divides by this; it is a function of ``sk`` alone: a warp of
    ``min(next_power_of_two(sk), 32)`` threads per row, two rows per warp up to 128 elements.
    """
    del sq, b, np
    padded = 1
    while padded < sk:
        padded *= 2
    warp = min(padded, 32)
    rows_per_warp = 2 if padded <= 128 else 1
    return (128 // warp) * rows_per_warp


class FusedScaleMaskSoftmax(torch.nn.Module):
    """Scale, mask and softmax of attention scores ``[b, np, sq, sk]``, fused where upstream fused it.

    Arguments (upstream's):
        input_in_fp16: the input is float16.
        input_in_bf16: the input is bfloat16 (not both).
        attn_mask_type: ``AttnMaskType.causal`` or ``AttnMaskType.padding``.
        scaled_masked_softmax_fusion: use the fused function where eligible.
        mask_func: ``mask_func(scores, mask)`` for the PyTorch path (e.g. a ``masked_fill`` with
            -10000).
        softmax_in_fp32: the PyTorch path computes in float32 (required when ``scale`` is given).
        scale: multiplies the scores before masking; None for 1.

    ``forward(input, mask)`` uses the fused function when :meth:`is_kernel_available` says so
    (fusion asked for, 16-bit input, ``16 < sk <= 16384``, ``sq``, ``sk`` and ``b * np`` multiples
    of 4, and ``b * np`` (causal) or ``sq`` (padding) a multiple of :func:`get_batch_per_block`),
    otherwise the PyTorch path. The causal fused path ignores ``mask``; a padding fused path with
    ``mask=None`` is unmasked.
    """

    def __init__(
        self,
        input_in_fp16,
        input_in_bf16,
        attn_mask_type,
        scaled_masked_softmax_fusion,
        mask_func,
        softmax_in_fp32,
        scale,
    ):
        super().__init__()
        self.input_in_fp16 = input_in_fp16
        self.input_in_bf16 = input_in_bf16
        if self.input_in_fp16 and self.input_in_bf16:
            raise RuntimeError("both fp16 and bf16 flags cannot be active at the same time.")
        self.input_in_float16 = self.input_in_fp16 or self.input_in_bf16
        self.attn_mask_type = attn_mask_type
        self.scaled_masked_softmax_fusion = scaled_masked_softmax_fusion
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale
        if not (self.scale is None or softmax_in_fp32):
            raise RuntimeError("softmax should be in fp32 when scaled")
        if self.scaled_masked_softmax_fusion:
            if self.attn_mask_type == AttnMaskType.causal:
                self.fused_softmax_func = scaled_upper_triang_masked_softmax
            elif self.attn_mask_type == AttnMaskType.padding:
                self.fused_softmax_func = scaled_masked_softmax
            else:
                raise ValueError("Invalid attn_mask_type.")

    def forward(self, input, mask):
        if input.dim() != 4:
            raise ValueError(
                f"FusedScaleMaskSoftmax: input must be 4-D [b, np, sq, sk], got shape {tuple(input.shape)}"
            )
        if self.is_kernel_available(mask, *input.size()):
            return self.forward_fused_softmax(input, mask)
        return self.forward_torch_softmax(input, mask)

    def is_kernel_available(self, mask, b, np, sq, sk):
        attn_batches = b * np
        if (
            self.scaled_masked_softmax_fusion
            and self.input_in_float16
            and 16 < sk <= 16384
            and sq % 4 == 0
            and sk % 4 == 0
            and attn_batches % 4 == 0
        ):
            batch_per_block = self.get_batch_per_block(sq, sk, b, np)
            if self.attn_mask_type == AttnMaskType.causal:
                return attn_batches % batch_per_block == 0
            return sq % batch_per_block == 0
        return False

    def forward_fused_softmax(self, input, mask):
        scale = self.scale if self.scale is not None else 1.0
        return self.fused_softmax_func(input, mask, scale)

    def forward_torch_softmax(self, input, mask):
        if self.input_in_float16 and self.softmax_in_fp32:
            input = input.float()
        if self.scale is not None:
            input = input * self.scale
        mask_output = self.mask_func(input, mask) if mask is not None else input
        probs = torch.nn.Softmax(dim=-1)(mask_output)
        if self.input_in_float16 and self.softmax_in_fp32:
            probs = probs.half() if self.input_in_fp16 else probs.bfloat16()
        return probs

    @staticmethod
    def get_batch_per_block(sq, sk, b, np):
        return get_batch_per_block(sq, sk, b, np)


class GenericFusedScaleMaskSoftmax(FusedScaleMaskSoftmax):
    """:class:`FusedScaleMaskSoftmax` for padding masks, fused for every ``sk > 0``.

    Upstream assigned its generic function to ``scaled_masked_softmax_fusion`` rather than to
    ``fused_softmax_func`` (so its module ran the non-generic kernel); here the generic
    function runs, which computes the same values.
    """

    def __init__(self, input_in_fp16, input_in_bf16, scaled_masked_softmax_fusion, mask_func, softmax_in_fp32, scale):
        super().__init__(
            input_in_fp16,
            input_in_bf16,
            AttnMaskType.padding,
            scaled_masked_softmax_fusion,
            mask_func,
            softmax_in_fp32,
            scale,
        )
        if self.scaled_masked_softmax_fusion:
            self.fused_softmax_func = generic_scaled_masked_softmax

    def is_kernel_available(self, mask, b, np, sq, sk):
        return bool(self.scaled_masked_softmax_fusion) and 0 < sk


__all__ = [
    "FusedScaleMaskSoftmax",
    "GenericFusedScaleMaskSoftmax",
    "GenericScaledMaskedSoftmax",
    "ScaledMaskedSoftmax",
    "ScaledSoftmax",
    "ScaledUpperTriangMaskedSoftmax",
    "generic_scaled_masked_softmax",
    "get_batch_per_block",
    "scaled_masked_softmax",
    "scaled_softmax",
    "scaled_upper_triang_masked_softmax",
    "torch_scaled_softmax",
]
