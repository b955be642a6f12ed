"""The top-level ``mlp_cuda`` module upstream's build installed: its functions, argument orders and
returns, against the public API's results, on the CPU (references) and CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from apex.mlp import MLP
from apex.mlp import mlp as mlp_module


@pytest.fixture(autouse=True)
def _ops_off_cuda(monkeypatch):
    """The module through the ops (as mlp_cuda), not torch's default CPU path."""
    monkeypatch.setattr(mlp_module, "_TORCH_OFF_CUDA", False)


def test_fresh_interpreter_import():
    code = (
        "import mlp_cuda as m, sys; "
        "missing = [f for f in ('forward', 'backward') if not callable(getattr(m, f, None))]; "
        "print(missing); sys.exit(1 if missing else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("activation", ["none", "relu", "sigmoid"])
def test_forward_and_backward_match_the_module(device, bias, activation):
    import mlp_cuda

    torch.manual_seed(0)
    mlp = MLP([12, 9, 5], bias=bias, activation=activation).to(device=device, dtype=torch.float64)
    x = torch.randn(7, 12, device=device, dtype=torch.float64, requires_grad=True)
    y = mlp(x)
    dy = torch.randn_like(y)
    y.backward(dy)

    inputs = [x.detach(), *(p.detach() for p in (*mlp.weights, *mlp.biases))]
    fwd_outputs = mlp_cuda.forward(int(bias), mlp.activation, inputs)
    assert len(fwd_outputs) == 2
    torch.testing.assert_close(fwd_outputs[0], y.detach(), rtol=1e-12, atol=1e-12)
    # the reserved space: every layer's output, flat, layer after layer
    assert fwd_outputs[1].shape == (7 * 9 + 7 * 5,)
    torch.testing.assert_close(fwd_outputs[1][7 * 9 :].view(7, 5), y.detach(), rtol=0, atol=0)

    grads = mlp_cuda.backward(int(bias), mlp.activation, dy, fwd_outputs, inputs)
    expected = [x.grad, *(p.grad for p in (*mlp.weights, *mlp.biases))]
    assert len(grads) == len(inputs)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
