"""What the layer norm tests share: random inputs, the float64 reference, tolerances from the dtype.

The test modules import this one relatively (``from ._helpers import ...``): under pytest's importlib
mode the tests folder is a namespace package, not a folder on ``sys.path``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Relative error of one rounding to the dtype, with headroom for the float32 arithmetic.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-10}
# (x dtype, gamma dtype): equal, upstream's float32 x with 16-bit gamma, ours 16-bit x with float32 gamma.
PAIRS = [
    (torch.float32, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.float32, torch.bfloat16),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float64, torch.float64),
]
# The hidden sizes upstream's fast_layer_norm was compiled for (others raised "Unsupported hidden_size").
UPSTREAM_HIDDEN_SIZES = [
    768, 1024, 1536, 2048, 2304, 3072, 3840, 4096, 5120, 6144, 8192, 10240, 12288,
    12800, 14336, 15360, 16384, 18432, 20480, 24576, 25600, 30720, 32768, 40960, 49152, 65536,
]  # fmt: skip
EPS = 1e-5


def pair_id(pair) -> str:
    return "-".join(str(d).removeprefix("torch.") for d in pair)


def randn(shape, device, dtype, scale=1.0, shift=0.0):
    """Normal values, rounded to ``dtype`` once (the float64 reference sees the same values)."""
    return (torch.randn(shape, dtype=torch.float64) * scale + shift).to(device=device, dtype=dtype)


def params(hidden, device, dtype):
    """gamma of magnitude 0.5 to 1.5 and either sign (memory_efficient divides by it), a random beta."""
    magnitude = 0.5 + torch.rand(hidden, dtype=torch.float64)
    sign = torch.where(torch.rand(hidden) < 0.5, -1.0, 1.0).double()
    return (magnitude * sign).to(device=device, dtype=dtype), randn(hidden, device, dtype, 0.3)


def reference(x, gamma, beta, eps=EPS):
    """float64 (output, mean, rsigma, leaves) over x's last dimension, output differentiable in the leaves."""
    x64, g64, b64 = (t.detach().double().requires_grad_() for t in (x, gamma, beta))
    hidden = g64.numel()
    y = F.layer_norm(x64, (hidden,), g64.reshape(hidden), b64.reshape(hidden), eps)
    xd = x64.detach()
    mean = xd.mean(-1)
    rsigma = torch.rsqrt((xd - mean.unsqueeze(-1)).square().mean(-1) + eps)
    return y, mean, rsigma, (x64, g64, b64)


def assert_close(actual, expected, tol, what, scale=None):
    """Within ``tol`` relative, and ``tol`` times ``scale`` (the expectation's largest magnitude) absolute."""
    if scale is None:
        scale = expected.abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.detach().cpu().double(),
        expected.detach().cpu(),
        rtol=tol,
        atol=tol * max(scale, 1e-3),
        msg=lambda m: f"{what}: {m}",
    )


def grad_input_scale(x, gamma, dy, eps=EPS) -> float:
    """dx = rsigma * (gamma * dy - ...) cancels: its error is relative to the size of the terms."""
    xd = x.detach().double()
    rsigma = torch.rsqrt((xd - xd.mean(-1, keepdim=True)).square().mean(-1, keepdim=True) + eps)
    term = rsigma * dy.detach().double() * gamma.detach().double().abs().max()
    return term.abs().max().item() if term.numel() else 1.0


def check_gradients(got, expected, x, gamma, dy, out_dtype, memory_efficient):
    """(dx, dgamma, dbeta) against the float64 ones, each in its tensor's dtype."""
    # Recovering x from a rounded output costs about one rounding of the output.
    slack = 2.0 if memory_efficient and out_dtype != torch.float32 else 1.0
    dx, dgamma, dbeta = got
    ex, eg, eb = expected
    assert dx.dtype == x.dtype and dx.shape == x.shape
    assert dgamma.dtype == dbeta.dtype == gamma.dtype and dgamma.shape == dbeta.shape == gamma.shape
    tol_x = slack * max(TOL[x.dtype], TOL[out_dtype])
    assert_close(dx, ex, tol_x, "dx", max(grad_input_scale(x, gamma, dy), ex.abs().max().item() if ex.numel() else 1))
    tol_w = slack * max(TOL[gamma.dtype], TOL[out_dtype])
    assert_close(dgamma, eg, tol_w, "dgamma")
    assert_close(dbeta, eb, tol_w, "dbeta")
