"""apex.contrib.group_norm against float64 F.group_norm (+ SiLU), on the CPU and (marked gpu) on CUDA:
the module's output and every gradient, fp32/fp16/bf16, odd shapes, which path runs, bad input,
opcheck, torch.compile, upstream's functions and legacy modules; on CUDA the kernel itself
(multi-block groups, unaligned input, 64-bit offsets, streams, a second GPU)."""

from __future__ import annotations

import group_norm_cuda
import group_norm_v2_cuda
import pytest
import torch
import torch.nn.functional as F

from apex.contrib.group_norm import (
    GroupNorm,
    _ops,
    cuda_group_norm_nhwc_one_pass,
    cuda_group_norm_nhwc_two_pass,
    cuda_group_norm_v2_nhwc,
    get_cc_and_sm_count,
    group_norm_nhwc_bprop,
    group_norm_nhwc_fprop,
    torch_group_norm,
)
from apex.contrib.group_norm import group_norm as group_norm_module
from apex.contrib.group_norm._plugin import KERNELS
from apex.core import loader
from apex.core.testing import graph_reaches

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (N, C, *spatial, G): HW = 1, N = 1, C/G odd, C/G = 10 (Stable Diffusion's 320/32), C/G = 1,
# G = 1, C not a multiple of any vector width, 5-D and 2-D input.
SHAPES = [
    ((2, 12, 5, 3), 4),
    ((3, 8, 1, 1), 2),
    ((1, 15, 4, 4), 5),
    ((2, 20, 8, 8), 2),
    ((1, 320, 6, 5), 32),
    ((2, 16, 3, 3), 16),
    ((2, 18, 7, 2), 1),
    ((2, 21, 3, 5), 3),
    ((2, 8, 3, 4, 5), 2),
    ((4, 6), 3),
]


def channels_last(t: torch.Tensor) -> torch.Tensor:
    """t with its channels (dim 1) innermost in memory."""
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


def random_input(shape, dtype, device, scale=1.0, offset=0.0):
    """Channels-last normal values (a per-channel offset, so the groups have distinct means)."""
    x = torch.randn(shape, dtype=torch.float64) * scale
    x += offset * torch.randn(shape[1], dtype=torch.float64).view(1, -1, *[1] * (len(shape) - 2))
    return channels_last(x.to(dtype=dtype, device=device))


def reference(x, num_groups, weight, bias, eps, silu):
    """float64 F.group_norm (+ SiLU) of the same values, differentiable."""
    # contiguous: torch 2.13's CPU group_norm backward crashed (segfault) on some channels-last float64 input
    y = F.group_norm(
        x.double().contiguous(), num_groups, None if weight is None else weight.double(), bias.double(), eps
    )
    return F.silu(y) if silu else y


def tolerance(dtype: torch.dtype) -> float:
    """One rounding of the output (16-bit), or float32 accumulation over a group."""
    return 2e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps


def assert_close(actual, expected, dtype, scale=1.0):
    tol = tolerance(dtype)
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol * scale)


def poison_allocator(like):
    """Leave NaNs in a freed block like ``like``, so unwritten output elements show up."""
    torch.full_like(like, float("nan"))


@pytest.fixture(autouse=True)
def _op_off_cuda(monkeypatch):
    """Off CUDA the module takes torch's group norm by default; these tests run the op's reference there
    (test_off_cuda_the_module_is_torchs checks the default)."""
    monkeypatch.setattr(group_norm_module, "_TORCH_OFF_CUDA", False)


def test_off_cuda_the_module_is_torchs(monkeypatch):
    monkeypatch.setattr(group_norm_module, "_TORCH_OFF_CUDA", True)
    for dtype, param_dtype in ((torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.float32)):
        module = make_module(24, 6, "silu", dtype, "cpu", param_dtype=param_dtype)
        x = random_input((2, 24, 5, 7), dtype, "cpu").requires_grad_()
        y = module(x)
        assert graph_reaches(y.grad_fn, "NativeGroupNorm", depth=6), y.grad_fn
        assert y.dtype == dtype
        want = torch_group_norm(x, 6, module.weight, module.bias, module.eps, "silu")
        torch.testing.assert_close(y, want, rtol=0, atol=0)
        expected = reference(x, 6, module.weight, module.bias, module.eps, True)
        assert_close(y, expected, dtype)
        dy = random_input(x.shape, dtype, "cpu")
        grads = torch.autograd.grad(y, (x, module.weight, module.bias), dy)
        expected_grads = torch.autograd.grad(expected, (x, module.weight, module.bias), dy.double())
        assert_close(grads[0], expected_grads[0], dtype, scale=4.0)
        for got, want in zip(grads[1:], expected_grads[1:]):
            assert_close(got, want, dtype, scale=4.0 * 70**0.5)


def make_module(channels, groups, act, dtype, device, param_dtype=None):
    module = GroupNorm(groups, channels, act=act, device=device, dtype=param_dtype or dtype)
    with torch.no_grad():
        module.weight.copy_(1 + 0.5 * torch.randn(channels))
        module.bias.copy_(0.5 * torch.randn(channels))
    return module


@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, groups", SHAPES, ids=[f"{'x'.join(map(str, s))}-G{g}" for s, g in SHAPES])
def test_module_forward_and_gradients_match_float64(device, dtype, shape, groups, act):
    module = make_module(shape[1], groups, act, dtype, device)
    x = random_input(shape, dtype, device, offset=3.0).requires_grad_()
    poison_allocator(x)
    y = module(x)
    assert (y.shape, y.dtype, y.device) == (x.shape, x.dtype, x.device)
    assert channels_last(y).stride() == y.stride(), "the output keeps the input's channels-last layout"
    expected = reference(x, groups, module.weight, module.bias, module.eps, act == "silu")
    assert_close(y, expected, dtype)

    dy = random_input(shape, dtype, device)
    grads = torch.autograd.grad(y, (x, module.weight, module.bias), dy)
    expected_grads = torch.autograd.grad(expected, (x, module.weight, module.bias), dy.double())
    # dx is rounded once to x's dtype; dweight/dbias sum over N * HW values in float32.
    count = x.numel() / shape[1]
    assert_close(grads[0], expected_grads[0], dtype, scale=4.0)
    for got, want in zip(grads[1:], expected_grads[1:]):
        assert got.dtype == dtype
        assert_close(got, want, dtype, scale=4.0 * count**0.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float32_parameters_with_16_bit_input(device, dtype):
    module = make_module(24, 6, "swish", dtype, device, param_dtype=torch.float32)
    x = random_input((2, 24, 5, 7), dtype, device).requires_grad_()
    y = module(x)
    expected = reference(x, 6, module.weight, module.bias, 1e-5, True)
    assert y.dtype == dtype
    assert_close(y, expected, dtype)
    dy = random_input(x.shape, dtype, device)
    dweight, dbias = torch.autograd.grad(y, (module.weight, module.bias), dy)
    want = torch.autograd.grad(expected, (module.weight, module.bias), dy.double())
    assert dweight.dtype == dbias.dtype == torch.float32
    torch.testing.assert_close(dweight.double(), want[0].double(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dbias.double(), want[1].double(), rtol=1e-4, atol=1e-4)


def test_without_affine_parameters(device):
    module = GroupNorm(3, 12, affine=False, act="SiLU", device=device)
    assert module.weight is None and module.bias is None and module.act == "silu"
    x = random_input((2, 12, 4, 4), torch.float32, device).requires_grad_()
    y = module(x)
    expected = F.silu(F.group_norm(x.double(), 3, eps=1e-5))
    assert_close(y, expected, torch.float32)
    dy = torch.randn_like(y)
    assert_close(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(expected, x, dy.double())[0], torch.float32)


def test_large_offset_keeps_its_accuracy(device):
    # Channels far from zero (|mean| / std ~ 1e3): the statistics must not cancel catastrophically.
    module = make_module(32, 4, None, torch.float32, device)
    x = random_input((2, 32, 9, 9), torch.float32, device, offset=1000.0)
    expected = reference(x, 4, module.weight, module.bias, 1e-5, False)
    torch.testing.assert_close(module(x).double(), expected, rtol=0, atol=2e-3)


def test_empty_batch_and_empty_spatial_size(device):
    module = make_module(8, 2, "silu", torch.float32, device)
    for shape in ((0, 8, 3, 3), (2, 8, 0, 3)):
        x = random_input(shape, torch.float32, device).requires_grad_()
        y = module(x)
        assert y.shape == x.shape
        y.sum().backward()
        assert x.grad.shape == x.shape
        assert torch.equal(module.weight.grad, torch.zeros_like(module.weight.grad))
        module.zero_grad()


# which path runs ---------------------------------------------------------------------------------


def _forbid_op(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the fused op was called")

    monkeypatch.setattr(_ops, "group_norm_forward", fail)


def test_nchw_input_takes_the_pytorch_path(device, monkeypatch):
    module = make_module(12, 4, "silu", torch.float32, device)
    x = torch.randn(2, 12, 5, 6, device=device)  # contiguous NCHW
    expected = reference(x, 4, module.weight, module.bias, 1e-5, True)
    _forbid_op(monkeypatch)
    y = module(x)
    assert y.is_contiguous()
    assert_close(y, expected, torch.float32)
    with pytest.raises(AssertionError, match="fused op was called"):
        module(channels_last(x))


@pytest.mark.parametrize(
    "x_dtype, param_dtype",
    [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16), (torch.float32, torch.float16)],
)
def test_other_dtype_pairs_take_the_pytorch_path(device, monkeypatch, x_dtype, param_dtype):
    module = make_module(12, 3, None, x_dtype, device, param_dtype=param_dtype)
    x = random_input((2, 12, 4, 4), x_dtype, device)
    expected = torch_group_norm(x, 3, module.weight, module.bias, 1e-5)
    _forbid_op(monkeypatch)
    y = module(x)
    assert y.dtype == x_dtype
    torch.testing.assert_close(y, expected)


def test_check_legality_tells_which_path_runs(device):
    module = make_module(16, 4, "silu", torch.bfloat16, device)
    x = random_input((2, 16, 3, 3), torch.bfloat16, device)
    assert module._check_legality(x)
    assert not module._check_legality(x.contiguous())
    assert not module._check_legality(x.double())
    half = make_module(16, 4, "silu", torch.float16, device)
    assert not half._check_legality(x)  # bfloat16 input, float16 parameters
    assert not module._check_v2_legality(x.contiguous()) or device == "cuda"


def test_float64_input_takes_the_pytorch_path(device):
    module = make_module(12, 3, "silu", torch.float64, device)
    x = random_input((2, 12, 4, 4), torch.float64, device)
    torch.testing.assert_close(module(x), reference(x, 3, module.weight, module.bias, 1e-5, True))


def test_torch_group_norm_computes_in_the_weight_dtype(device):
    x = random_input((2, 8, 3, 3), torch.float16, device)
    w = torch.randn(8, dtype=torch.float32, device=device)
    b = torch.randn(8, dtype=torch.float32, device=device)
    y = torch_group_norm(x, 2, w, b, 1e-5, act="swish")
    assert y.dtype == torch.float16
    expected = F.silu(F.group_norm(x.float(), 2, w, b, 1e-5)).half()
    torch.testing.assert_close(y, expected)


# upstream's functions and modules ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_fprop_and_bprop_functions(device, dtype):
    x = random_input((2, 40, 6, 6), dtype, device, offset=2.0)
    w = 1 + torch.randn(40, device=device, dtype=dtype)
    b = torch.randn(40, device=device, dtype=dtype)
    y, sums = group_norm_nhwc_fprop(x, 4, w, b, 1e-5, "silu")
    expected = reference(x, 4, w, b, 1e-5, True)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert_close(y, expected, dtype)
    assert sums.shape == (2 * 2 * 4,) and sums.dtype == torch.float32
    groups = x.double().reshape(2, 4, -1)
    mean, var = groups.mean(-1), groups.var(-1, unbiased=False)
    torch.testing.assert_close(sums.view(2, 4, 2)[..., 0].double(), mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sums.view(2, 4, 2)[..., 1].double(), (var + 1e-5).rsqrt(), rtol=1e-5, atol=1e-5)
    for fn in (cuda_group_norm_nhwc_one_pass, cuda_group_norm_nhwc_two_pass, cuda_group_norm_v2_nhwc):
        torch.testing.assert_close(fn(x, 4, w, b, 1e-5, "silu"), y, rtol=0, atol=0)

    dy = random_input(x.shape, dtype, device)
    dx, dw, db = group_norm_nhwc_bprop(dy, sums, x, 4, w, b, 1e-5, "silu")
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    want = torch.autograd.grad(reference(xr, 4, wr, br, 1e-5, True), (xr, wr, br), dy.double())
    assert dx.is_contiguous(memory_format=torch.channels_last)
    assert_close(dx, want[0], dtype, scale=4.0)
    for got, expected_grad in zip((dw, db), want[1:]):
        assert got.dtype == dtype
        assert_close(got, expected_grad, dtype, scale=40.0)
    # grad_output in NCHW layout is converted, not misread
    dx_nchw = group_norm_nhwc_bprop(dy.contiguous(), sums, x, 4, w, b, 1e-5, "silu")[0]
    torch.testing.assert_close(dx_nchw, dx, rtol=0, atol=0)


def test_fprop_is_differentiable(device):
    x = random_input((2, 16, 3, 3), torch.float32, device).requires_grad_()
    w = torch.randn(16, device=device, requires_grad=True)
    b = torch.randn(16, device=device, requires_grad=True)
    y, _ = group_norm_nhwc_fprop(x, 4, w, b, 1e-5, "silu")
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    expected = reference(x, 4, w, b, 1e-5, True)
    want = torch.autograd.grad(expected, (x, w, b), dy.double())
    for got, expected_grad in zip(grads, want):
        assert_close(got, expected_grad, torch.float32, scale=10.0)


def test_legacy_modules_match_the_functions(device):
    x = random_input((2, 24, 5, 5), torch.bfloat16, device)
    w = torch.randn(24, device=device, dtype=torch.bfloat16)
    b = torch.randn(24, device=device, dtype=torch.bfloat16)
    dy = random_input(x.shape, torch.bfloat16, device)
    y, sums = group_norm_nhwc_fprop(x, 8, w, b, 1e-5, "silu")
    grads = group_norm_nhwc_bprop(dy, sums, x, 8, w, b, 1e-5, "silu")

    y1, sums1 = group_norm_cuda.forward(x, 8, w, b, 1e-5, 2, True)
    torch.testing.assert_close((y1, sums1), (y, sums), rtol=0, atol=0)
    torch.testing.assert_close(
        tuple(group_norm_cuda.backward(dy, sums1, x, 8, w, b, 1e-5, 2, True)), grads, rtol=0, atol=0
    )
    mean_var = torch.empty(2 * 8 * 2, device=device)
    y2 = group_norm_v2_cuda.gn(x, w, b, 1e-5, True, 8, mean_var_out=mean_var)
    torch.testing.assert_close((y2, mean_var), (y, sums), rtol=0, atol=0)
    torch.testing.assert_close(
        tuple(group_norm_v2_cuda.gn_bwd(dy, x, w, b, mean_var, 1e-5, True, 8)), grads, rtol=0, atol=0
    )
    y3, _ = group_norm_cuda.forward(x, 8, w, b, 1e-5, 1)  # with_swish defaults to False
    assert_close(y3, reference(x, 8, w, b, 1e-5, False), torch.bfloat16)


def test_plugin_provides_the_legacy_modules():
    from apex.contrib.group_norm._plugin import PLUGIN

    assert PLUGIN.provides == ("apex.contrib.group_norm", "group_norm_cuda", "group_norm_v2_cuda")


def test_module_matches_torch_group_norm_state_and_repr():
    ours = GroupNorm(4, 8, act="silu")
    theirs = torch.nn.GroupNorm(4, 8)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    assert repr(ours) == "GroupNorm(4, 8, eps=1e-05, affine=True, act=silu)"
    assert repr(GroupNorm(2, 8)) == "GroupNorm(2, 8, eps=1e-05, affine=True)"


def test_double_backward(device):
    module = make_module(12, 3, "silu", torch.float32, device)
    x = random_input((2, 12, 3, 4), torch.float32, device).requires_grad_()
    dy = random_input(x.shape, torch.float32, device)
    xr = x.detach().double().requires_grad_()

    def second_order(inp, out):
        (dx,) = torch.autograd.grad(out, inp, dy.to(out.dtype), create_graph=True)
        return torch.autograd.grad(dx.square().sum(), (inp, module.weight))

    got = second_order(x, module(x))
    want = second_order(xr, reference(xr, 3, module.weight, module.bias, 1e-5, True))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-4, atol=1e-4)


# bad input -------------------------------------------------------------------------------------------


def test_bad_module_arguments():
    with pytest.raises(ValueError, match=r"num_channels \(10\) must be divisible by num_groups \(4\)"):
        GroupNorm(4, 10)
    with pytest.raises(ValueError, match=r"act must be one of None, '', 'silu', 'swish'.*'relu'"):
        GroupNorm(2, 4, act="relu")
    module = GroupNorm(2, 4)
    with pytest.raises(ValueError, match="input has 6 channels"):
        module(torch.randn(2, 6, 3, 3))


def _x(device, shape=(2, 3, 3, 8), dtype=torch.float32):
    return torch.randn(shape, device=device).to(dtype)


BAD_FORWARD = {  # case: (arguments of group_norm_forward on a device, error, message)
    "float64 x": (lambda d: (_x(d, dtype=torch.float64), None, None, 2, 1e-5, ""), TypeError, "x has dtype"),
    "int x": (lambda d: (_x(d).int(), None, None, 2, 1e-5, ""), TypeError, "x has dtype torch.int32"),
    "1-d x": (lambda d: (_x(d, (8,)), None, None, 2, 1e-5, ""), ValueError, "x must be .* at least 2 dimensions"),
    "non-contiguous x": (lambda d: (_x(d).transpose(1, 2), None, None, 2, 1e-5, ""), ValueError, "x is not contig"),
    "groups not dividing C": (lambda d: (_x(d), None, None, 3, 1e-5, ""), ValueError, r"num_groups \(3\) must"),
    "zero groups": (lambda d: (_x(d), None, None, 0, 1e-5, ""), ValueError, r"num_groups \(0\) must"),
    "bad act": (lambda d: (_x(d), None, None, 2, 1e-5, "relu"), ValueError, "act must be one of"),
    "negative eps": (lambda d: (_x(d), None, None, 2, -1.0, ""), ValueError, "eps must be finite"),
    "float64 weight": (
        lambda d: (_x(d), torch.ones(8, device=d, dtype=torch.float64), None, 2, 1e-5, ""),
        TypeError,
        "weight has dtype torch.float64 but x has torch.float32",
    ),
    "bf16 weight for fp16 x": (
        lambda d: (_x(d, dtype=torch.float16), torch.ones(8, device=d, dtype=torch.bfloat16), None, 2, 1e-5, ""),
        TypeError,
        "weight .* must be float16 or float32",
    ),
    "weight of wrong shape": (
        lambda d: (_x(d), torch.ones(7, device=d), None, 2, 1e-5, ""),
        ValueError,
        r"weight has shape \(7,\), expected \(8,\)",
    ),
    "weight on another device": (
        lambda d: (_x(d), torch.ones(8, device="meta"), None, 2, 1e-5, ""),
        ValueError,
        "weight is on meta",
    ),
    "bias dtype unlike weight": (
        lambda d: (_x(d, dtype=torch.float16), torch.ones(8, device=d), torch.ones(8, device=d).half(), 2, 1e-5, ""),
        TypeError,
        "bias has dtype torch.float16 but weight has torch.float32",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FORWARD))
def test_bad_forward_input_raises_naming_the_argument(device, case):
    make_args, error, message = BAD_FORWARD[case]
    with pytest.raises(error, match="^group_norm_forward: " + message):
        _ops.group_norm_forward(*make_args(device))


def test_bad_backward_input_raises_naming_the_argument(device):
    x = _x(device)
    stats = torch.zeros(2, 2, device=device)
    with pytest.raises(TypeError, match=r"^group_norm_backward: dy has dtype torch.float16 but x has"):
        _ops.group_norm_backward(x.half(), x, None, None, stats, stats, 2, "")
    with pytest.raises(ValueError, match=r"^group_norm_backward: dy has shape"):
        _ops.group_norm_backward(x[:1], x, None, None, stats, stats, 2, "")
    with pytest.raises(TypeError, match=r"^group_norm_backward: mean has dtype torch.float16"):
        _ops.group_norm_backward(x, x, None, None, stats.half(), stats, 2, "")
    with pytest.raises(ValueError, match=r"^group_norm_backward: rstd has shape \(2, 4\)"):
        _ops.group_norm_backward(x, x, None, None, stats, torch.zeros(2, 4, device=device), 2, "")


def test_bad_upstream_function_input(device):
    x = _x(device, (2, 8, 3, 3))
    w = torch.ones(8, device=device)
    with pytest.raises(ValueError, match="group_norm_nhwc_fprop: x must be a 4-D channels-last tensor"):
        group_norm_nhwc_fprop(x, 2, w, w, 1e-5)
    with pytest.raises(ValueError, match="group_norm_nhwc_fprop: passes must be 1 or 2, got 3"):
        group_norm_nhwc_fprop(channels_last(x), 2, w, w, 1e-5, passes=3)
    with pytest.raises(ValueError, match="group_norm_nhwc_fprop: act must be one of"):
        group_norm_nhwc_fprop(channels_last(x), 2, w, w, 1e-5, act="gelu")
    with pytest.raises(ValueError, match="group_norm_nhwc_bprop: sums must be float32 with 2 \\* N \\* G = 8"):
        group_norm_nhwc_bprop(channels_last(x), torch.zeros(6, device=device), channels_last(x), 2, w, w, 1e-5)
    with pytest.raises(ValueError, match="torch_group_norm: act must be one of"):
        torch_group_norm(x, 2, w, w, 1e-5, act="tanh")


# opcheck and torch.compile ------------------------------------------------------------------------


@pytest.mark.parametrize("act", ["", "silu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(device, dtype, act):
    x = _x(device, (2, 5, 3, 12), dtype)
    for param_dtype, with_params in ((dtype, True), (torch.float32, True), (dtype, False)):
        w = torch.randn(12, device=device, dtype=param_dtype) if with_params else None
        b = torch.randn(12, device=device, dtype=param_dtype) if with_params else None
        torch.library.opcheck(_ops.group_norm_forward, (x, w, b, 4, 1e-5, act))
        # with gradients: the autograd registration, and AOT autograd through it
        grad_args = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]
        torch.library.opcheck(_ops.group_norm_forward, (*grad_args, 4, 1e-5, act))
        _, mean, rstd = _ops.group_norm_forward(x, w, b, 4, 1e-5, act)
        torch.library.opcheck(_ops.group_norm_backward, (torch.randn_like(x), x, w, b, mean, rstd, 4, act))


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    module = make_module(32, 8, "silu", torch.bfloat16, device, param_dtype=torch.float32)
    # Inductor on the GPU; on the CPU, AOT autograd without code generation (fast, same tracing).
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(lambda t: module(t * 2).float().square().sum(), fullgraph=True, backend=backend)
    x = random_input((2, 32, 6, 6), torch.bfloat16, device).requires_grad_()
    results = []
    for fn in (lambda t: module(t * 2).float().square().sum(), compiled):
        value = fn(x)
        results.append((value.detach(), *torch.autograd.grad(value, (x, module.weight, module.bias))))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.slow
def test_compiles_in_a_model_without_graph_breaks(device):
    # upstream's inductor test, smaller: GroupNorm + SiLU feeding a convolution, one graph
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        GroupNorm(8, 32, act="silu"), torch.nn.Conv2d(32, 32, kernel_size=3, padding="same")
    ).to(device)
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = random_input((2, 32, 8, 8), torch.float32, device).requires_grad_()
    dy = torch.randn(2, 32, 8, 8, device=device)
    results = []
    for fn in (model, compiled):
        y = fn(x)
        results.append((y.detach(), *torch.autograd.grad(y, (x, *model.parameters()), dy)))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


# CUDA: the kernel ------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_kernel_is_loaded():
    status = loader.load(KERNELS)
    assert status.has_kernels, f"{KERNELS.name}: tier {status.tier} ({status.reason})"


@pytest.mark.gpu
def test_cuda_autograd_is_the_cpp_one():
    # the AutogradCUDA kernel (csrc/group_norm_autograd.cpp), not the Python registration (which
    # serves the call that loads the library)
    assert loader.load(KERNELS).has_kernels
    module = make_module(16, 4, "silu", torch.bfloat16, "cuda")
    y = module(random_input((2, 16, 3, 3), torch.bfloat16, "cuda").requires_grad_())
    node = y.grad_fn.next_functions[0][0]  # past the movedim view
    assert "GroupNormForward" in node.name(), node.name()
    cc, sm_count = get_cc_and_sm_count(0)
    props = torch.cuda.get_device_properties(0)
    assert (cc, sm_count) == ((props.major, props.minor), props.multi_processor_count)


def _check_op_against_float64(x_nhwc, w, b, groups, act, dy=None, scale=4.0):
    """The ops on x (N, *, C) against float64 autograd of F.group_norm on the same values."""
    dtype = x_nhwc.dtype
    y, mean, rstd = _ops.group_norm_forward(x_nhwc, w, b, groups, 1e-5, act)
    xr = x_nhwc.movedim(-1, 1).double().requires_grad_()
    wr, br = w.double().requires_grad_(), b.double().requires_grad_()
    expected = reference(xr, groups, wr, br, 1e-5, act == "silu")
    assert_close(y.movedim(-1, 1), expected, dtype)
    n, c = x_nhwc.shape[0], x_nhwc.shape[-1]
    flat = x_nhwc.double().reshape(n, -1, groups, c // groups).transpose(1, 2).reshape(n, groups, -1)
    torch.testing.assert_close(mean.double(), flat.mean(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd.double(), (flat.var(-1, unbiased=False) + 1e-5).rsqrt(), rtol=1e-4, atol=1e-5)
    if dy is None:
        dy = torch.randn_like(x_nhwc)
    dx, dw, db = _ops.group_norm_backward(dy, x_nhwc, w, b, mean, rstd, groups, act)
    want = torch.autograd.grad(expected, (xr, wr, br), dy.movedim(-1, 1).double())
    assert_close(dx.movedim(-1, 1), want[0], dtype, scale=scale)
    count = x_nhwc.numel() / x_nhwc.shape[-1]
    for got, expected_grad in zip((dw, db), want[1:]):
        tol = 1e-4 if got.dtype == torch.float32 else tolerance(got.dtype)
        torch.testing.assert_close(got.double(), expected_grad, rtol=tol, atol=tol * 4 * count**0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["", "silu"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape, groups",
    [((2, 128, 128, 320), 32), ((1, 64, 64, 1280), 32), ((4, 96, 96, 20), 4), ((1, 300, 301, 9), 3)],
)
def test_multi_block_groups(dtype, act, shape, groups):
    x = torch.randn(shape, device="cuda").to(dtype) + torch.randn(shape[-1], device="cuda").to(dtype)
    w = (1 + torch.randn(shape[-1], device="cuda")).to(dtype)
    b = torch.randn(shape[-1], device="cuda").to(dtype)
    poison_allocator(x)
    _check_op_against_float64(x, w, b, groups, act)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unaligned_input_takes_the_scalar_path(dtype):
    # One element into its storage: not 16-byte aligned; C = 40 would otherwise vectorize.
    storage = torch.randn(2 * 33 * 33 * 40 + 1, device="cuda").to(dtype)
    x = storage[1:].view(2, 33, 33, 40)
    w = torch.randn(40, device="cuda")
    b = torch.randn(40, device="cuda")
    dy = torch.randn(2 * 33 * 33 * 40 + 1, device="cuda").to(dtype)[1:].view(x.shape)
    _check_op_against_float64(x, w, b, 4, "silu", dy=dy)


@pytest.mark.gpu
@pytest.mark.slow
def test_more_than_2_pow_31_elements():
    shape = (2, 1 << 15, 1 << 10, 33)  # 2.2e9 elements: offsets past 2^31
    need = 5 * 2 * 2**31 * 2  # x, y, dy, dx in bf16 and headroom
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory")
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(33, device="cuda")
    b = torch.randn(33, device="cuda")
    y, mean, rstd = _ops.group_norm_forward(x, w, b, 3, 1e-5, "silu")
    # float64 statistics of the last sample (the far end of the tensor), a chunk at a time
    last = x[1].view(-1, 3, 11)
    total = torch.zeros(3, dtype=torch.float64, device="cuda")
    squares = torch.zeros(3, dtype=torch.float64, device="cuda")
    for chunk in last.split(1 << 22):
        c = chunk.double()
        total += c.sum((0, 2))
        squares += c.square().sum((0, 2))
    count = last.shape[0] * 11
    mean64 = total / count
    var64 = squares / count - mean64.square()
    torch.testing.assert_close(mean[1].double(), mean64, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rstd[1].double(), (var64 + 1e-5).rsqrt(), rtol=1e-4, atol=1e-4)
    tail = x[1, -4:].double()
    xhat = (tail.view(-1, 3, 11) - mean64[:, None]) * (var64 + 1e-5).rsqrt()[:, None]
    expected = F.silu(xhat.view(tail.shape) * w.double() + b.double())
    assert_close(y[1, -4:], expected, torch.bfloat16, scale=4.0)
    dy = torch.ones_like(x)
    dx, _, db = _ops.group_norm_backward(dy, x, w, b, mean, rstd, 3, "")
    # d/dbias of sum(y) without activation is the count of positions; dx sums to ~0 per group
    torch.testing.assert_close(db, torch.full_like(db, float(x.numel() // 33)), rtol=1e-5, atol=0)
    assert torch.isfinite(dx[1, -4:]).all()


@pytest.mark.gpu
def test_runs_on_the_current_stream():
    source = torch.randn(4, 64, 64, 320, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(320, device="cuda")
    b = torch.randn(320, device="cuda")
    expected = _ops.group_norm_forward(source, w, b, 32, 1e-5, "silu")[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = source * 1.0
        y = _ops.group_norm_forward(x, w, b, 32, 1e-5, "silu")[0]
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


@pytest.mark.multigpu
def test_second_gpu():
    # cuda:0 is current; the tensors live on cuda:1.
    x = torch.randn(2, 32, 32, 320, device="cuda:1", dtype=torch.bfloat16)
    w = torch.randn(320, device="cuda:1")
    b = torch.randn(320, device="cuda:1")
    _check_op_against_float64(x, w, b, 32, "silu")
