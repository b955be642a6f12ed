"""Bottleneck against a float64 block written in the test (forward and every gradient), fp32/fp16/bf16,
both paths (use_cudnn True/False), NCHW / channels-last / explicit NHWC; checkpoints; errors; the legacy
fast_bottleneck module; single-process halo exchanger semantics."""

from __future__ import annotations

import contextlib
from pathlib import Path
from unittest import mock

import fast_bottleneck
import pytest
import torch

from apex.contrib.bottleneck import Bottleneck, FrozenBatchNorm2d, HaloExchangerNoComm, SpatialBottleneck, _block
from apex.core.testing import wheel_files

from ._reference import close, randomize, reference, reference_state

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (in, bottleneck, out, stride, N, H, W): identity residual; downsample with stride 2 on odd sizes;
# downsample with stride 1 (channels change); a 1x1 image
SHAPES = [(8, 4, 8, 1, 2, 5, 6), (6, 3, 10, 2, 3, 7, 5), (5, 4, 7, 1, 1, 4, 3), (4, 2, 4, 1, 2, 1, 1)]


def make(shape, dtype, use_cudnn, explicit_nhwc=False, seed=0):
    cin, mid, cout, stride = shape[:4]
    block = Bottleneck(cin, mid, cout, stride, use_cudnn=use_cudnn, explicit_nhwc=explicit_nhwc)
    return randomize(block, seed).to(dtype)


@pytest.fixture(autouse=True)
def _no_tf32():
    """float32 is compared with float64 at float32's precision. PyTorch lets cuDNN round float32 convolution
    inputs to TF32 (10-bit mantissa, relative error ~1e-3) by default (``torch.backends.cudnn.allow_tf32``);
    the block follows that switch as ``nn.Conv2d`` does, so the tests turn it off (no effect on the CPU)."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = saved


def run(block, x, dy):
    x = x.detach().requires_grad_()
    y = block(x)
    grads = torch.autograd.grad(y, [x, *block.w_conv], dy)
    return y, grads


@contextlib.contextmanager
def recording_hidden_relus(block):
    """Collects the outputs of conv1's and conv2's ReLUs (NCHW) in the forward of ``block`` under test: the
    fused ``ConvFrozenScaleBiasReLU`` calls of the ``use_cudnn`` path, the ``relu`` module's first two calls
    of the module path."""
    recorded = []
    if block.use_cudnn:
        fused = _block.ConvFrozenScaleBiasReLU

        def record(*args):
            out = fused(*args)
            recorded.append(out.detach().clone())
            return out

        with mock.patch.object(_block, "ConvFrozenScaleBiasReLU", record):
            yield recorded
    else:
        handle = block.relu.register_forward_hook(lambda module, args, out: recorded.append(out.detach().clone()))
        try:
            yield recorded
        finally:
            handle.remove()
        del recorded[2:]  # the third call is the block's output ReLU


def check_against_reference(block, x, dy, dtype, explicit_nhwc=False):
    x_in = x.detach().requires_grad_()
    with recording_hidden_relus(block) as hidden:
        y = block(x_in)
    grads = torch.autograd.grad(y, [x_in, *block.w_conv], dy)
    assert len(hidden) == 2, "the block's hidden ReLUs were not recorded: the test's recorder needs updating"
    state = reference_state(block)
    names = ["conv1.weight", "conv2.weight", "conv3.weight", "downsample.0.weight"][: len(grads) - 1]
    x64 = (x.permute(0, 3, 1, 2) if explicit_nhwc else x).double().requires_grad_()
    weights = [state[n].requires_grad_() for n in names]
    if explicit_nhwc:
        y = y.permute(0, 3, 1, 2)
        grads = [g.permute(0, 3, 1, 2) for g in grads]
    expected = reference(x64, state, block.stride)
    # gradients: the float64 derivative at the ReLU signs the run under test took (see reference())
    masks = [t > 0 for t in (*hidden, y.detach())]
    with_run_signs = reference(x64, state, block.stride, masks)
    dy64 = (dy.permute(0, 3, 1, 2) if explicit_nhwc else dy).double()
    expected_grads = torch.autograd.grad(with_run_signs, [x64, *weights], dy64)
    assert y.dtype == dtype
    close(y, expected, dtype, "output")
    for name, got, want in zip(["x", *names], grads, expected_grads):
        assert got.dtype == dtype
        close(got, want, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("use_cudnn", [True, False])
def test_matches_float64(device, dtype, shape, use_cudnn):
    block = make(shape, dtype, use_cudnn).to(device)
    cin, _, cout, stride, n, h, w = shape
    x = torch.randn(n, cin, h, w, dtype=torch.float64).to(dtype).to(device)
    out_hw = ((h - 1) // stride + 1, (w - 1) // stride + 1)
    dy = torch.randn(n, cout, *out_hw, dtype=torch.float64).to(dtype).to(device)
    check_against_reference(block, x, dy, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_channels_last(device, dtype):
    shape = SHAPES[1]
    block = make(shape, dtype, True).to(device).to(memory_format=torch.channels_last)
    x = torch.randn(3, 6, 7, 5).to(dtype).to(device).contiguous(memory_format=torch.channels_last)
    dy = torch.randn(3, 10, 4, 3).to(dtype).to(device)
    check_against_reference(block, x, dy, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_explicit_nhwc(device, dtype):
    shape = SHAPES[1]
    block = make(shape, dtype, True, explicit_nhwc=True).to(device)
    assert block.conv2.weight.shape == (3, 3, 3, 3) and block.conv1.weight.shape == (3, 1, 1, 6)  # [K, R, S, C]
    x = torch.randn(3, 7, 5, 6).to(dtype).to(device)
    dy = torch.randn(3, 4, 3, 10).to(dtype).to(device)
    check_against_reference(block, x, dy, dtype, explicit_nhwc=True)


def test_both_paths_and_the_scale_bias_callable_agree():
    block = make(SHAPES[1], torch.float32, True)
    x = torch.randn(3, 6, 7, 5)
    fused = block(x)
    block.use_cudnn = False
    torch.testing.assert_close(block(x), fused, rtol=1e-5, atol=1e-5)
    block.use_cudnn = True
    recompute = block.get_scale_bias_callable()
    torch.testing.assert_close(block(x), fused, rtol=1e-6, atol=1e-6)
    # the kept scales are used until recomputed
    block.bn1.running_var.mul_(4.0)
    torch.testing.assert_close(block(x), fused, rtol=1e-6, atol=1e-6)
    recompute()
    assert not torch.allclose(block(x), fused)


def test_checkpoint_names_and_round_trip():
    block = make(SHAPES[1], torch.float32, False)
    names = set(block.state_dict())
    for bn in ("bn1", "bn2", "bn3", "downsample.1"):
        assert {f"{bn}.{b}" for b in ("weight", "bias", "running_mean", "running_var")} <= names
    assert {"conv1.weight", "conv2.weight", "conv3.weight", "downsample.0.weight"} <= names
    assert len(names) == 20 and {n for n, _ in block.named_parameters()} == {
        "conv1.weight",
        "conv2.weight",
        "conv3.weight",
        "downsample.0.weight",
    }
    other = Bottleneck(6, 3, 10, 2, use_cudnn=True)
    other.load_state_dict(block.state_dict())
    x = torch.randn(2, 6, 5, 5)
    torch.testing.assert_close(other(x), block(x), rtol=1e-5, atol=1e-5)
    spatial = SpatialBottleneck(6, 3, 10, 2)
    spatial.load_state_dict(block.state_dict())
    torch.testing.assert_close(spatial(x), block(x), rtol=0, atol=0)
    assert Bottleneck(8, 4, 8).downsample is None


def test_frozen_batch_norm():
    bn = randomize(FrozenBatchNorm2d(5), 3)
    x = torch.randn(2, 5, 3, 4, dtype=torch.float64)
    state = {k: v.double() for k, v in bn.state_dict().items()}
    expected = (x - state["running_mean"].view(1, -1, 1, 1)) / state["running_var"].sqrt().view(1, -1, 1, 1)
    expected = expected * state["weight"].view(1, -1, 1, 1) + state["bias"].view(1, -1, 1, 1)
    torch.testing.assert_close(bn(x.float()).double(), expected, rtol=1e-5, atol=1e-6)
    scale, bias = bn.get_scale_bias(True)
    assert scale.shape == (1, 1, 1, 5) and bias.shape == (1, 1, 1, 5)


BAD = {
    "groups": (lambda: Bottleneck(4, 2, 4, groups=2), RuntimeError, "Only support groups == 1"),
    "dilation": (lambda: Bottleneck(4, 2, 4, dilation=2), RuntimeError, "Only support dilation == 1"),
    "norm_func": (lambda: Bottleneck(4, 2, 4, norm_func=torch.nn.BatchNorm2d), RuntimeError, "Only support frozen BN"),
    "explicit nhwc native": (
        lambda: Bottleneck(4, 2, 4, explicit_nhwc=True)(torch.randn(1, 3, 3, 4)),
        RuntimeError,
        "explicit nhwc with native ops is not supported",
    ),
    "channels": (lambda: Bottleneck(4, 2, 4)(torch.randn(1, 5, 3, 3)), ValueError, "x has 5 channels"),
    "dtype": (lambda: Bottleneck(4, 2, 4)(torch.randn(1, 4, 3, 3).half()), TypeError, "x has dtype torch.float16"),
    "3-D x": (lambda: Bottleneck(4, 2, 4)(torch.randn(4, 3, 3)), ValueError, "x must be a 4-D tensor"),
    "spatial args": (
        lambda: SpatialBottleneck(4, 2, 4, spatial_parallel_args=(2, 0)),
        ValueError,
        "spatial_parallel_args must be",
    ),
    "no exchanger": (
        lambda: SpatialBottleneck(4, 2, 4, spatial_parallel_args=(2, 0, None, None, 1, False)),
        ValueError,
        "needs a spatial_halo_exchanger",
    ),
    "spatial_method": (
        lambda: SpatialBottleneck(
            4, 2, 4, spatial_parallel_args=(2, 0, None, HaloExchangerNoComm([0, 1], 0), 7, False)
        ),
        ValueError,
        "spatial_method must be 1, 2 or 3",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_naming_the_argument(case):
    fn, error, message = BAD[case]
    with pytest.raises(error, match=message):
        fn()


def test_no_comm_exchanger_swaps():
    ex = HaloExchangerNoComm([0, 1, 2], 1)
    assert (ex.left_rank, ex.right_rank, ex.left_zero, ex.right_zero) == (0, 2, False, False)
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    left, right = ex.left_right_halo_exchange(a, b)
    assert left is b and right is a
    li, ri = torch.empty(2, 3), torch.empty(2, 3)
    assert ex(a, b, li, ri) is None
    assert torch.equal(li, b) and torch.equal(ri, a)


@pytest.mark.parametrize("explicit_nhwc", [False, True])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1]], ids=["identity", "downsample"])
def test_legacy_forward_backward_match_autograd(explicit_nhwc, shape):
    block = make(shape, torch.float32, True, explicit_nhwc=explicit_nhwc)
    cin, _, _, stride, n, h, w = shape
    x = torch.randn(n, h, w, cin) if explicit_nhwc else torch.randn(n, cin, h, w)
    y, grads = run(block, x, dy := torch.randn_like(block(x)))
    scales, biases = block._scales_biases(x.dtype)
    weights = block.w_conv
    args = [x, *weights[:3], *scales[:3], *biases[:3]]
    if len(weights) > 3:
        args += [weights[3], scales[3], biases[3]]
    out1, out2, out3 = fast_bottleneck.forward(explicit_nhwc, stride, args)
    torch.testing.assert_close(out3, y, rtol=1e-5, atol=1e-5)
    # upstream's BottleneckFunction: the ReLU mask of out3, times scale3 (and scale4)
    masked = torch.where(out3 > 0, dy, 0)
    channel_dim = -1 if explicit_nhwc else 1
    view = [1, 1, 1, 1]
    view[channel_dim] = -1
    grad_conv3 = masked * scales[2].reshape(view)
    grad_conv4 = masked * scales[3].reshape(view) if len(weights) > 3 else masked
    t_list = [*args[:10], grad_conv3, grad_conv4, out1, out2] + ([weights[3]] if len(weights) > 3 else [])
    legacy_grads = fast_bottleneck.backward(explicit_nhwc, stride, t_list)
    assert len(legacy_grads) == len(grads)
    for got, want in zip(legacy_grads, grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_legacy_spatial_functions_name_themselves():
    with pytest.raises(NotImplementedError, match=r"^fast_bottleneck\.forward_out2_halo: "):
        fast_bottleneck.forward_out2_halo()
    with pytest.raises(ValueError, match="inputs must hold 10 tensors"):
        fast_bottleneck.forward(False, 1, [torch.ones(1)] * 4)


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    block = make(SHAPES[1], torch.float32, True).to(device)
    # Inductor on the GPU; on the CPU, AOT autograd without code generation (fast, same tracing).
    compiled = torch.compile(block, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    x = torch.randn(3, 6, 7, 5, device=device)
    dy = torch.randn(3, 10, 4, 3, device=device)
    y, grads = run(block, x, dy)
    xc = x.detach().requires_grad_()
    yc = compiled(xc)
    grads_c = torch.autograd.grad(yc, [xc, *block.w_conv], dy)
    torch.testing.assert_close(yc, y, rtol=1e-4, atol=1e-4)
    for got, want in zip(grads_c, grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_wheel_ships_the_legacy_module(tmp_path):
    names = wheel_files(Path(__file__).parents[1], tmp_path)
    assert "fast_bottleneck.py" in names and "apex/contrib/bottleneck/halo_exchangers.py" in names
    assert not any(n.startswith("apex/__init__") or n == "apex/contrib/__init__.py" for n in names)
