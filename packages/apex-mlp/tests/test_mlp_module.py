"""apex.mlp.MLP and mlp_function: upstream's parameters, initialisation, activations and codes, the
same results as nn.Sequential(nn.Linear, activation, ...), autocast, and module conversions."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from apex.core.testing import graph_reaches
from apex.mlp import MLP, MlpFunction, mlp_function
from apex.mlp import mlp as mlp_module

ACTIVATION_MODULES = {"none": nn.Identity, "relu": nn.ReLU, "sigmoid": nn.Sigmoid}


@pytest.fixture(autouse=True)
def _ops_off_cuda(monkeypatch):
    """Off CUDA the MLP takes torch's linear layers by default; these tests run the ops' references
    there (test_mlp_module.test_off_cuda_the_mlp_is_torchs checks the default)."""
    monkeypatch.setattr(mlp_module, "_TORCH_OFF_CUDA", False)


@pytest.fixture(autouse=True)
def no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def test_parameters_have_upstreams_names_and_shapes():
    mlp = MLP([5, 7, 3])
    shapes = {name: tuple(p.shape) for name, p in mlp.named_parameters()}
    assert shapes == {"weight_0": (7, 5), "bias_0": (7,), "weight_1": (3, 7), "bias_1": (3,)}
    assert mlp.weights[1] is mlp.weight_1 and mlp.biases[0] is mlp.bias_0
    assert (mlp.num_layers, mlp.bias, mlp.activation, mlp.mlp_sizes) == (2, 1, 1, [5, 7, 3])
    no_bias = MLP([5, 7, 3], bias=False, activation="sigmoid")
    assert [name for name, _ in no_bias.named_parameters()] == ["weight_0", "weight_1"]
    assert (no_bias.bias, no_bias.activation, no_bias.biases) == (0, 2, [])
    assert MLP([4, 4], activation="none").activation == 0


def test_initialisation_follows_upstream():
    torch.manual_seed(0)
    mlp = MLP([1024, 2048, 512])
    for w in mlp.weights:  # N(0, sqrt(2 / (fan_in + fan_out))): over 10^6 samples the std is within 1%
        assert abs(w.std().item() / math.sqrt(2 / sum(w.shape)) - 1) < 0.01
        assert abs(w.mean().item()) < 0.01 * w.std().item()
    for b in mlp.biases:  # N(0, sqrt(1 / fan_out)), 512 or 2048 samples: within 10%
        assert abs(b.std().item() / math.sqrt(1 / b.numel()) - 1) < 0.1


def test_unknown_activation_names_the_allowed_values():
    with pytest.raises(TypeError, match="activation must be one of 'none', 'relu', 'sigmoid', got 'gelu'"):
        MLP([4, 4], activation="gelu")


def sequential_like(mlp, activation):
    layers = []
    for i, w in enumerate(mlp.weights):
        linear = nn.Linear(w.shape[1], w.shape[0], bias=bool(mlp.bias), dtype=w.dtype, device=w.device)
        with torch.no_grad():
            linear.weight.copy_(w)
            if mlp.bias:
                linear.bias.copy_(mlp.biases[i])
        layers += [linear, ACTIVATION_MODULES[activation]()]
    return nn.Sequential(*layers)


@pytest.mark.parametrize("activation", list(ACTIVATION_MODULES))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_same_as_sequential(device, activation, bias, dtype):
    torch.manual_seed(0)
    mlp = MLP([24, 40, 17, 8], bias=bias, activation=activation).to(device=device, dtype=dtype)
    reference = sequential_like(mlp, activation)
    x = torch.randn(19, 24, device=device, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = mlp(x1), reference(x2)
    dy = torch.randn_like(y1)
    y1.backward(dy)
    y2.backward(dy)
    tol = {torch.float64: 1e-12, torch.float32: 2e-5}[dtype]
    torch.testing.assert_close(y1, y2, rtol=tol, atol=tol)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=tol, atol=tol)
    ours = [p.grad for p in (*mlp.weights, *mlp.biases)]
    theirs = [m.weight.grad for m in reference if isinstance(m, nn.Linear)]
    theirs += [m.bias.grad for m in reference if isinstance(m, nn.Linear) and bias]
    for got, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_input_without_gradient_gives_parameter_gradients(device):
    mlp = MLP([8, 6, 4]).to(device)
    mlp(torch.randn(5, 8, device=device)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mlp.parameters())


def test_module_conversions_keep_the_lists_on_the_parameters(device):
    mlp = MLP([8, 6, 4]).to(device=device, dtype=torch.float64)
    assert [p.dtype for p in (*mlp.weights, *mlp.biases)] == [torch.float64] * 4
    assert mlp.weights[0] is mlp.weight_0 and mlp.biases[1] is mlp.bias_1
    mlp.load_state_dict({k: torch.ones_like(v) for k, v in mlp.state_dict().items()})
    assert bool((mlp.weights[0] == 1).all())


def test_autocast_casts_the_arguments(device):
    dtype = torch.bfloat16
    mlp = MLP([16, 8, 4]).to(device)
    x = torch.randn(3, 16, device=device)
    with torch.autocast(device_type=device, dtype=dtype):
        y = mlp(x)
    assert y.dtype == dtype
    expected = mlp_function(1, 1, x.to(dtype), *(p.to(dtype) for p in (*mlp.weights, *mlp.biases)))
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    # outside autocast: float32 in, float32 out; a dtype mismatch is an error naming the tensor
    assert mlp(x).dtype == torch.float32
    with pytest.raises(TypeError, match=r"weights\[0\] has dtype torch.float32; expected torch.bfloat16"):
        mlp(x.to(dtype))


def test_mlp_function_and_upstreams_apply(device):
    mlp = MLP([6, 5, 3], activation="sigmoid").to(device)
    x = torch.randn(4, 6, device=device)
    params = (*mlp.weights, *mlp.biases)
    torch.testing.assert_close(mlp_function(1, 2, x, *params), mlp(x))
    torch.testing.assert_close(MlpFunction.apply(1, 2, x, *params), mlp(x))
    # a non-contiguous input goes through mlp_function (made contiguous)
    wide = torch.randn(6, 4, device=device).t()
    torch.testing.assert_close(mlp(wide), mlp(wide.contiguous()))


def test_repr_and_input_errors():
    mlp = MLP([3, 2])
    assert "MLP sizes: [3, 2], Bias=1, activation=1" in repr(mlp)
    with pytest.raises(ValueError, match=r"input must be 2-D, got shape \(2, 2, 3\)"):
        mlp(torch.randn(2, 2, 3))
    with pytest.raises(ValueError, match=r"weights\[0\] has shape \(2, 3\); expected 4 columns \(the input's"):
        mlp(torch.randn(2, 4))
    with pytest.raises(ValueError, match="mlp_sizes must hold at least two sizes"):
        MLP([3])


@pytest.mark.parametrize("activation", list(ACTIVATION_MODULES))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_off_cuda_the_mlp_is_torchs(monkeypatch, activation, bias, dtype):
    """The default CPU path (torch's linear layers and autograd) against float64 and the ops' path,
    with the ops' errors."""
    torch.manual_seed(0)
    mlp = MLP([24, 40, 17, 8], bias=bias, activation=activation).to(dtype=dtype)
    x = torch.randn(19, 24, dtype=dtype)
    dy = torch.randn(19, 8, dtype=dtype)
    params = (*mlp.weights, *mlp.biases)
    results = {}
    for default in (True, False):
        monkeypatch.setattr(mlp_module, "_TORCH_OFF_CUDA", default)
        xg = x.clone().requires_grad_()
        y = mlp(xg)
        assert graph_reaches(y.grad_fn, "Mlp") != default, y.grad_fn
        results[default] = (y, *torch.autograd.grad(y, (xg, *params), dy))
    monkeypatch.setattr(mlp_module, "_TORCH_OFF_CUDA", True)
    reference = sequential_like(mlp.to(torch.float64), activation)
    mlp.to(dtype)
    x64 = x.double().requires_grad_()
    y64 = reference(x64)
    linears = [m for m in reference if isinstance(m, nn.Linear)]
    expected = (
        y64,
        *torch.autograd.grad(y64, (x64, *(m.weight for m in linears), *(m.bias for m in linears if bias)), dy.double()),
    )
    tol = {torch.float32: 2e-5, torch.bfloat16: 3e-2}[dtype]
    for got, ops, want in zip(results[True], results[False], expected, strict=True):
        assert got.dtype == dtype
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale)
        torch.testing.assert_close(got, ops, rtol=tol, atol=tol * scale)
    with pytest.raises(TypeError, match=r"mlp_forward: weights\[0\] has dtype"):
        mlp(x.double())
    assert torch.equal(MlpFunction.apply(int(bias), mlp.activation, x, *params), mlp(x))
