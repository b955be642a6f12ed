"""The top-level modules upstream's build installed, ``fused_dense_cuda`` and
``fused_weight_gradient_mlp_cuda``: their functions, argument orders and returns, against the
public API, on the CPU (references) and CUDA; importable in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from apex.fused_dense import dense_no_bias_function, fused_dense_function, fused_dense_gelu_dense_function
from apex.fused_dense import fused_dense as fused_dense_module


@pytest.fixture(autouse=True)
def _ops_off_cuda(monkeypatch):
    """The public functions through the ops (as the legacy modules), not torch's default CPU path."""
    monkeypatch.setattr(fused_dense_module, "_TORCH_OFF_CUDA", False)


MODULES = {
    "fused_dense_cuda": [
        "linear_bias_forward",
        "linear_bias_backward",
        "linear_gelu_linear_forward",
        "linear_gelu_linear_backward",
    ],
    "fused_weight_gradient_mlp_cuda": ["wgrad_gemm_accum_fp32", "wgrad_gemm_accum_fp16"],
}


@pytest.mark.parametrize("module", list(MODULES))
def test_fresh_interpreter_import(module):
    code = (
        f"import {module} as m, sys; "
        f"missing = [f for f in {MODULES[module]!r} if not callable(getattr(m, f, None))]; "
        "print(missing); sys.exit(1 if missing else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def data(device, *shapes):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen).to(device) for shape in shapes]


def test_linear_bias_against_the_public_api(device):
    import fused_dense_cuda

    x, w, b, dy = data(device, (6, 5), (3, 5), (3,), (6, 3))
    out = fused_dense_cuda.linear_bias_forward(x, w, b)
    d_input, d_weight, d_bias = fused_dense_cuda.linear_bias_backward(x, w, dy)
    inputs = [t.clone().requires_grad_() for t in (x, w, b)]
    expected = fused_dense_function(*inputs)
    torch.testing.assert_close(out, expected.detach())
    for got, want in zip((d_input, d_weight, d_bias), torch.autograd.grad(expected, inputs, dy)):
        torch.testing.assert_close(got, want)
    # The no-bias function of the public API is the same GEMM.
    torch.testing.assert_close(dense_no_bias_function(x, w) + b, out)


def test_linear_gelu_linear_against_the_public_api(device):
    import fused_dense_cuda

    x, w1, b1, w2, b2, dy = data(device, (6, 5), (8, 5), (8,), (3, 8), (3,), (6, 3))
    output1, output2, gelu_in = fused_dense_cuda.linear_gelu_linear_forward(x, w1, b1, w2, b2)
    grads = fused_dense_cuda.linear_gelu_linear_backward(x, gelu_in, output1, w1, w2, dy)
    assert isinstance(grads, list) and len(grads) == 5
    inputs = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    expected = fused_dense_gelu_dense_function(*inputs)
    torch.testing.assert_close(output2, expected.detach())
    torch.testing.assert_close(gelu_in, torch.nn.functional.linear(x, w1, b1))
    torch.testing.assert_close(output1, torch.nn.functional.gelu(gelu_in, approximate="tanh"))
    for got, want in zip(grads, torch.autograd.grad(expected, inputs, dy)):
        torch.testing.assert_close(got, want)


def test_wgrad_gemm_accum(device):
    import fused_weight_gradient_mlp_cuda as m

    x, dy = (t.bfloat16() for t in data(device, (4, 2, 6), (4, 2, 5)))
    main_grad = torch.ones(5, 6, device=device)
    assert m.wgrad_gemm_accum_fp32(x, dy, main_grad) is None
    expected = 1 + dy.float().reshape(-1, 5).t() @ x.float().reshape(-1, 6)
    torch.testing.assert_close(main_grad, expected)
    half_grad = torch.ones(5, 6, device=device, dtype=torch.bfloat16)
    m.wgrad_gemm_accum_fp16(x, dy, half_grad)
    torch.testing.assert_close(half_grad, expected.bfloat16(), rtol=2e-2, atol=5e-2)
