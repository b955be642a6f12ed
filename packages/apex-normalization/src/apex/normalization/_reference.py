"""Layer norm and RMS norm, forward and backward, in plain PyTorch: the specification of the kernels.

The rows are the leading dimensions of the input, the normalized elements its last ``ndim``
dimensions (``H`` of them per row). With ``x`` a row in float32:

- layer norm: ``mean = sum(x) / H``, ``var = sum((x - mean)^2) / H`` (biased), ``xhat = (x - mean) * rstd``;
- RMS norm: ``var = sum(x^2) / H``, ``xhat = x * rstd``; no mean, no bias;

with ``rstd = 1 / sqrt(var + eps)`` and ``y = xhat * weight + bias`` rounded once to the output
dtype. Statistics and arithmetic are float32 for every storage dtype (float64 inputs stay
float64, which ``gradcheck`` uses). With a residual, the norm is applied to ``x + residual``
rounded to the input's dtype: the same sum that is returned, so the fused call equals the
unfused one.

Backward, with ``wdy = weight * dy`` (``dy`` when there is no weight)::

    dx = rstd * (wdy - xhat * mean(wdy * xhat) - mean(wdy))      # layer norm
    dx = rstd * (wdy - xhat * mean(wdy * xhat))                  # RMS norm
    dweight = sum over rows of dy * xhat,   dbias = sum over rows of dy

``xhat`` comes from the saved input and statistics, or, with ``memory_efficient``, from the
saved output: ``xhat = (y - bias) / weight`` (this needs a weight without zeros).
"""

from __future__ import annotations

import math

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_shape(shape, ndim: int) -> tuple:
    """The shape of per-row statistics broadcast against a tensor of ``shape``."""
    return (*shape[: len(shape) - ndim], *([1] * ndim))


def norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    ndim: int,
    eps: float,
    rms: bool,
    output_dtype: torch.dtype,
    residual: torch.Tensor | None = None,
):
    """Returns ``(output, residual_out or None, mean or None, rstd)``; mean and rstd have the
    input's leading shape and the compute dtype."""
    cdt = compute_dtype(x.dtype)
    residual_out = None
    if residual is not None:
        residual_out = (x.to(cdt) + residual.to(cdt)).to(x.dtype)
        x = residual_out
    xf = x.to(cdt)
    dims = tuple(range(-ndim, 0))
    if rms:
        mean = None
        centered = xf
    else:
        mean = xf.mean(dims, keepdim=True)
        centered = xf - mean
    var = centered.square().mean(dims, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    y = centered * rstd
    if weight is not None:
        y = y * weight.to(cdt)
    if bias is not None:
        y = y + bias.to(cdt)
    lead = x.shape[: x.dim() - ndim]
    return (
        y.to(output_dtype),
        residual_out,
        None if mean is None else mean.reshape(lead),
        rstd.reshape(lead),
    )


def _sum_rows(t: torch.Tensor, ndim: int) -> torch.Tensor:
    lead = tuple(range(t.dim() - ndim))
    return t.sum(lead) if lead else t  # sum(()) would reduce every dimension


def norm_backward(
    grad_output: torch.Tensor,
    saved: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    ndim: int,
    rms: bool,
    memory_efficient: bool,
    input_dtype: torch.dtype,
    weight_grads: bool = True,
    grad_residual_out: torch.Tensor | None = None,
):
    """Returns ``(grad_input, grad_weight or None, grad_bias or None)``.

    ``saved`` is the input (or the residual sum) normally, the output with ``memory_efficient``;
    ``grad_residual_out``, the gradient of the returned residual sum, is added to ``grad_input``.
    """
    cdt = compute_dtype(input_dtype)
    row_shape = _row_shape(saved.shape, ndim)
    rstd_b = rstd.to(cdt).reshape(row_shape)
    dy = grad_output.to(cdt)
    w = None if weight is None else weight.to(cdt)
    if memory_efficient:
        xhat = saved.to(cdt)
        if bias is not None:
            xhat = xhat - bias.to(cdt)
        if w is not None:
            xhat = xhat / w
    else:
        xf = saved.to(cdt)
        xhat = (xf if rms else xf - mean.to(cdt).reshape(row_shape)) * rstd_b
    wdy = dy if w is None else dy * w
    dims = tuple(range(-ndim, 0))
    hidden = math.prod(saved.shape[saved.dim() - ndim :])
    projection = (wdy * xhat).sum(dims, keepdim=True) / hidden
    inner = wdy - xhat * projection
    if not rms:
        inner = inner - wdy.sum(dims, keepdim=True) / hidden
    grad_input = rstd_b * inner
    if grad_residual_out is not None:
        grad_input = grad_input + grad_residual_out.to(cdt)
    grad_weight = grad_bias = None
    if weight_grads and weight is not None:
        grad_weight = _sum_rows(dy * xhat, ndim).to(weight.dtype)
        if bias is not None:
            grad_bias = _sum_rows(dy, ndim).to(bias.dtype)
    return grad_input.to(input_dtype), grad_weight, grad_bias


# The CPU path ----------------------------------------------------------------------------------
# The functions above are the specification (and what double backward and ONNX export trace, as
# they are plain differentiable torch ops). The ops' reference kernels call the two below, which
# give the same results through PyTorch's fused CPU kernels where one exists (native_layer_norm,
# its backward), or through few passes (RMS norm): the spec's chain of elementwise passes was 5-7x
# slower than torch.nn.LayerNorm at 65536x512. Statistics come back as the spec's (float32,
# float64 for float64 input), the rounding is the spec's (one rounding of the output).


def fast_norm_forward(x, weight, bias, ndim, eps, rms, output_dtype, residual=None):
    """:func:`norm_forward` through ``torch.native_layer_norm``, or :func:`_rms_forward`."""
    if _tiny(x, ndim):
        return norm_forward(x, weight, bias, ndim, eps, rms, output_dtype, residual)
    residual_out = None
    if residual is not None:
        residual_out = x + residual  # computed in float32 and rounded once, as the spec's sum
        x = residual_out
    xin = x if output_dtype == x.dtype else x.to(output_dtype)  # mixed: the output in the weight's dtype
    shape = list(x.shape[x.dim() - ndim :])
    lead = x.shape[: x.dim() - ndim]
    weight, bias = _params_for(xin, weight, bias, shape, fill=not rms)
    if rms:
        y, rstd = _rms_forward(xin, shape, weight, eps)
        return y, residual_out, None, rstd.reshape(lead)
    y, mean, rstd = torch.native_layer_norm(xin, shape, weight, bias, eps)
    return y, residual_out, mean.reshape(lead), rstd.reshape(lead)


def fast_norm_backward(
    grad_output,
    saved,
    weight,
    bias,
    mean,
    rstd,
    ndim,
    rms,
    memory_efficient,
    input_dtype,
    weight_grads=True,
    grad_residual_out=None,
):
    """:func:`norm_backward`; layer norm through ``native_layer_norm_backward``. With
    ``memory_efficient`` it is given the recomputed ``xhat`` as the input with mean 0 and rstd 1,
    and its input gradient is scaled by rstd afterwards."""
    if _tiny(saved, ndim):
        return norm_backward(
            grad_output,
            saved,
            weight,
            bias,
            mean,
            rstd,
            ndim,
            rms,
            memory_efficient,
            input_dtype,
            weight_grads,
            grad_residual_out,
        )
    cdt = compute_dtype(input_dtype)
    row_shape = _row_shape(saved.shape, ndim)
    shape = list(saved.shape[saved.dim() - ndim :])
    with_weight = weight_grads and weight is not None
    if memory_efficient:
        xhat = saved.to(cdt)
        if bias is not None:
            xhat = xhat - bias
        if weight is not None:
            xhat = xhat / weight
        x, stat_mean, stat_rstd = xhat, None, torch.ones(row_shape, dtype=cdt, device=saved.device)
    else:
        x, stat_rstd = saved, rstd.reshape(row_shape)
        stat_mean = None if rms else mean.reshape(row_shape)
        if rms and saved.dtype != cdt:
            x = saved.to(cdt)
    dy = grad_output  # a float16/bfloat16 x (layer norm) is converted with dy chunk by chunk
    if dy.dtype != x.dtype and x.dtype in (torch.float32, torch.float64):
        dy = dy.to(x.dtype)
    weight_dtype = None if weight is None else weight.dtype
    bias_dtype = None if bias is None else bias.dtype
    weight, bias = _params_for(x, weight, bias, shape)
    if rms:
        grad_input, grad_weight = _rms_backward(dy, x, stat_rstd, weight, ndim, with_weight)
        grad_bias = None
    else:
        if stat_mean is None:
            stat_mean = torch.zeros_like(stat_rstd)
        mask = [True, with_weight, with_weight and bias is not None]
        grad_input, grad_weight, grad_bias = _layer_norm_backward(
            dy, x, shape, stat_mean, stat_rstd, weight, bias, mask
        )
    if memory_efficient or grad_residual_out is not None or grad_input.dtype != input_dtype:
        grad_input = grad_input.to(cdt)
        if memory_efficient:
            grad_input = grad_input * rstd.to(cdt).reshape(row_shape)
        if grad_residual_out is not None:
            grad_input = grad_input + grad_residual_out
        grad_input = grad_input.to(input_dtype)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight_dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias_dtype)
    return grad_input, grad_weight, grad_bias


# float32 elements converted at a time: 2 MiB a buffer. On the 2-core dev machine (interleaved A/B
# in one process, bf16 rows with weight and bias, forward+backward against PyTorch's): with the
# chunk loop down to two copies and the kernel per chunk (2026-12-04), 1 << 19 was faster than
# 1 << 18 in 9 of 9 comparisons over three runs at 2048 x 1024, 16384 x 1024 and 8192 x 4096
# (1.13-1.28x PyTorch against 1.29-1.50x at 2048 rows), 1 << 20 was mixed and 1 << 21 slower
# (2.5x at 2048 rows: the buffers no longer stay in cache). With the loop's earlier per-chunk
# views and adds, 1 << 18 had been the best and 1 << 20 1.42-1.95x PyTorch at 2048 rows.
_CHUNK_ELEMENTS = 1 << 19


def _layer_norm_backward(dy, x, shape, mean, rstd, weight, bias, mask):
    """``native_layer_norm_backward``. For weight gradients of float16/bfloat16 rows, PyTorch's
    reduced-precision CPU kernel sums the weight gradient inexactly (off by 57 at a magnitude of
    about 300 for 16384 bf16 rows of 1024, with float32 or bfloat16 weights; 0.5 of 158 on 16
    rows): its input gradient is kept, and the weight and bias gradients come from its float32
    kernel on the rows converted to float32 a chunk at a time. With a float32 grad_output, that
    kernel gives every gradient (converting the whole tensors first would cost two more passes over
    memory)."""
    direct = x.dtype in (torch.float32, torch.float64) or (dy.dtype == x.dtype and not (mask[1] or mask[2]))
    if direct:
        return torch.ops.aten.native_layer_norm_backward(dy, x, shape, mean, rstd, weight, bias, mask)
    hidden = math.prod(shape)
    x2, dy2 = x.reshape(-1, hidden), dy.reshape(-1, hidden)
    rows = x2.shape[0]
    step = max(1, _CHUNK_ELEMENTS // hidden)
    stat_shape = [-1] + [1] * len(shape)
    # two float32 buffers reused by every chunk (a fresh 4 MiB tensor per chunk costs more in page
    # faults than converting into it does), as [rows, *shape] views for the last chunk and the others
    d_buffer = torch.empty(min(step, rows), *shape, dtype=torch.float32, device=x.device)
    x_buffer = torch.empty_like(d_buffer)
    if dy.dtype == x.dtype:
        # The input gradient from PyTorch's 16-bit kernel (its row sums are exact enough); the
        # weight gradients from its float32 kernel told to skip the input gradient, a chunk at a
        # time: two conversions and one fused pass per chunk (summing them here in float32
        # passes took 1.3-2.6x PyTorch's whole backward).
        grad_input = None
        if mask[0]:
            grad_input = torch.ops.aten.native_layer_norm_backward(
                dy, x, shape, mean, rstd, weight, bias, [True, False, False]
            )[0]
        chunk_mask = [False, mask[1], mask[2]]
        input_chunks = None
    else:
        grad_input = torch.empty_like(x2) if mask[0] else None
        chunk_mask = mask
        input_chunks = grad_input.split(step) if mask[0] else None
    # The chunks' views made by four splits and the buffers' views made once, not in the loop: the
    # loop's work per chunk is two copies and PyTorch's kernel (its host time showed at 8-16 chunks
    # of 256 rows, where the whole backward takes about a millisecond); the chunks' weight and bias
    # gradients are summed once at the end.
    chunks = zip(
        dy2.split(step), x2.split(step), mean.reshape(stat_shape).split(step), rstd.reshape(stat_shape).split(step)
    )
    full = d_buffer.shape[0]
    views = (d_buffer.view(full, hidden), x_buffer.view(full, hidden), d_buffer, x_buffer)
    weight_parts, bias_parts = [], []
    for i, (dy_rows, x_rows, mean_rows, rstd_rows) in enumerate(chunks):
        count = dy_rows.shape[0]
        if count == full:
            d_rows, x_flat, d_view, x_view = views
        else:  # the last chunk
            d_view, x_view = d_buffer[:count], x_buffer[:count]
            d_rows, x_flat = d_view.view(count, hidden), x_view.view(count, hidden)
        d_rows.copy_(dy_rows)
        x_flat.copy_(x_rows)
        gi, gw, gb = torch.ops.aten.native_layer_norm_backward(
            d_view, x_view, shape, mean_rows, rstd_rows, weight, bias, chunk_mask
        )
        if input_chunks is not None:
            input_chunks[i].copy_(gi.view(count, hidden))
        if gw is not None:
            weight_parts.append(gw)
        if gb is not None:
            bias_parts.append(gb)
    grad_weight = _summed(weight_parts)
    grad_bias = _summed(bias_parts)
    if input_chunks is not None:
        grad_input = grad_input.view(x.shape)
    if rows == 0:
        grad_weight = torch.zeros(shape, dtype=torch.float32, device=x.device) if mask[1] else None
        grad_bias = torch.zeros(shape, dtype=torch.float32, device=x.device) if mask[2] else None
    return grad_input, grad_weight, grad_bias


def _summed(parts: list):
    """The sum of equally shaped tensors (None for none)."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    return torch.stack(parts).sum(0)


def _tiny(x, ndim) -> bool:
    """Rows too short to matter for speed: the spec then (PyTorch's mean of one element is off by
    an ulp, which rstd = 1/sqrt(eps) magnifies)."""
    return math.prod(x.shape[x.dim() - ndim :]) < 32


def _params_for(x, weight, bias, shape, fill=True):
    """The parameters as PyTorch's kernels take them with ``x``: in x's dtype, or float32 for
    float16/bfloat16 x, whose statistics PyTorch then keeps in float32 as the spec does (float32
    ones stand in for a missing layer norm weight there). The spec computes with float32 parameters anyway."""
    target = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    if weight is None:
        return (x.new_ones(shape, dtype=target) if fill and target != x.dtype else None), bias
    if weight.dtype != target:
        weight = weight.to(target)
        bias = None if bias is None else bias.to(target)
    return weight, bias


def _rms_forward(x, shape, weight, eps):
    """RMS norm's output and rstd with one full-size allocation (16-bit input: its float32 copy,
    scaled in place, and the output): the sums of squares without a temporary (below), then ``x *
    rstd`` and the weight in place. PyTorch's CPU ``rms_norm`` / ``_fused_rms_norm`` chains ``pow``,
    ``mean``, ``mul``, ``mul`` with three full-size temporaries: 0.76 ms against 0.49 ms here at
    2048x16x64 float32, one thread."""
    cdt = compute_dtype(x.dtype)
    xf = x if x.dtype == cdt else x.to(cdt)
    lead = x.shape[: x.dim() - len(shape)]
    n = math.prod(shape)
    rstd = _sums_of_squares(xf.reshape(*lead, n)).div_(n).add_(eps).rsqrt_()  # n, not -1: empty batches
    rstd = rstd.reshape(*lead, *([1] * len(shape)))
    y = xf * rstd if xf is x else xf.mul_(rstd)
    if weight is not None:
        y.mul_(weight)
    return (y if y.dtype == x.dtype else y.to(x.dtype)), rstd


_SQUARES_BLOCK = 256


def _sums_of_squares(rows):
    """Each row's sum of squares, ``[..., n] -> [...]``, in one pass without a full-size temporary:
    ``vector_norm`` squared, over blocks of 256 elements whose results are then added. Over a whole
    row of 16384, ``vector_norm``'s running sums were off by 3.4e-6 relative (blocks: 9e-8), and a
    square root squared back costs an ulp."""
    n = rows.shape[-1]
    whole = n - n % _SQUARES_BLOCK
    if whole < 2 * _SQUARES_BLOCK:
        return torch.linalg.vector_norm(rows, 2, dim=-1).square_()
    blocks = rows[..., :whole].unflatten(-1, (whole // _SQUARES_BLOCK, _SQUARES_BLOCK))
    sums = torch.linalg.vector_norm(blocks, 2, dim=-1).square_().sum(-1)
    if whole < n:
        sums += torch.linalg.vector_norm(rows[..., whole:], 2, dim=-1).square_()
    return sums


def _rms_backward(dy, x, rstd, weight, ndim, with_weight):
    """RMS norm's backward (PyTorch has no CPU kernel for it) in few passes: ``dx = rstd * (wdy -
    xhat * mean(wdy * xhat))`` with ``xhat * mean(wdy * xhat) = x * rstd^2 * mean(wdy * x)``."""
    cdt = compute_dtype(x.dtype)
    dims = tuple(range(-ndim, 0))
    xf = x.to(cdt)
    dyf = dy.to(cdt)
    wdy = dyf if weight is None else dyf * weight.to(cdt)
    hidden = math.prod(x.shape[x.dim() - ndim :])
    rstd = rstd.to(cdt)
    coef = (wdy * xf).sum(dims, keepdim=True).mul_(rstd * rstd / hidden)
    # wdy is grad_output itself when there is no weight and no cast: not updated in place then
    grad_input = (wdy.sub_(xf * coef) if weight is not None else wdy - xf * coef).mul_(rstd)
    grad_weight = _sum_rows(dyf * xf * rstd, ndim) if with_weight else None
    return grad_input.to(x.dtype), grad_weight
