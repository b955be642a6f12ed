"""The float64 reference (torch's batch norm over NCHW) and tolerances, shared by the tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def close(actual, expected, dtype, what=""):
    """Within the dtype's tolerance, relative to the largest magnitude of ``expected``."""
    tol = TOL[dtype]
    expected = expected.detach().double().cpu()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual.detach().double().cpu(), expected, rtol=tol, atol=tol * (scale + 1.0), msg=lambda m: f"{what}: {m}"
    )


def reference_step(x, dy, weight, bias, running_mean, running_var, momentum=0.1, eps=1e-5):
    """Output, gradients and batch statistics of one float64 training step; ``running_*`` (float64)
    are updated in place."""
    xd = x.detach().double().requires_grad_()
    wd = weight.detach().double().requires_grad_()
    bd = bias.detach().double().requires_grad_()
    y = F.batch_norm(xd, running_mean, running_var, wd, bd, True, momentum, eps)
    dx, dweight, dbias = torch.autograd.grad(y, (xd, wd, bd), dy.double())
    var, mean = torch.var_mean(xd.detach().transpose(0, 1).flatten(1), dim=1, unbiased=False)
    return {"y": y.detach(), "dx": dx, "dweight": dweight, "dbias": dbias, "mean": mean, "invstd": (var + eps).rsqrt()}
