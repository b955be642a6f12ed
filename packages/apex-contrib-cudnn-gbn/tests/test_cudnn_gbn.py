"""apex.contrib.cudnn_gbn.GroupBatchNorm2d and cudnn_gbn_lib against a float64 torch batch norm, one
process (the CPU, and CUDA marked gpu): output, gradients, statistics, eval, autocast, errors."""

from __future__ import annotations

import cudnn_gbn_lib
import pytest
import torch
import torch.nn.functional as F

from apex.contrib.cudnn_gbn import GroupBatchNorm2d
from apex.contrib.cudnn_gbn import batch_norm as batch_norm_module
from apex.parallel import sync_batchnorm

from ._reference import close, reference_step

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CL = torch.channels_last
# (N, C, H, W): ordinary, N=1, H*W=1, C odd and not a multiple of 8 (upstream requires a multiple of 8).
SHAPES = [(4, 16, 5, 6), (1, 7, 2, 3), (3, 13, 1, 1), (2, 20, 7, 3)]


def make(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 1.5 + 0.4).to(dtype)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.rand(shape[1], generator=g) + 0.5
    bias = torch.randn(shape[1], generator=g)
    return x.to(device, memory_format=CL), dy.to(device, memory_format=CL), weight, bias


def module_with(weight, bias, device, **kwargs):
    m = GroupBatchNorm2d(weight.numel(), 1, **kwargs).to(device)
    if m.affine:
        with torch.no_grad():
            m.weight.copy_(weight)
            m.bias.copy_(bias)
    return m


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_training_step_matches_float64(device, dtype, shape):
    x, dy, weight, bias = make(shape, dtype, device)
    m = module_with(weight, bias, device)
    xr = x.clone().requires_grad_()
    y = m(xr)
    assert (y.shape, y.dtype, y.device) == (x.shape, x.dtype, x.device)
    assert y.is_contiguous(memory_format=CL)
    y.backward(dy)
    c = shape[1]
    rm, rv = torch.zeros(c, dtype=torch.float64), torch.ones(c, dtype=torch.float64)
    ref = reference_step(x.cpu(), dy.cpu(), weight, bias, rm, rv)
    close(y, ref["y"], dtype, "y")
    close(xr.grad, ref["dx"], dtype, "grad x")
    close(m.weight.grad, ref["dweight"], dtype, "grad weight")
    close(m.bias.grad, ref["dbias"], dtype, "grad bias")
    close(m.running_mean, rm, dtype, "running_mean")
    close(m.running_var, rv, dtype, "running_var")
    close(m.minibatch_mean, ref["mean"], dtype, "minibatch_mean")
    close(m.minibatch_inv_var, ref["invstd"], dtype, "minibatch_inv_var")


@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_statistics_after_several_steps_and_eval(device, momentum):
    shape = (3, 11, 4, 5)
    _, _, weight, bias = make(shape, torch.float32, device)
    m = module_with(weight, bias, device, momentum=momentum)
    rm, rv = torch.zeros(11, dtype=torch.float64), torch.ones(11, dtype=torch.float64)
    for step in range(4):
        x = make(shape, torch.float32, device, seed=10 + step)[0]
        m(x)
        factor = 1.0 / (step + 1) if momentum is None else momentum
        F.batch_norm(x.double().cpu(), rm, rv, None, None, True, factor, 1e-5)
    assert m.num_batches_tracked.item() == 4
    close(m.running_mean, rm, torch.float32, "running_mean")
    close(m.running_var, rv, torch.float32, "running_var")
    m.eval()
    x = make(shape, torch.float32, device, seed=99)[0]
    expected = F.batch_norm(x.double().cpu(), rm, rv, weight.double(), bias.double(), False, 0.0, 1e-5)
    close(m(x), expected, torch.float32, "eval y")


def test_without_affine_or_running_statistics(device):
    x, dy, weight, bias = make((3, 9, 2, 4), torch.float32, device)
    m = module_with(weight, bias, device, affine=False, track_running_stats=False)
    assert m.weight is None and m.running_mean is None
    xr = x.clone().requires_grad_()
    y = m(xr)
    y.backward(dy)
    xd = x.double().cpu().requires_grad_()
    ref = F.batch_norm(xd, None, None, None, None, True, 0.1, 1e-5)
    (dx,) = torch.autograd.grad(ref, xd, dy.double().cpu())
    close(y, ref, torch.float32, "y")
    close(xr.grad, dx, torch.float32, "grad x")
    m.eval()  # no running statistics: the batch's, as the argument's documentation says
    close(m(x), ref, torch.float32, "eval y")


def test_autocast_casts_the_input():
    x, dy, weight, bias = make((2, 8, 3, 3), torch.float32, "cpu")
    m = module_with(weight, bias, "cpu")
    xr = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(xr)
    assert y.dtype == torch.bfloat16 and m.weight.dtype == torch.float32
    y.backward(dy.bfloat16())
    assert xr.grad.dtype == torch.float32
    rm, rv = torch.zeros(8, dtype=torch.float64), torch.ones(8, dtype=torch.float64)
    ref = reference_step(x.bfloat16(), dy.bfloat16(), weight, bias, rm, rv)
    close(y, ref["y"], torch.bfloat16, "y")
    close(xr.grad, ref["dx"], torch.bfloat16, "grad x")


def test_torch_compile_fullgraph(device):
    x, dy, weight, bias = make((3, 12, 4, 5), torch.float32, device)
    eager, compiled = (module_with(weight, bias, device) for _ in range(2))
    run = torch.compile(compiled, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    results = []
    for fn, m in ((eager, eager), (run, compiled)):
        xr = x.clone().requires_grad_()
        y = fn(xr)
        results.append((y.detach(), *torch.autograd.grad(y, (xr, m.weight, m.bias), dy)))
        results[-1] += (m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_module_as_upstream():
    m = GroupBatchNorm2d(24, 1)
    assert isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
    assert set(m.state_dict()) == set(torch.nn.BatchNorm2d(24).state_dict())
    assert (m.group_size, m.group_id, m.group_rank, m.eps, m.momentum) == (1, 0, 0, 1e-5, 0.1)
    assert m.minibatch_mean.shape == m.minibatch_inv_var.shape == (24,)
    assert batch_norm_module.GroupBatchNorm2d is GroupBatchNorm2d


BAD_INPUT = {  # case: (input, message); upstream's messages where upstream raises
    "3-d input": (lambda: torch.randn(2, 8, 9), r"^expected 4D input \(got 3D input\)"),
    "contiguous NCHW": (
        lambda: torch.randn(2, 8, 3, 3),
        "^GroupBatchNorm2d expected input tensor to be in channels last",
    ),
    "float64": (
        lambda: torch.randn(2, 8, 3, 3, dtype=torch.float64).to(memory_format=CL),
        "^GroupBatchNorm2d expected input tensor in float16, bfloat16 or float32",
    ),
    "channels": (lambda: torch.randn(2, 6, 3, 3).to(memory_format=CL), "^GroupBatchNorm2d: input has 6 channels"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_raises_as_upstream(case):
    make_input, message = BAD_INPUT[case]
    with pytest.raises(ValueError, match=message):
        GroupBatchNorm2d(8, 1)(make_input())


def test_bad_group_size():
    with pytest.raises(RuntimeError, match=r"torch\.distributed\.init_process_group"):
        GroupBatchNorm2d(8, 2)
    with pytest.raises(ValueError, match="group size must be a positive int"):
        GroupBatchNorm2d(8, 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_legacy_module_matches_the_class(device, dtype, monkeypatch):
    # the class through the ops, as the legacy functions (off CUDA it takes torch's batch norm by default)
    monkeypatch.setattr(sync_batchnorm, "_TORCH_OFF_CUDA", False)
    x, dy, weight, bias = make((3, 10, 4, 3), dtype, device)
    m = module_with(weight, bias, device)
    xr = x.clone().requires_grad_()
    y_module = m(xr)
    y_module.backward(dy)
    w, b = weight.to(device), bias.to(device)
    rm, rv = torch.zeros(10, device=device), torch.ones(10, device=device)
    mean, inv_var = torch.empty(10, device=device), torch.empty(10, device=device)
    y = cudnn_gbn_lib.forward(x, w, b, rm, rv, mean, inv_var, 0.1, 1e-5, 1, 0, [])
    dx, dscale, dbias = cudnn_gbn_lib.backward(x, dy, w, mean, inv_var, 1e-5, 1, 0, [])
    assert y.is_contiguous(memory_format=CL) and dx.shape == x.shape
    # The same ops in the same order: exact on the CPU (on CUDA up to the reductions' order).
    same = {"rtol": 0, "atol": 0} if device == "cpu" else {}
    for got, expected in ((y, y_module), (dx, xr.grad), (dscale, m.weight.grad), (dbias, m.bias.grad)):
        torch.testing.assert_close(got, expected, **same)
    for got, expected in ((rm, m.running_mean), (rv, m.running_var), (mean, m.minibatch_mean)):
        torch.testing.assert_close(got, expected, **same)
    with pytest.raises(ValueError, match=r"^cudnn_gbn_lib\.backward: dy must be a 4-D"):
        cudnn_gbn_lib.backward(x, dy[0], w, mean, inv_var, 1e-5, 1, 0, [])


@pytest.mark.multigpu
def test_second_gpu():
    # cuda:0 is current; the module and data live on cuda:1.
    x, dy, weight, bias = make((4, 16, 3, 3), torch.float16, "cuda:1")
    m = module_with(weight, bias, "cuda:1")
    xr = x.clone().requires_grad_()
    y = m(xr)
    y.backward(dy)
    assert y.device == xr.grad.device == x.device
    rm, rv = torch.zeros(16, dtype=torch.float64), torch.ones(16, dtype=torch.float64)
    ref = reference_step(x.cpu(), dy.cpu(), weight, bias, rm, rv)
    close(y, ref["y"], torch.float16, "y")
    close(xr.grad, ref["dx"], torch.float16, "grad x")
    close(m.running_var, rv, torch.float16, "running_var")
