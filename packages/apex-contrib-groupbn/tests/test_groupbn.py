"""apex.contrib.groupbn.BatchNorm2d_NHWC against a float64 torch batch norm (+ add + ReLU), one process
(the CPU, and CUDA marked gpu): output, every gradient, running and batch statistics, eval, errors."""

from __future__ import annotations

import pytest
import torch

from apex.contrib.groupbn import BatchNorm2d_NHWC
from apex.contrib.groupbn import batch_norm as batch_norm_module

from ._reference import batch_norm_nhwc, close, reference_step

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (N, H, W, C): ordinary, N=1 (with H*W=2), H*W=1, C odd and not a multiple of 8.
SHAPES = [(4, 5, 6, 16), (1, 1, 2, 7), (3, 1, 1, 13), (2, 7, 3, 20)]
MODES = ["plain", "relu", "relu+z"]


def make(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 1.5 + 0.4).to(dtype).to(device)
    z = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device)
    c = shape[-1]
    weight = torch.rand(c, generator=g) + 0.5
    bias = torch.randn(c, generator=g)
    return x, z, dy, weight, bias


def module_with(weight, bias, device, **kwargs):
    m = BatchNorm2d_NHWC(weight.numel(), **kwargs).to(device)
    with torch.no_grad():
        m.weight.copy_(weight)
        m.bias.copy_(bias)
    return m


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_training_step_matches_float64(device, dtype, shape, mode):
    x, z, dy, weight, bias = make(shape, dtype, device)
    relu, with_z = mode != "plain", mode == "relu+z"
    m = module_with(weight, bias, device, fuse_relu=relu)
    xr = x.clone().requires_grad_()
    zr = z.clone().requires_grad_() if with_z else None
    y = m(xr, zr) if with_z else m(xr)
    assert (y.shape, y.dtype, y.device) == (x.shape, x.dtype, x.device)
    y.backward(dy)
    c = shape[-1]
    rm, rv = torch.zeros(c, dtype=torch.float64), torch.ones(c, dtype=torch.float64)
    ref = reference_step(x.cpu(), z.cpu() if with_z else None, dy.cpu(), weight, bias, rm, rv, relu=relu)
    close(y, ref["y"], dtype, "y")
    close(xr.grad, ref["dx"], dtype, "grad x")
    if with_z:
        close(zr.grad, ref["dz"], dtype, "grad z")
    close(m.weight.grad, ref["dweight"], dtype, "grad weight")
    close(m.bias.grad, ref["dbias"], dtype, "grad bias")
    close(m.running_mean, rm, dtype, "running_mean")
    close(m.running_var, rv, dtype, "running_var")
    close(m.minibatch_mean, ref["mean"], dtype, "minibatch_mean")
    close(m.minibatch_riv, ref["invstd"], dtype, "minibatch_riv")
    assert m.weight.dtype == torch.float32 and m.minibatch_mean.dtype == torch.float32


@pytest.mark.parametrize("momentum", [0.1, 0.3, None])
def test_running_statistics_after_several_steps_and_eval(device, momentum):
    shape = (3, 4, 5, 11)
    _, z, _, weight, bias = make(shape, torch.float32, device)
    m = module_with(weight, bias, device, fuse_relu=True)
    m.momentum = momentum
    rm, rv = torch.zeros(11, dtype=torch.float64), torch.ones(11, dtype=torch.float64)
    for step in range(4):
        x = make(shape, torch.float32, device, seed=10 + step)[0]
        m(x, z)
        factor = 1.0 / (step + 1) if momentum is None else momentum
        batch_norm_nhwc(x.cpu(), None, weight, bias, rm, rv, factor, 1e-5, False, True)
    assert m.num_batches_tracked.item() == 4
    close(m.running_mean, rm, torch.float32, "running_mean")
    close(m.running_var, rv, torch.float32, "running_var")
    # Eval normalizes with the running statistics (not the batch's) and adds z before the ReLU.
    m.eval()
    x = make(shape, torch.float32, device, seed=99)[0].requires_grad_()
    y = m(x, z)
    expected = batch_norm_nhwc(x.detach().cpu(), z.cpu(), weight, bias, rm, rv, 0.0, 1e-5, True, False)
    close(y, expected, torch.float32, "eval y")
    assert m.num_batches_tracked.item() == 4
    y.sum().backward()  # eval is differentiable here
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_eval_in_each_dtype(device, dtype):
    x, z, _, weight, bias = make((2, 3, 3, 9), dtype, device)
    m = module_with(weight, bias, device, fuse_relu=True).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        m.running_mean.copy_(torch.randn(9, generator=g))
        m.running_var.copy_(torch.rand(9, generator=g) + 0.5)
    y = m(x, z)
    assert y.dtype == dtype and y.shape == x.shape
    rm, rv = m.running_mean.double().cpu(), m.running_var.double().cpu()
    close(y, batch_norm_nhwc(x.cpu(), z.cpu(), weight, bias, rm, rv, 0.0, 1e-5, True, False), dtype, "eval y")


def test_float64_gradcheck():
    x, z, _, weight, bias = make((2, 2, 3, 5), torch.float64, "cpu")
    m = module_with(weight, bias, "cpu", fuse_relu=True).double()
    x.requires_grad_()
    z.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: m(a, b), (x, z))


def test_non_contiguous_input(device):
    # A (N, H, W, C) view of an (N, C, H, W) tensor: upstream makes it contiguous first, and so do we.
    x, _, _, weight, bias = make((2, 4, 5, 6), torch.float32, device)
    view = x.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1)
    assert not view.is_contiguous()
    m = module_with(weight, bias, device)
    y = m(view)
    rm, rv = torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    close(y, batch_norm_nhwc(view.cpu(), None, weight, bias, rm, rv, 0.1, 1e-5, False, True), torch.float32, "y")


def test_parameters_buffers_and_attributes_as_upstream():
    m = BatchNorm2d_NHWC(24, fuse_relu=True, max_cta_per_sm=1, cta_launch_margin=3, multi_stream=True)
    assert set(m.state_dict()) == set(torch.nn.BatchNorm2d(24).state_dict())
    assert torch.equal(m.weight, torch.ones(24)) and torch.equal(m.bias, torch.zeros(24))
    assert (m.eps, m.momentum, m.bn_group, m.fuse_relu, m.multi_stream) == (1e-5, 0.1, 1, True, True)
    assert m.fwd_occupancy == m.bwd_occupancy == 1 and m.grid_dim_y == 1
    assert m.minibatch_mean.shape == m.minibatch_riv.shape == (24,)
    assert isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
    assert batch_norm_module.BatchNorm2d_NHWC is BatchNorm2d_NHWC


BAD_INPUT = {  # case: (module options, x, z, error, message)
    "3-d x": ({}, lambda: torch.randn(2, 3, 8), None, ValueError, r"x must have shape \(N, H, W, C\)"),
    "channels first": (
        {},
        lambda: torch.randn(2, 8, 3, 3),
        None,
        ValueError,
        "x must have shape .*C = num_features = 8",
    ),
    "int x": ({}, lambda: torch.ones(2, 3, 3, 8, dtype=torch.int32), None, TypeError, "x has dtype torch.int32"),
    "z without fuse_relu": ({}, lambda: torch.randn(2, 3, 3, 8), torch.randn(2, 3, 3, 8), ValueError, "z .*fuse_relu"),
    "z shape": ({"fuse_relu": True}, lambda: torch.randn(2, 3, 3, 8), torch.randn(2, 3, 8), ValueError, "z has shape"),
    "z dtype": (
        {"fuse_relu": True},
        lambda: torch.randn(2, 3, 3, 8),
        torch.randn(2, 3, 3, 8, dtype=torch.float16),
        TypeError,
        "z has dtype torch.float16",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_raises_naming_the_argument(case):
    options, make_x, z, error, message = BAD_INPUT[case]
    m = BatchNorm2d_NHWC(8, **options)
    with pytest.raises(error, match="^BatchNorm2d_NHWC: " + message):
        m(make_x(), z)


def test_one_value_per_channel_in_training_raises_as_torch():
    m = BatchNorm2d_NHWC(7)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        m(torch.randn(1, 1, 1, 7))
    m.eval()
    assert m(torch.randn(1, 1, 1, 7)).shape == (1, 1, 1, 7)


@pytest.mark.parametrize("fuse_relu", [False, True])
def test_empty_batch_as_torch(device, fuse_relu):
    m = BatchNorm2d_NHWC(5, fuse_relu=fuse_relu).to(device)
    with torch.no_grad():
        m.running_mean.fill_(0.5)
        m.running_var.fill_(2.0)
    x = torch.randn(0, 3, 4, 5, device=device, requires_grad=True)
    z = torch.randn(0, 3, 4, 5, device=device) if fuse_relu else None
    y = m(x, z)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(m.weight.grad, torch.zeros(5, device=device))
    # torch leaves the running statistics of an empty batch as they were.
    assert torch.equal(m.running_mean, torch.full((5,), 0.5, device=device))
    assert torch.equal(m.running_var, torch.full((5,), 2.0, device=device))


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="max_cta_per_sm must be positive"):
        BatchNorm2d_NHWC(8, max_cta_per_sm=0)
    with pytest.raises(RuntimeError, match=r"torch\.distributed\.init_process_group"):
        BatchNorm2d_NHWC(8, bn_group=2)
    with pytest.raises(ValueError, match="group size must be a positive int"):
        BatchNorm2d_NHWC(8, bn_group=0)


def test_torch_compile_fullgraph(device):
    # Inductor on the GPU; on the CPU, AOT autograd without code generation (fast, same tracing).
    x, z, dy, weight, bias = make((3, 4, 5, 12), torch.float32, device)
    eager, compiled = (module_with(weight, bias, device, fuse_relu=True) for _ in range(2))
    run = torch.compile(compiled, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    results = []
    for fn, m in ((eager, eager), (run, compiled)):
        xr, zr = x.clone().requires_grad_(), z.clone().requires_grad_()
        y = fn(xr, zr)
        results.append((y.detach(), *torch.autograd.grad(y, (xr, zr, m.weight, m.bias), dy)))
        results[-1] += (m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.multigpu
def test_second_gpu():
    # cuda:0 is current; the module and data live on cuda:1.
    x, z, dy, weight, bias = make((4, 3, 3, 16), torch.float16, "cuda:1")
    m = module_with(weight, bias, "cuda:1", fuse_relu=True)
    xr = x.clone().requires_grad_()
    y = m(xr, z)
    y.backward(dy)
    assert y.device == xr.grad.device == x.device
    rm, rv = torch.zeros(16, dtype=torch.float64), torch.ones(16, dtype=torch.float64)
    ref = reference_step(x.cpu(), z.cpu(), dy.cpu(), weight, bias, rm, rv, relu=True)
    close(y, ref["y"], torch.float16, "y")
    close(xr.grad, ref["dx"], torch.float16, "grad x")
    close(m.running_var, rv, torch.float16, "running_var")
