"""The float64 reference of an NHWC batch norm (+ add + ReLU) and tolerances, shared by the tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float64: 1e-10}


def close(actual, expected, dtype, what=""):
    """Within the dtype's tolerance, relative to the largest magnitude of ``expected``."""
    tol = TOL[dtype]
    expected = expected.detach().double().cpu()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual.detach().double().cpu(), expected, rtol=tol, atol=tol * (scale + 1.0), msg=lambda m: f"{what}: {m}"
    )


def batch_norm_nhwc(x, z, weight, bias, running_mean, running_var, momentum, eps, relu, training):
    """``relu(bn(x) + z)`` of an (N, H, W, C) tensor in float64 through torch; the running statistics
    (float64 copies) are updated in place when training."""
    y = F.batch_norm(
        x.double().permute(0, 3, 1, 2), running_mean, running_var, weight.double(), bias.double(), training,
        momentum, eps,
    ).permute(0, 2, 3, 1)  # fmt: skip
    if z is not None:
        y = y + z.double()
    return torch.relu(y) if relu else y


def reference_step(x, z, dy, weight, bias, running_mean, running_var, momentum=0.1, eps=1e-5, relu=False):
    """Output, gradients (x, z, weight, bias) and batch statistics of one training step in float64;
    ``running_*`` (float64) are updated in place."""
    xd = x.detach().double().requires_grad_()
    zd = None if z is None else z.detach().double().requires_grad_()
    wd = weight.detach().double().requires_grad_()
    bd = bias.detach().double().requires_grad_()
    y = batch_norm_nhwc(xd, zd, wd, bd, running_mean, running_var, momentum, eps, relu, True)
    inputs = [xd, wd, bd] + ([zd] if zd is not None else [])
    grads = torch.autograd.grad(y, inputs, dy.double())
    flat = xd.detach().reshape(-1, x.shape[-1])
    var, mean = torch.var_mean(flat, dim=0, unbiased=False)
    return {
        "y": y.detach(),
        "dx": grads[0],
        "dweight": grads[1],
        "dbias": grads[2],
        "dz": grads[3] if zd is not None else None,
        "mean": mean,
        "invstd": (var + eps).rsqrt(),
    }
