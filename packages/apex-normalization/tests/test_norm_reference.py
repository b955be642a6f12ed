"""The PyTorch reference (``_reference.py``), the specification of the kernels, checked on its own.

Its backward is a hand-written formula, so ``gradcheck`` differentiates its forward numerically
in float64 and compares, for every variant: layer norm and RMS norm, with and without affine
parameters, from the saved input or (memory_efficient) the saved output, with a residual.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from apex.normalization import _reference


class ReferenceNorm(torch.autograd.Function):
    """The reference forward and backward as an autograd function (float64 for gradcheck)."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, ndim, eps, rms, memory_efficient):
        out, total, mean, rstd = _reference.norm_forward(x, weight, bias, ndim, eps, rms, x.dtype, residual)
        ctx.save_for_backward(out if memory_efficient else (x if total is None else total), weight, bias, mean, rstd)
        ctx.config = (ndim, rms, memory_efficient, x.dtype, residual is not None)
        return (out, total) if total is not None else out

    @staticmethod
    def backward(ctx, grad_out, grad_total=None):
        saved, weight, bias, mean, rstd = ctx.saved_tensors
        ndim, rms, memory_efficient, dtype, has_residual = ctx.config
        dx, dw, db = _reference.norm_backward(
            grad_out, saved, weight, bias, mean, rstd, ndim, rms, memory_efficient, dtype, True, grad_total
        )
        return dx, dx if has_residual else None, dw, db, None, None, None, None


def _inputs(shape, ndim, affine, bias, residual):
    normalized = shape[len(shape) - ndim :]
    x = (torch.randn(shape, dtype=torch.float64) * 2 + 0.5).requires_grad_()
    r = torch.randn(shape, dtype=torch.float64, requires_grad=True) if residual else None
    w = (torch.rand(normalized, dtype=torch.float64) + 0.5).requires_grad_() if affine else None
    b = torch.randn(normalized, dtype=torch.float64, requires_grad=True) if affine and bias else None
    return x, r, w, b


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves-input", "memory-efficient"])
@pytest.mark.parametrize(
    ("rms", "affine"),
    [(False, "none"), (False, "weight"), (False, "weight+bias"), (True, "none"), (True, "weight")],
    ids=["layer", "layer-weight", "layer-weight+bias", "rms", "rms-weight"],
)
@pytest.mark.parametrize(("shape", "ndim"), [((3, 5), 1), ((2, 3, 4), 2), ((6,), 1)], ids=["3x5", "2x3x4-n2", "6"])
def test_reference_backward_is_the_gradient(shape, ndim, rms, affine, memory_efficient, residual):
    x, r, w, b = _inputs(shape, ndim, affine != "none", affine == "weight+bias", residual)
    args = [t for t in (x, r, w, b) if t is not None]

    def fn(*tensors):
        it = iter(tensors)
        xs, rs = next(it), next(it) if residual else None
        ws = next(it) if w is not None else None
        bs = next(it) if b is not None else None
        return ReferenceNorm.apply(xs, rs, ws, bs, ndim, 1e-5, rms, memory_efficient)

    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_reference_forward_matches_torch(rms):
    x = torch.randn(7, 3, 10, dtype=torch.float64)
    w = torch.randn(3, 10, dtype=torch.float64)
    b = None if rms else torch.randn(3, 10, dtype=torch.float64)
    out, _, mean, rstd = _reference.norm_forward(x, w, b, 2, 1e-5, rms, torch.float64)
    if rms:
        expected = F.rms_norm(x, (3, 10), w, 1e-5)
        assert mean is None
    else:
        expected = F.layer_norm(x, (3, 10), w, b, 1e-5)
        torch.testing.assert_close(mean, x.mean((-2, -1)))
    torch.testing.assert_close(out, expected)
    assert rstd.shape == (7,)


def test_reference_computes_low_precision_in_float32():
    x = (torch.randn(4, 64) * 3 + 100).to(torch.bfloat16)
    out, _, mean, rstd = _reference.norm_forward(x, None, None, 1, 1e-5, False, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and mean.dtype == torch.float32 and rstd.dtype == torch.float32
    torch.testing.assert_close(mean.double(), x.double().mean(-1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dy_dtype", [torch.bfloat16, torch.float32], ids=["dy-bf16", "dy-fp32"])
@pytest.mark.parametrize("rows", [10, 9, 3, 0], ids=lambda r: f"{r}rows")
def test_chunked_16_bit_layer_norm_backward_matches_float64(monkeypatch, dy_dtype, rows):
    # The CPU layer norm backward of 16-bit rows converts them to float32 a chunk of rows at a time
    # (_reference._CHUNK_ELEMENTS, here 3 rows): full chunks, a short last one, a single short
    # chunk and no rows; every gradient against float64, and the same as with one chunk.
    hidden = 48
    monkeypatch.setattr(_reference, "_CHUNK_ELEMENTS", 3 * hidden)
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=g) * 2 + 1).bfloat16()
    dy = torch.randn(rows, hidden, generator=g).to(dy_dtype)
    weight, bias = torch.randn(hidden, generator=g), torch.randn(hidden, generator=g)
    _, mean, rstd = torch.native_layer_norm(x, [hidden], weight, bias, 1e-5)
    mask = [True, True, True]
    got = _reference._layer_norm_backward(dy, x, [hidden], mean, rstd, weight, bias, mask)
    args = (x.double(), [hidden], mean.double(), rstd.double(), weight.double(), bias.double(), mask)
    expected = torch.ops.aten.native_layer_norm_backward(dy.double(), *args)
    for name, a, e in zip(("input", "weight", "bias"), got, expected):
        # The input gradient in x's dtype (bf16: two ulps), the weight and bias sums in float32.
        assert a.dtype == (torch.bfloat16 if name == "input" else torch.float32), name
        tol = 2 * 2**-8 if name == "input" else 1e-5
        scale = max(e.abs().max().item(), 1.0) if e.numel() else 1.0
        torch.testing.assert_close(a.double(), e, rtol=tol, atol=tol * scale)
    monkeypatch.setattr(_reference, "_CHUNK_ELEMENTS", 1 << 19)
    whole = _reference._layer_norm_backward(dy, x, [hidden], mean, rstd, weight, bias, mask)
    for a, w in zip(got, whole):
        torch.testing.assert_close(a, w, rtol=1e-6, atol=1e-6)
