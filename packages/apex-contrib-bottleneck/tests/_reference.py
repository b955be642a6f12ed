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


def _relu(z, mask):
    """ReLU; with ``mask``, ``z`` kept where ``mask`` is set: the same value up to the rounding that put ``z``
    on the mask's side of zero, and the derivative ``mask``."""
    return torch.relu(z) if mask is None else torch.where(mask, z, torch.zeros_like(z))


def reference(x, state, stride: int, relu_masks=None):
    """The block on float64 NCHW ``x`` with the weights of ``state`` (differentiable in x and weights).

    ``relu_masks``: three boolean NCHW tensors, where the block under test found its three ReLUs' outputs
    (conv1's, conv2's, the block's) positive, for the gradients. A pre-activation within the run's rounding
    of zero may fall on either side of it there (its value, near zero either way, is checked by the
    forward); float64's own sign would then move the gradient by a whole term (a weight times an output
    gradient), far beyond rounding, at one element of every few hundred in bfloat16. With the run's signs
    the reference's gradients are the exact derivative of the function the run took."""
    m1, m2, m3 = (None, None, None) if relu_masks is None else relu_masks
    out = _relu(_frozen_bn(F.conv2d(x, state["conv1.weight"], stride=stride), state, "bn1."), m1)
    out = _relu(_frozen_bn(F.conv2d(out, state["conv2.weight"], padding=1), state, "bn2."), m2)
    out = _frozen_bn(F.conv2d(out, state["conv3.weight"]), state, "bn3.")
    if "downsample.0.weight" in state:
        identity = _frozen_bn(F.conv2d(x, state["downsample.0.weight"], stride=stride), state, "downsample.1.")
    else:
        identity = x
    return _relu(out + identity, m3)


def close(actual, expected, dtype, what=""):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        actual.detach().double().cpu(),
        expected.detach().cpu(),
        rtol=tol,
        atol=tol * float(expected.detach().abs().max()),
        msg=lambda message: f"{what}: {message}",
    )
