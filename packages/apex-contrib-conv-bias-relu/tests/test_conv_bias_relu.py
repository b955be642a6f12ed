"""apex.contrib.conv_bias_relu against float64 references (F.conv2d + bias + relu / mask / scale), on the
CPU and (marked gpu) on CUDA: values and every gradient upstream gives, fp32/fp16/bf16, 1x1 and 3x3 kernels,
random and odd geometry, both memory formats, autocast, bad input, opcheck, torch.compile, the legacy module."""

from __future__ import annotations

import importlib
import math
import random

import fused_conv_bias_relu
import pytest
import torch
import torch.nn.functional as F

from apex.contrib.conv_bias_relu import ConvBias, ConvBiasMaskReLU, ConvBiasReLU, ConvFrozenScaleBiasReLU, _ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
VARIANTS = ["relu", "bias", "mask", "scale"]
FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


def _random_geometries(count: int, seed: int) -> list[tuple]:
    """(N, C, K, H, W, kernel, padding, stride) with random kernel, padding and stride, as upstream's test."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        kernel = rng.randint(1, 5)
        size = rng.randint(kernel, 13)
        cases.append((rng.randint(1, 3), rng.randint(1, 9), rng.randint(1, 9), size, size + 1, kernel,
                      rng.randint(0, kernel // 2), rng.randint(1, 4)))  # fmt: skip
    return cases


GEOMETRIES = [
    (2, 8, 16, 7, 7, 1, 0, 1),  # 1x1
    (3, 5, 7, 9, 11, 3, 1, 2),  # 3x3, odd channel counts and sizes, strided
    (1, 3, 1, 6, 5, 3, 1, 1),  # one output channel
    (2, 16, 12, 8, 8, 1, 0, 2),  # 1x1 strided (ResNet's downsampling shortcut)
    *_random_geometries(2, seed=7),
]


def _tolerance(dtype: torch.dtype) -> float:
    """In units of the reference's magnitude plus its root-mean-square: the inputs are exact in float64, so the
    error is one rounding of each output to ``dtype`` (half an epsilon) plus the convolution's accumulation
    (products summed in float32 or wider: for 16-bit dtypes under an epsilon, measured at most 1.3 epsilon
    here; in float32 a few epsilon over these sums of up to a few thousand products, measured 3.8)."""
    return 3 * torch.finfo(dtype).eps if dtype != torch.float32 else 16 * torch.finfo(dtype).eps


FUNCTIONS = importlib.import_module("apex.contrib.conv_bias_relu.conv_bias_relu")


@pytest.fixture(autouse=True, params=["ops", "composed"])
def path(request, monkeypatch):
    """Every test runs both ways the public functions can go: through the ops (their references, which
    also run on CUDA), and composed from the same PyTorch ops under PyTorch's autograd (the default while
    the ops have no kernel of their own; see ``_COMPOSE``)."""
    monkeypatch.setattr(FUNCTIONS, "_COMPOSE", request.param == "composed")
    return request.param


@pytest.fixture(autouse=True)
def _no_tf32():
    """float32 is compared with float64 at float32's precision. PyTorch lets cuDNN round float32 convolution
    inputs to TF32 (10-bit mantissa, relative error ~1e-3) by default (``torch.backends.cudnn.allow_tf32``);
    the ops follow that switch as ``nn.Conv2d`` does, so the tests turn it off (no effect on the CPU)."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = saved


def assert_close_to_float64(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = _tolerance(dtype)
    scale = expected.square().mean().sqrt().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual.cpu().double(), expected.cpu(), rtol=tol, atol=tol * max(scale, 1e-30))


class Case:
    """Random inputs of one variant: x, weight, bias (and mask or scale), the output gradient."""

    def __init__(self, variant, geometry, dtype, device, memory_format=torch.contiguous_format, bias_shape="1k11"):
        n, c, k, h, w, kernel, self.padding, self.stride = geometry
        self.variant, self.dtype = variant, dtype
        self.x = torch.randn(n, c, h, w, dtype=torch.float64).to(dtype, memory_format=memory_format).to(device)
        self.weight = (torch.randn(k, c, kernel, kernel, dtype=torch.float64) / math.sqrt(c * kernel * kernel)).to(
            dtype=dtype, device=device, memory_format=memory_format
        )
        channel_shape = (1, k, 1, 1) if bias_shape == "1k11" else (k,)
        self.bias = (0.5 * torch.randn(channel_shape, dtype=torch.float64)).to(dtype=dtype, device=device)
        self.scale = (0.5 + torch.rand(channel_shape, dtype=torch.float64)).to(dtype=dtype, device=device)
        p, q = ((s + 2 * self.padding - kernel) // self.stride + 1 for s in (h, w))
        self.mask = (torch.rand(n, k, p, q, device=device) > 0.4).to(torch.int8)
        self.grad_out = torch.randn(n, k, p, q, dtype=torch.float64).to(dtype=dtype, device=device)

    @property
    def frozen(self) -> bool:
        return self.variant == "scale"

    def inputs(self) -> tuple:
        """The function's arguments; x and weight (and bias unless frozen) require gradients."""
        x, weight = self.x.clone().requires_grad_(), self.weight.clone().requires_grad_()
        bias = self.bias.clone().requires_grad_(not self.frozen)
        if self.variant == "mask":
            return x, weight, bias, self.mask, self.padding, self.stride
        if self.variant == "scale":
            return x, weight, self.scale, bias, self.padding, self.stride
        return x, weight, bias, self.padding, self.stride

    def run(self):
        function = {"relu": ConvBiasReLU, "bias": ConvBias, "mask": ConvBiasMaskReLU}.get(
            self.variant, ConvFrozenScaleBiasReLU
        )
        args = self.inputs()
        out = function(*args)
        wanted = [args[0], args[1]] + ([] if self.frozen else [args[2]])
        return out, torch.autograd.grad(out, wanted, self.grad_out)

    def reference(self, out: torch.Tensor):
        """float64 output and gradients; the ReLU's derivative at ``out > 0`` of the output under test (its sign
        where the exact value is within rounding of zero is the forward's business, checked on values)."""
        x = self.x.double().requires_grad_()
        weight = self.weight.double().requires_grad_()
        bias = self.bias.double().reshape(1, -1, 1, 1).requires_grad_()
        conv_weight = weight * self.scale.double().reshape(-1, 1, 1, 1) if self.frozen else weight
        z = F.conv2d(x, conv_weight, None, self.stride, self.padding) + bias
        if self.variant == "mask":
            z = z * self.mask.double()
        expected = z if self.variant == "bias" else F.relu(z)
        grad = self.grad_out.double()
        if self.variant != "bias":
            grad = grad * (out.detach() > 0)
        wanted = [x, weight] + ([] if self.frozen else [bias])
        grads = torch.autograd.grad(z, wanted, grad)
        if not self.frozen:
            grads = (*grads[:2], grads[2].reshape(self.bias.shape))
        return expected.detach(), grads


@pytest.mark.parametrize("memory_format", list(FORMATS))
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "N{}C{}K{}H{}W{}k{}p{}s{}".format(*g))
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_float64(device, dtype, variant, geometry, memory_format):
    case = Case(variant, geometry, dtype, device, FORMATS[memory_format])
    out, grads = case.run()
    expected, expected_grads = case.reference(out)
    assert (out.shape, out.dtype, out.device) == (expected.shape, dtype, case.x.device)
    assert_close_to_float64(out.detach(), expected, dtype)
    assert len(grads) == len(expected_grads)
    for got, want, like in zip(grads, expected_grads, (case.x, case.weight, case.bias)):
        assert (got.shape, got.dtype) == (like.shape, like.dtype)
        assert_close_to_float64(got, want, dtype)


@pytest.mark.parametrize("variant", VARIANTS)
def test_keeps_the_memory_format_of_x_and_weight(device, variant, path):
    # The output and x's gradient take x's memory format; weight's gradient takes weight's through the
    # ops, and composed whatever PyTorch's convolution gives it (as for nn.Conv2d).
    for x_format, w_format in [(torch.channels_last, torch.contiguous_format), (torch.contiguous_format,) * 2]:
        case = Case(variant, (2, 6, 5, 9, 8, 3, 1, 1), torch.float32, device, x_format)
        case.weight = case.weight.contiguous(memory_format=w_format)
        out, (grad_x, grad_w, *_) = case.run()
        assert out.is_contiguous(memory_format=x_format)
        assert grad_x.is_contiguous(memory_format=x_format)
        if path == "composed":
            weight = case.weight.clone().requires_grad_()
            plain = F.conv2d(case.x, weight, None, case.stride, case.padding)
            (plain_w,) = torch.autograd.grad(plain, weight, torch.ones_like(plain))
            assert grad_w.stride() == plain_w.stride()
        else:
            assert grad_w.is_contiguous(memory_format=w_format)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bias_of_shape_k(device, variant):
    case = Case(variant, GEOMETRIES[1], torch.float32, device, bias_shape="k")
    out, grads = case.run()
    expected, expected_grads = case.reference(out)
    assert_close_to_float64(out.detach(), expected, torch.float32)
    for got, want in zip(grads, expected_grads):
        assert got.shape == want.shape
        assert_close_to_float64(got, want, torch.float32)


@pytest.mark.parametrize("variant", VARIANTS)
def test_empty_batch(device, variant):
    case = Case(variant, (0, 4, 3, 5, 5, 3, 1, 1), torch.float32, device)
    out, grads = case.run()
    assert out.shape == (0, 3, 5, 5)
    assert grads[0].shape == case.x.shape
    for grad in grads[1:]:  # the weight and bias gradients of an empty batch are zero
        assert torch.equal(grad, torch.zeros_like(grad))


def test_mask_with_values_other_than_zero_and_one(device):
    # Upstream's backward ignores the mask (right for 0/1 masks only); ours multiplies by it.
    case = Case("mask", GEOMETRIES[1], torch.float32, device)
    case.mask = torch.randint(-2, 3, case.mask.shape, dtype=torch.int8, device=device)
    out, grads = case.run()
    expected, expected_grads = case.reference(out)
    assert_close_to_float64(out.detach(), expected, torch.float32)
    for got, want in zip(grads, expected_grads):
        assert_close_to_float64(got, want, torch.float32)


@pytest.mark.parametrize("mask_dtype", [torch.uint8, torch.bool, torch.float32])
def test_other_mask_dtypes(device, mask_dtype):
    case = Case("mask", GEOMETRIES[0], torch.float32, device)
    expected = ConvBiasMaskReLU(case.x, case.weight, case.bias, case.mask, case.padding, case.stride)
    got = ConvBiasMaskReLU(case.x, case.weight, case.bias, case.mask.to(mask_dtype), case.padding, case.stride)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_autocast_casts_to_the_autocast_dtype(device, variant):
    # float32 leaves under autocast: computed in the autocast dtype, gradients back in float32 (upstream: float16).
    dtype = torch.bfloat16 if device == "cpu" else torch.float16
    case = Case(variant, GEOMETRIES[1], torch.float32, device)
    args = case.inputs()
    with torch.autocast(torch.device(device).type, dtype=dtype):
        out = {"relu": ConvBiasReLU, "bias": ConvBias, "mask": ConvBiasMaskReLU, "scale": ConvFrozenScaleBiasReLU}[
            variant
        ](*args)
    assert out.dtype == dtype
    grads = torch.autograd.grad(out, args[:2], case.grad_out.to(dtype))
    assert all(g.dtype == torch.float32 for g in grads)
    low = Case(variant, GEOMETRIES[1], dtype, device)
    low.x, low.weight, low.bias, low.scale = (t.to(dtype) for t in (case.x, case.weight, case.bias, case.scale))
    low.mask, low.grad_out = case.mask, case.grad_out.to(dtype)
    expected, expected_grads = low.reference(out)
    assert_close_to_float64(out.detach(), expected, dtype)
    for got, want in zip(grads, expected_grads):
        assert_close_to_float64(got, want, dtype)


def test_second_derivative(device, path):
    # The ops' backward is not differentiable (a clear error); composed, PyTorch's autograd gives it.
    case = Case("relu", GEOMETRIES[0], torch.float32, device)
    x, weight, bias, padding, stride = case.inputs()
    out = ConvBiasReLU(x, weight, bias, padding, stride)
    grad_out = case.grad_out.requires_grad_()
    if path == "ops":
        with pytest.raises(RuntimeError, match="second derivative is not supported"):
            torch.autograd.grad(out, x, grad_out, create_graph=True)
        return
    (grad_x,) = torch.autograd.grad(out, x, grad_out, create_graph=True)
    (second,) = torch.autograd.grad(grad_x.square().sum(), grad_out)
    plain = F.relu(F.conv2d(x, weight, bias.reshape(-1), stride, padding))
    (plain_x,) = torch.autograd.grad(plain, x, grad_out, create_graph=True)
    (expected,) = torch.autograd.grad(plain_x.square().sum(), grad_out)
    torch.testing.assert_close(second, expected)


# bad input ---------------------------------------------------------------------------------------


def _good(device):
    return {
        "x": torch.randn(2, 4, 6, 6, device=device),
        "weight": torch.randn(3, 4, 3, 3, device=device),
        "bias": torch.randn(1, 3, 1, 1, device=device),
        "padding": 1,
        "stride": 1,
    }


BAD_INPUT = {  # case: (changes to the good arguments, error, message)
    "3-d x": ({"x": lambda d: torch.randn(4, 6, 6, device=d)}, ValueError, "x must be 4-D"),
    "float64 x": ({"x": lambda d: torch.randn(2, 4, 6, 6, dtype=torch.float64, device=d)}, TypeError, "x has dtype"),
    "int x": ({"x": lambda d: torch.ones(2, 4, 6, 6, dtype=torch.int32, device=d)}, TypeError, "x has dtype"),
    "2-d weight": ({"weight": lambda d: torch.randn(3, 4, device=d)}, ValueError, "weight must be 4-D"),
    "channel mismatch": ({"weight": lambda d: torch.randn(3, 5, 3, 3, device=d)}, ValueError, "weight has 5 input"),
    "half weight": (
        {"weight": lambda d: torch.randn(3, 4, 3, 3, dtype=torch.half, device=d)},
        TypeError,
        "weight has dtype",
    ),
    "bias dtype": ({"bias": lambda d: torch.randn(1, 3, 1, 1, device=d).bfloat16()}, TypeError, "bias has dtype"),
    "bias shape": ({"bias": lambda d: torch.randn(1, 4, 1, 1, device=d)}, ValueError, "bias must have shape"),
    "bias shape 2-d": ({"bias": lambda d: torch.randn(1, 3, device=d)}, ValueError, "bias must have shape"),
    "negative padding": ({"padding": -1}, ValueError, "padding must be >= 0"),
    "zero stride": ({"stride": 0}, ValueError, "stride must be >= 1"),
    "kernel too large": (
        {"x": lambda d: torch.randn(2, 4, 1, 6, device=d), "padding": 0},
        ValueError,
        "weight's kernel .* does not fit x",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
@pytest.mark.parametrize("function", ["relu", "bias"])
def test_bad_input_raises_naming_the_argument(device, case, function):
    changes, error, message = BAD_INPUT[case]
    args = _good(device)
    args.update({k: v(device) if callable(v) else v for k, v in changes.items()})
    op = _ops.conv_bias_relu_forward if function == "relu" else _ops.conv_bias_forward
    name = "conv_bias_relu_forward" if function == "relu" else "conv_bias_forward"
    with pytest.raises(error, match=f"^{name}: {message}"):
        (ConvBiasReLU if function == "relu" else ConvBias)(*args.values())
    with pytest.raises(error, match=f"^{name}: {message}"):
        op(*args.values())


def test_bad_mask_and_scale(device):
    a = _good(device)
    with pytest.raises(ValueError, match=r"^conv_bias_mask_relu_forward: mask must have the output's shape"):
        ConvBiasMaskReLU(a["x"], a["weight"], a["bias"], torch.ones(2, 3, 5, 6, dtype=torch.int8, device=device), 1, 1)
    with pytest.raises(TypeError, match=r"^conv_bias_mask_relu_forward: mask has dtype torch\.int32"):
        ConvBiasMaskReLU(a["x"], a["weight"], a["bias"], torch.ones(2, 3, 6, 6, dtype=torch.int32, device=device), 1, 1)
    with pytest.raises(ValueError, match=r"^conv_frozen_scale_bias_relu_forward: scale must have shape \(1, 3, 1, 1\)"):
        ConvFrozenScaleBiasReLU(a["x"], a["weight"], torch.ones(2, device=device), a["bias"], 1, 1)
    with pytest.raises(ValueError, match=r"^conv_bias_relu_backward: grad_out must have the output's shape"):
        out, grad_out = torch.ones(2, 3, 6, 6, device=device), torch.ones(2, 3, 5, 5, device=device)
        fused_conv_bias_relu.backward([a["x"], a["weight"], out, grad_out], 1, 1)


# opcheck and torch.compile ------------------------------------------------------------------------


@pytest.mark.parametrize("memory_format", list(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(device, dtype, memory_format):
    c = Case("relu", GEOMETRIES[1], dtype, device, FORMATS[memory_format])
    out = _ops.conv_bias_relu_forward(c.x, c.weight, c.bias, c.padding, c.stride)
    conv = (c.x, c.weight)
    geometry = (c.padding, c.stride)
    for op, args in [
        (_ops.conv_bias_relu_forward, (*conv, c.bias, *geometry)),
        (_ops.conv_bias_forward, (*conv, c.bias.reshape(-1), *geometry)),
        (_ops.conv_bias_mask_relu_forward, (*conv, c.bias, c.mask, *geometry)),
        (_ops.conv_frozen_scale_bias_relu_forward, (*conv, c.scale, c.bias, *geometry)),
        (_ops.conv_bias_relu_backward, (*conv, out, c.grad_out, *geometry)),
        (_ops.conv_bias_relu_backward, (*conv, out, c.grad_out, *geometry, c.mask)),
        (_ops.conv_bias_backward, (*conv, c.grad_out, *geometry)),
        (_ops.conv_frozen_scale_bias_relu_backward, (*conv, c.scale, out, c.grad_out, *geometry)),
    ]:
        torch.library.opcheck(op, args)


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_torch_compile_fullgraph(device, variant):
    case = Case(variant, GEOMETRIES[1], torch.float32, device, torch.channels_last)
    function = {"relu": ConvBiasReLU, "bias": ConvBias, "mask": ConvBiasMaskReLU, "scale": ConvFrozenScaleBiasReLU}[
        variant
    ]

    def loss(*args):
        return (function(*args) * 1.5).square().sum()

    torch._dynamo.reset()
    # Inductor on the GPU; on the CPU, AOT autograd without code generation (fast, same tracing).
    compiled = torch.compile(loss, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    results = []
    for fn in (loss, compiled):
        args = case.inputs()
        value = fn(*args)
        wanted = [t for t in args if isinstance(t, torch.Tensor) and t.requires_grad]
        results.append((value.detach(), *torch.autograd.grad(value, wanted)))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# the legacy module --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_legacy_module_matches_the_functions(device, dtype, path):
    # The legacy module calls the ops: bit for bit the functions' results through the ops; composed, the
    # same math summed in another order (the bias gradient: the convolution's own against the op's sum).
    c = Case("relu", GEOMETRIES[1], dtype, device, torch.channels_last)
    p, s = c.padding, c.stride
    exact = {"rtol": 0, "atol": 0} if path == "ops" else {}

    def function_grads(function, *args):
        x, w = c.x.clone().requires_grad_(), c.weight.clone().requires_grad_()
        bias = c.bias.clone().requires_grad_()
        out = function(x, w, *[bias if a is c.bias else a for a in args], p, s)
        wanted = [x, w] if function is ConvFrozenScaleBiasReLU else [x, w, bias]
        return out.detach(), torch.autograd.grad(out, wanted, c.grad_out)

    def same(got, expected):
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, **exact)

    out, grads = function_grads(ConvBiasReLU, c.bias)
    (legacy_out,) = fused_conv_bias_relu.forward([c.x, c.weight, c.bias], p, s)
    same(legacy_out, out)
    legacy_grads = fused_conv_bias_relu.backward([c.x, c.weight, legacy_out, c.grad_out], p, s)
    assert len(legacy_grads) == 3 and legacy_grads[2].dtype == torch.float32 and legacy_grads[2].shape == c.bias.shape
    same(legacy_grads[0], grads[0])
    same(legacy_grads[1], grads[1])
    same(legacy_grads[2].to(dtype), grads[2])

    out, grads = function_grads(ConvBias, c.bias)
    (legacy_out,) = fused_conv_bias_relu.forward_no_relu([c.x, c.weight, c.bias], p, s)
    same(legacy_out, out)
    legacy_grads = fused_conv_bias_relu.backward_no_relu([c.x, c.weight, c.grad_out], p, s)
    for got, expected in zip(legacy_grads, grads, strict=True):
        same(got.to(dtype), expected)

    out, grads = function_grads(ConvBiasMaskReLU, c.bias, c.mask)
    (legacy_out,) = fused_conv_bias_relu.forward_mask([c.x, c.weight, c.bias, c.mask], p, s)
    same(legacy_out, out)
    # upstream's mask backward: ``backward`` on the masked output (the same for a 0/1 mask)
    legacy_grads = fused_conv_bias_relu.backward([c.x, c.weight, legacy_out, c.grad_out], p, s)
    for got, expected in zip(legacy_grads, grads, strict=True):
        same(got.to(dtype), expected)

    out, grads = function_grads(ConvFrozenScaleBiasReLU, c.scale, c.bias)
    legacy_out = fused_conv_bias_relu.forward_cscale_cbias_relu([c.x, c.weight, c.scale, c.bias], p, s)
    assert isinstance(legacy_out, torch.Tensor)
    same(legacy_out, out)
    legacy_grads = fused_conv_bias_relu.backward_cscale_cbias_relu(
        [c.x, c.weight, c.scale, legacy_out, c.grad_out], p, s
    )
    assert len(legacy_grads) == 2
    for got, expected in zip(legacy_grads, grads, strict=True):
        same(got, expected)


def test_legacy_module_checks_the_list_length():
    with pytest.raises(ValueError, match=r"^fused_conv_bias_relu.forward: inputs must hold 3 tensors, got 2"):
        fused_conv_bias_relu.forward([torch.ones(1, 1, 1, 1)] * 2, 0, 1)


# GPU: upstream's own setting --------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("function", ["relu", "bias", "mask"])
def test_upstream_setting_matches_nn_conv2d(function):
    # Channels-last float32 module under float16 autocast, as upstream's test; against nn.Conv2d (+ relu).
    torch.manual_seed(1)
    conv = torch.nn.Conv2d(64, 128, 3, stride=2, padding=1).cuda().to(memory_format=torch.channels_last)
    x = torch.randn(8, 64, 33, 33, device="cuda").to(memory_format=torch.channels_last)
    mask = (torch.rand(8, 128, 17, 17, device="cuda") > 0.5).to(torch.int8)
    grads = []
    for ours in (True, False):
        conv.zero_grad()
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.float16):
            bias = conv.bias.reshape(1, -1, 1, 1)
            if ours and function == "relu":
                out = ConvBiasReLU(xi, conv.weight, bias, 1, 2)
            elif ours and function == "bias":
                out = ConvBias(xi, conv.weight, bias, 1, 2)
            elif ours:
                out = ConvBiasMaskReLU(xi, conv.weight, bias, mask, 1, 2)
            else:
                out = conv(xi)
                out = out if function == "bias" else F.relu(out * mask if function == "mask" else out)
        (out.float() ** 2).sum().backward()
        grads.append((out.float(), xi.grad, conv.weight.grad.clone(), conv.bias.grad.clone()))
    for got, expected in zip(*grads):  # float16 outputs, float16 gradients: a few float16 steps of the largest
        torch.testing.assert_close(got, expected, rtol=4e-3, atol=4e-3 * expected.abs().max().item())
    assert grads[0][0].is_contiguous(memory_format=torch.channels_last)
