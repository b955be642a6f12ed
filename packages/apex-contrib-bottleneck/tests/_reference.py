"""A float64 bottleneck written out here (convolutions, frozen batch norm as (z - mean) / sqrt(var) *
weight + bias, ReLU), and helpers to build randomised blocks. Absolute imports only (the rank workers load
it by path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}


def randomize(block, seed: int):
    """Random weights and frozen batch-norm buffers (var well away from 0), in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in block.state_dict().items():
            if name.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            elif name.endswith("running_mean"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.2)
            elif name.endswith(".weight") and t.dim() == 1:
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            else:
                t.copy_(torch.randn(t.shape, generator=g) * (0.3 if t.dim() == 4 else 0.2))
    return block


def reference_state(block) -> dict[str, torch.Tensor]:
    """The block's state in float64, convolution weights as [K, C, R, S]."""
    state = {}
    for name, t in block.state_dict().items():
        t = t.detach().double()
        if t.dim() == 4 and block.explicit_nhwc:
            t = t.permute(0, 3, 1, 2)
        state[name] = t.contiguous()
    return state


def _frozen_bn(z, state, prefix):
    mean, var = state[prefix + "running_mean"], state[prefix + "running_var"]
    weight, bias = state[prefix + "weight"], state[prefix + "bias"]
    view = (1, -1, 1, 1)
    return (z - mean.view(view)) / var.sqrt().view(view) * weight.view(view) + bias.view(view)


def reference(x, state, stride: int):
    """The block on float64 NCHW ``x`` with the weights of ``state`` (differentiable in x and weights)."""
    out = torch.relu(_frozen_bn(F.conv2d(x, state["conv1.weight"], stride=stride), state, "bn1."))
    out = torch.relu(_frozen_bn(F.conv2d(out, state["conv2.weight"], padding=1), state, "bn2."))
    out = _frozen_bn(F.conv2d(out, state["conv3.weight"]), state, "bn3.")
    if "downsample.0.weight" in state:
        identity = _frozen_bn(F.conv2d(x, state["downsample.0.weight"], stride=stride), state, "downsample.1.")
    else:
        identity = x
    return torch.relu(out + identity)


def close(actual, expected, dtype, what=""):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        actual.detach().double().cpu(),
        expected.detach().cpu(),
        rtol=tol,
        atol=tol * float(expected.detach().abs().max()),
        msg=what,
    )
