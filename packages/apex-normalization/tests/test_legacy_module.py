"""The top-level ``fused_layer_norm_cuda`` module upstream's build installed: its functions, argument
orders, returns and dtypes, against the public API's results, on the CPU (references) and CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from apex.normalization import functional as AF

FUNCTIONS = [
    "forward_affine",
    "forward",
    "backward_affine",
    "backward",
    "forward_affine_mixed_dtypes",
    "rms_forward_affine",
    "rms_forward",
    "rms_backward_affine",
    "rms_backward",
    "rms_forward_affine_mixed_dtypes",
]
SHAPE = (6, 5, 24)
NORMALIZED = [24]
EPS = 1e-5
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float64: 1e-10}


def test_fresh_interpreter_import():
    code = (
        "import fused_layer_norm_cuda as m, sys; "
        f"missing = [f for f in {FUNCTIONS!r} if not callable(getattr(m, f, None))]; "
        "print(missing); sys.exit(1 if missing else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def close(a, b, dtype, factor=1.0):
    tol = TOL[dtype] * factor
    torch.testing.assert_close(
        a.float() if a.dtype != torch.float64 else a, b.float() if b.dtype != torch.float64 else b, atol=tol, rtol=tol
    )


def data(device, dtype, weight_dtype=None):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE, generator=gen).to(device, dtype)
    w = (torch.rand(NORMALIZED, generator=gen) + 0.5).to(device, weight_dtype or dtype)
    b = torch.randn(NORMALIZED, generator=gen).to(device, weight_dtype or dtype)
    return x, w, b


def stats_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def grads(fn, x, *params, dy):
    leaves = [t.detach().requires_grad_() for t in (x, *params)]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, dy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("memory_efficient", [False, True], ids=["input", "memory-efficient"])
def test_layer_norm_functions(device, dtype, memory_efficient):
    import fused_layer_norm_cuda as m

    x, w, b = data(device, dtype)
    out, mean, invvar = m.forward_affine(x, NORMALIZED, w, b, EPS)
    assert out.dtype == dtype and mean.dtype == invvar.dtype == stats_dtype(dtype)
    assert mean.shape == invvar.shape == (30,)
    dy = torch.randn_like(out)
    ref, (gx, gw, gb) = grads(lambda x, w, b: AF.fused_layer_norm_affine(x, w, b, NORMALIZED, EPS), x, w, b, dy=dy)
    close(out, ref, dtype)
    saved = out if memory_efficient else x
    dx, dw, db = m.backward_affine(
        dy, None if memory_efficient else mean, invvar, saved, NORMALIZED, w, b, EPS, memory_efficient
    )
    assert dx.dtype == dtype and dw.dtype == db.dtype == dtype
    factor = 2.0 if memory_efficient else 1.0  # the normalized values recomputed from the rounded output
    close(dx, gx, dtype, factor), close(dw, gw, dtype, factor), close(db, gb, dtype)

    out, mean, invvar = m.forward(x, NORMALIZED, EPS)
    ref, (gx,) = grads(lambda x: AF.fused_layer_norm(x, NORMALIZED, EPS), x, dy=dy)
    close(out, ref, dtype)
    dx = m.backward(dy, mean, invvar, out if memory_efficient else x, NORMALIZED, EPS, memory_efficient)
    assert isinstance(dx, torch.Tensor) and dx.dtype == dtype
    close(dx, gx, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("memory_efficient", [False, True], ids=["input", "memory-efficient"])
def test_rms_norm_functions(device, dtype, memory_efficient):
    import fused_layer_norm_cuda as m

    x, w, _ = data(device, dtype)
    out, invvar = m.rms_forward_affine(x, NORMALIZED, w, EPS)
    assert out.dtype == dtype and invvar.dtype == stats_dtype(dtype) and invvar.shape == (30,)
    dy = torch.randn_like(out)
    ref, (gx, gw) = grads(lambda x, w: AF.fused_rms_norm_affine(x, w, NORMALIZED, EPS), x, w, dy=dy)
    close(out, ref, dtype)
    dx, dw = m.rms_backward_affine(dy, invvar, out if memory_efficient else x, NORMALIZED, w, EPS, memory_efficient)
    # memory_efficient recomputes the normalized values from the rounded output: twice the error
    factor = 2.0 if memory_efficient else 1.0
    close(dx, gx, dtype, factor), close(dw, gw, dtype, factor)

    out, invvar = m.rms_forward(x, NORMALIZED, EPS)
    ref, (gx,) = grads(lambda x: AF.fused_rms_norm(x, NORMALIZED, EPS), x, dy=dy)
    close(out, ref, dtype)
    dx = m.rms_backward(dy, invvar, out if memory_efficient else x, NORMALIZED, EPS, memory_efficient)
    assert isinstance(dx, torch.Tensor)
    close(dx, gx, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_mixed_dtype_functions(device, dtype):
    import fused_layer_norm_cuda as m

    x, w, b = data(device, dtype, torch.float32)
    out, mean, invvar = m.forward_affine_mixed_dtypes(x, NORMALIZED, w, b, EPS)
    assert out.dtype == torch.float32 and mean.dtype == invvar.dtype == torch.float32
    close(out, AF.mixed_dtype_fused_layer_norm_affine(x, w, b, NORMALIZED, EPS), dtype)
    dy = torch.randn_like(out)
    _, (gx, gw, gb) = grads(
        lambda x, w, b: AF.mixed_dtype_fused_layer_norm_affine(x, w, b, NORMALIZED, EPS), x, w, b, dy=dy
    )
    dx, dw, db = m.backward_affine(dy, mean, invvar, x, NORMALIZED, w, b, EPS, False)
    assert dx.dtype == dtype and dw.dtype == torch.float32
    close(dx, gx, dtype), close(dw, gw, dtype), close(db, gb, dtype)

    out, invvar = m.rms_forward_affine_mixed_dtypes(x, NORMALIZED, w, EPS)
    assert out.dtype == torch.float32
    close(out, AF.mixed_dtype_fused_rms_norm_affine(x, w, NORMALIZED, EPS), dtype)
    dy = torch.randn_like(out)
    _, (gx, gw) = grads(lambda x, w: AF.mixed_dtype_fused_rms_norm_affine(x, w, NORMALIZED, EPS), x, w, dy=dy)
    dx, dw = m.rms_backward_affine(dy, invvar, x, NORMALIZED, w, EPS, False)
    close(dx, gx, dtype), close(dw, gw, dtype)


def test_bad_input_names_the_argument():
    import fused_layer_norm_cuda as m

    x, w, b = data("cpu", torch.float32)
    with pytest.raises(ValueError, match="normalized_shape"):
        m.forward_affine(x, [7], w, b, EPS)
    with pytest.raises(TypeError, match="input"):
        m.forward(x.to(torch.int32), NORMALIZED, EPS)
