"""Rotary positional embedding ops (namespace ``apex_transformer``): Megatron's rotate-half RoPE.

Four ops, one per input layout, each computing the forward rotation or, with ``backward=True``,
its transpose (the gradient with respect to the input, given the output's gradient):

- ``rope(input [s, b, h, d], freqs [s, 1, 1, d2] float32, transpose_output, backward)``;
- ``rope_cached(input [s, b, h, d], cos, sin [s, 1, 1, d2], transpose_output, backward)``, the
  tables float32 or the input's dtype;
- ``rope_thd(input [t, h, d], cu_seqlens int32 [n + 1], freqs [max_s, 1, 1, d2] float32,
  backward)``, packed sequences whose positions restart at each ``cu_seqlens`` entry;
- ``rope_2d(input [b, H, W, h, d], cos_h, sin_h [1, >=H, 1, d/2], cos_w, sin_w [1, >=W, 1, d/2],
  backward)`` returning ``[b, H*W, h, d]``: the first half of the head dim rotated by the row's
  angles, the second half by the column's.

The math, on the first ``d2`` channels (``k = d2/2``; channels from ``d2`` on are copied)::

    out[i]     = x[i] * cos(f[i])     - x[i+k] * sin(f[i])        i < k
    out[i+k]   = x[i+k] * cos(f[i+k]) + x[i] * sin(f[i+k])

which is ``x * cos(f) + rotate_half(x) * sin(f)`` with ``rotate_half([x1, x2]) = [-x2, x1]``.
The backward applies the transpose, ``g[i] * cos(f[i]) + g[i+k] * sin(f[i+k])`` and
``g[i+k] * cos(f[i+k]) - g[i] * sin(f[i])``: the rotation by ``-f`` when both halves of ``f`` are
equal, as Megatron builds them. Math in float32 whatever the storage type; the output in the
input's dtype, contiguous (``transpose_output``: laid out ``[b, s, h, d]`` in memory, so that
``output.transpose(0, 1)`` is contiguous). The input may have any strides (a slice of a fused QKV
projection, a transpose): the kernels read it in place.

Packed sequences: token ``j`` belongs to sequence ``i`` when ``cu_seqlens[i] <= j <
cu_seqlens[i+1]`` (``cu_seqlens`` non-decreasing; empty sequences allowed) and sits at position
``j - cu_seqlens[i]``. Tokens outside ``[cu_seqlens[0], cu_seqlens[-1])`` (padding) are copied
unchanged. A position at or past ``max_s`` has no angle: its rotated channels come out NaN (the
kernel cannot raise without waiting for the device, so the error shows in the result).
"""

from __future__ import annotations

import torch

from apex.core import checks
from apex.core.library import autograd, op
from apex.transformer._plugin import KERNELS

_FLOAT_NAMES = "float32, float16, bfloat16"


# checks ----------------------------------------------------------------------------------------
# The CUDA kernels (csrc/rope.cu) check the same things in the same words.


def _check_input(op: str, input: torch.Tensor, ndim: int, layout: str) -> None:
    if input.dtype not in checks.FLOAT_DTYPES:
        raise TypeError(f"{op}: input has dtype {input.dtype}; expected one of {_FLOAT_NAMES}")
    if input.dim() != ndim:
        raise ValueError(f"{op}: input must be {ndim}-D {layout}, got shape {tuple(input.shape)}")
    checks.placed(op, "input", input, input.device)


def _table_dtypes(input_dtype: torch.dtype) -> tuple:
    return (torch.float32,) if input_dtype == torch.float32 else (torch.float32, input_dtype)


def _check_dtype(op: str, name: str, t: torch.Tensor, dtypes: tuple) -> None:
    if t.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected {names}")


def _check_table(op: str, name: str, t: torch.Tensor, d: int, device: torch.device) -> int:
    """A [positions, 1, 1, d2] table with an even d2 <= d; returns d2."""
    if t.dim() != 4 or t.shape[1] != 1 or t.shape[2] != 1:
        raise ValueError(f"{op}: {name} must have shape [positions, 1, 1, d2], got {tuple(t.shape)}")
    d2 = t.shape[3]
    if d2 > d:
        raise ValueError(f"{op}: {name} has d2 = {d2} channels but the input's head dim is {d}; d2 must not exceed it")
    if d2 % 2 != 0:
        raise ValueError(f"{op}: {name} has an odd number of channels (d2 = {d2}); rotate-half needs an even d2")
    checks.placed(op, name, t, device)
    return d2


def _check_positions(op: str, name: str, t: torch.Tensor, s: int) -> None:
    if t.shape[0] != s:
        raise ValueError(f"{op}: {name} has {t.shape[0]} positions but the input's sequence length is {s}")


def _check_pair(op: str, cos_name: str, cos: torch.Tensor, sin_name: str, sin: torch.Tensor) -> None:
    if sin.dtype != cos.dtype:
        raise TypeError(f"{op}: {sin_name} has dtype {sin.dtype} but {cos_name} has dtype {cos.dtype}")
    if sin.shape != cos.shape:
        raise ValueError(f"{op}: {sin_name} has shape {tuple(sin.shape)} but {cos_name} has shape {tuple(cos.shape)}")


def _check_rope(a) -> None:
    _check_input(a.op, a.input, 4, "[s, b, h, d]")
    _check_dtype(a.op, "freqs", a.freqs, (torch.float32,))
    _check_table(a.op, "freqs", a.freqs, a.input.shape[3], a.input.device)
    _check_positions(a.op, "freqs", a.freqs, a.input.shape[0])


def _check_rope_cached(a) -> None:
    _check_input(a.op, a.input, 4, "[s, b, h, d]")
    _check_dtype(a.op, "cos", a.cos, _table_dtypes(a.input.dtype))
    _check_pair(a.op, "cos", a.cos, "sin", a.sin)
    for name, t in (("cos", a.cos), ("sin", a.sin)):
        _check_table(a.op, name, t, a.input.shape[3], a.input.device)
        _check_positions(a.op, name, t, a.input.shape[0])


def _check_rope_thd(a) -> None:
    _check_input(a.op, a.input, 3, "[t, h, d]")
    cu = a.cu_seqlens
    if cu.dtype != torch.int32:
        raise TypeError(f"{a.op}: cu_seqlens has dtype {cu.dtype}; expected int32")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{a.op}: cu_seqlens must be 1-D with b + 1 >= 1 entries, got shape {tuple(cu.shape)}")
    checks.placed(a.op, "cu_seqlens", cu, a.input.device)
    _check_dtype(a.op, "freqs", a.freqs, (torch.float32,))
    _check_table(a.op, "freqs", a.freqs, a.input.shape[2], a.input.device)


def _check_rope_2d(a) -> None:
    op, input = a.op, a.input
    _check_input(op, input, 5, "[b, img_h, img_w, h, d]")
    d = input.shape[4]
    if d % 4 != 0:
        raise ValueError(f"{op}: input's head dim d = {d} must be a multiple of 4 (two rotated halves of even width)")
    _check_dtype(op, "cos_h", a.cos_h, _table_dtypes(input.dtype))
    for names, extent in ((("cos_h", "sin_h"), input.shape[1]), (("cos_w", "sin_w"), input.shape[2])):
        for name in names:
            t = getattr(a, name)
            if t.dtype != a.cos_h.dtype:
                raise TypeError(f"{op}: {name} has dtype {t.dtype} but cos_h has dtype {a.cos_h.dtype}")
            if t.dim() != 4 or t.shape[0] != 1 or t.shape[2] != 1 or t.shape[3] != d // 2:
                raise ValueError(
                    f"{op}: {name} must have shape [1, positions, 1, d/2 = {d // 2}], got {tuple(t.shape)}"
                )
            if t.shape[1] < extent:
                raise ValueError(f"{op}: {name} has {t.shape[1]} positions but the image needs {extent}")
            checks.placed(op, name, t, input.device)
    _check_pair(op, "cos_h", a.cos_h, "sin_h", a.sin_h)
    _check_pair(op, "cos_w", a.cos_w, "sin_w", a.sin_w)


# references ------------------------------------------------------------------------------------


def _sequence_output(input: torch.Tensor, transpose_output: bool) -> torch.Tensor:
    s, b, h, d = input.shape
    if transpose_output:
        return input.new_empty((b, s, h, d)).transpose(0, 1)
    return input.new_empty((s, b, h, d))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool, out: torch.Tensor) -> None:
    """Writes the rotation of x's first d2 = cos.shape[-1] channels (float32 math) and a copy of
    the rest into out (x's shape); cos and sin are float32 and broadcast against x[..., :d2]."""
    d2 = cos.shape[-1]
    k = d2 // 2
    x1, x2 = x[..., :k].float(), x[..., k:d2].float()
    cos1, cos2, sin1, sin2 = cos[..., :k], cos[..., k:], sin[..., :k], sin[..., k:]
    if backward:
        sin1, sin2 = -sin2, -sin1
    out[..., :k] = x1 * cos1 - x2 * sin1
    out[..., k:d2] = x2 * cos2 + x1 * sin2
    out[..., d2:] = x[..., d2:]


def _sequence_fake(a):
    return _sequence_output(a.input, a.transpose_output)


@op(
    KERNELS,
    "rope(Tensor input, Tensor freqs, bool transpose_output=False, bool backward=False) -> Tensor",
    check=_check_rope,
    fake=_sequence_fake,
)
def rope(a):
    out = _sequence_output(a.input, a.transpose_output)
    _rotate(a.input, torch.cos(a.freqs), torch.sin(a.freqs), a.backward, out)
    return out


@op(
    KERNELS,
    "rope_cached(Tensor input, Tensor cos, Tensor sin, bool transpose_output=False, bool backward=False) -> Tensor",
    check=_check_rope_cached,
    fake=_sequence_fake,
)
def rope_cached(a):
    out = _sequence_output(a.input, a.transpose_output)
    _rotate(a.input, a.cos.float(), a.sin.float(), a.backward, out)
    return out


def thd_angles(cu_seqlens: torch.Tensor, freqs: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [tokens, 1, d2] of each packed token's angles: identity (cos 1, sin 0) outside
    the sequences, NaN at positions past freqs' ``max_s`` (see the module docstring)."""
    max_s, d2 = freqs.shape[0], freqs.shape[3]
    token = torch.arange(tokens, device=freqs.device, dtype=torch.int64)
    cu = cu_seqlens.to(torch.int64)
    seq = torch.searchsorted(cu, token, right=True) - 1
    inside = (seq >= 0) & (seq < cu.shape[0] - 1)
    position = token - cu[seq.clamp(0, cu.shape[0] - 1)]
    nan_row = freqs.new_full((1, d2), float("nan"))
    table = torch.cat((freqs.reshape(max_s, d2), nan_row))
    angles = table[torch.where(inside & (position < max_s), position, max_s).clamp(0, max_s)]
    angles = torch.where(inside.unsqueeze(1), angles, 0.0)  # cos 0 = 1, sin 0 = 0: a copy
    return torch.cos(angles).unsqueeze(1), torch.sin(angles).unsqueeze(1)


@op(
    KERNELS,
    "rope_thd(Tensor input, Tensor cu_seqlens, Tensor freqs, bool backward=False) -> Tensor",
    check=_check_rope_thd,
    fake=lambda a: torch.empty_like(a.input, memory_format=torch.contiguous_format),
)
def rope_thd(a):
    out = torch.empty_like(a.input, memory_format=torch.contiguous_format)
    cos, sin = thd_angles(a.cu_seqlens, a.freqs, a.input.shape[0])
    _rotate(a.input, cos, sin, a.backward, out)
    return out


def _image_output(input: torch.Tensor) -> torch.Tensor:
    b, img_h, img_w, h, d = input.shape
    return input.new_empty((b, img_h * img_w, h, d))


@op(
    KERNELS,
    "rope_2d(Tensor input, Tensor cos_h, Tensor sin_h, Tensor cos_w, Tensor sin_w, bool backward=False) -> Tensor",
    check=_check_rope_2d,
    fake=lambda a: _image_output(a.input),
)
def rope_2d(a):
    input = a.input
    b, img_h, img_w, h, d = input.shape
    out = _image_output(input)
    out5 = out.view(b, img_h, img_w, h, d)
    half = d // 2

    def table(t: torch.Tensor, n: int) -> torch.Tensor:
        return t[0, :n, 0, :].float()

    rows = (table(a.cos_h, img_h)[:, None, None, :], table(a.sin_h, img_h)[:, None, None, :])
    cols = (table(a.cos_w, img_w)[None, :, None, :], table(a.sin_w, img_w)[None, :, None, :])
    _rotate(input[..., :half], *rows, a.backward, out5[..., :half])
    _rotate(input[..., half:], *cols, a.backward, out5[..., half:])
    return out


# autograd --------------------------------------------------------------------------------------
# Each rotation is linear in the input, and its gradient is the same op with ``backward`` flipped:
# the backward calls the differentiable function again, so a backward that records a graph
# (create_graph=True) differentiates too. The tables get no gradient (as upstream).


def _differentiable(forward, tables: int, name: str):
    """A differentiable ``forward(x, *tensors, *flags, backward)``: ``tables`` tensors follow x."""

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[1 : 1 + tables])
        ctx.flags = inputs[1 + tables : -1]
        ctx.backward = inputs[-1]

    def backward(ctx, grad):
        grad_input = call(grad, *ctx.saved_tensors, *ctx.flags, not ctx.backward)
        return (grad_input, *([None] * (tables + len(ctx.flags) + 1)))

    call = autograd(forward, setup_context, backward, name)
    return call


def _image(x, img_h, img_w, cos_h, sin_h, cos_w, sin_w, backward):
    # x is [b, img_h * img_w, h, d]; splitting a dimension is always a view
    return rope_2d(x.unflatten(1, (img_h, img_w)), cos_h, sin_h, cos_w, sin_w, backward)


def _image_call(x, cos_h, sin_h, cos_w, sin_w, img_h, img_w, backward):
    return _image(x, img_h, img_w, cos_h, sin_h, cos_w, sin_w, backward)


rotary = _differentiable(rope, 1, "FusedRoPE")
rotary_cached = _differentiable(rope_cached, 2, "FusedRoPECached")
rotary_thd = _differentiable(rope_thd, 2, "FusedRoPETHD")
rotary_2d = _differentiable(_image_call, 4, "FusedRoPE2D")
