"""FastLayerNormFN and FastLayerNorm against float64 references, on the CPU and (marked gpu) on CUDA:
every supported dtype pair, odd and empty sizes, memory_efficient, the same results as
apex.normalization's FusedLayerNorm, bad input, opcheck of the op calls, torch.compile, autocast."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from apex.contrib.layer_norm import FastLayerNorm, FastLayerNormFN
from apex.contrib.layer_norm import layer_norm as layer_norm_module
from apex.contrib.layer_norm.layer_norm import forward
from apex.core.testing import graph_reaches
from apex.normalization import FusedLayerNorm, MixedFusedLayerNorm

from ._helpers import (
    EPS,
    PAIRS,
    TOL,
    assert_close,
    check_gradients,
    pair_id,
    params,
    randn,
    reference,
)

# Empty, one element, odd, a leading shape of two dimensions, not a multiple of any vector width.
SHAPES = [(0, 64), (1, 1), (3, 7), (2, 3, 768), (5, 1000), (4, 4097)]


def run(fn, x, gamma, beta, dy):
    """fn's output and (dx, dgamma, dbeta) for the output gradient dy."""
    x, gamma, beta = (t.detach().requires_grad_() for t in (x, gamma, beta))
    out = fn(x, gamma, beta)
    return out, torch.autograd.grad(out, (x, gamma, beta), dy)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves-input", "memory-efficient"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_function_matches_float64(device, pair, shape, memory_efficient):
    x_dtype, w_dtype = pair
    x = randn(shape, device, x_dtype, 2.0, 0.5)
    gamma, beta = params(shape[-1], device, w_dtype)
    dy = randn(shape, device, w_dtype)
    out, grads = run(lambda *a: FastLayerNormFN.apply(*a, EPS, memory_efficient), x, gamma, beta, dy)
    assert (out.dtype, out.shape, out.device) == (w_dtype, x.shape, x.device)  # the output in gamma's dtype
    y64, _, _, leaves = reference(x, gamma, beta)
    assert_close(out, y64, TOL[w_dtype], "output")
    check_gradients(grads, torch.autograd.grad(y64, leaves, dy.double()), x, gamma, dy, w_dtype, memory_efficient)


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_statistics_are_float32(device, pair):
    x_dtype, w_dtype = pair
    x = randn((9, 1000), device, x_dtype, 3.0, -1.0)
    gamma, beta = params(1000, device, w_dtype)
    _, mu, rsigma = forward(x, gamma, beta, EPS)
    stats = torch.float64 if x_dtype == torch.float64 else torch.float32
    assert (mu.dtype, rsigma.dtype, mu.shape, rsigma.shape) == (stats, stats, (9,), (9,))
    _, mean, rs, _ = reference(x, gamma, beta)
    torch.testing.assert_close(mu.double(), mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rsigma.double(), rs, rtol=2e-6, atol=0)


def test_module_as_upstream():
    m = FastLayerNorm(1000)
    assert (m.epsilon, m.memory_efficient) == (1e-5, False)
    assert list(dict(m.named_parameters())) == ["weight", "bias"]
    assert m.weight.shape == m.bias.shape == (1000,) and m.weight.dtype == torch.float32
    assert torch.equal(m.weight, torch.ones(1000)) and torch.equal(m.bias, torch.zeros(1000))
    m = FastLayerNorm(64, eps=1e-6, memory_efficient=True, dtype=torch.bfloat16)
    assert (m.epsilon, m.memory_efficient, m.weight.dtype) == (1e-6, True, torch.bfloat16)
    assert "memory_efficient=True" in repr(m)


def test_megatron_finds_memory_efficient_in_the_signature():
    # Megatron-Core passes memory_efficient only when forward's signature names it.
    assert "memory_efficient" in inspect.getfullargspec(FastLayerNormFN.forward).args


def _modules(hidden, device, dtype, memory_efficient):
    """FastLayerNorm and apex.normalization's FusedLayerNorm with the same random parameters."""
    ours = FastLayerNorm(hidden, memory_efficient=memory_efficient, device=device, dtype=dtype)
    theirs = FusedLayerNorm(hidden, memory_efficient=memory_efficient, device=device, dtype=dtype)
    gamma, beta = params(hidden, device, dtype)
    with torch.no_grad():
        for m in (ours, theirs):
            m.weight.copy_(gamma)
            m.bias.copy_(beta)
    return ours, theirs


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves-input", "memory-efficient"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_module_function_and_fused_layer_norm_agree_exactly(device, dtype, memory_efficient):
    # One kernel behind all three: the same bits forward and backward.
    ours, theirs = _modules(1000, device, dtype, memory_efficient)
    x = randn((4, 5, 1000), device, dtype, 2.0)
    dy = randn((4, 5, 1000), device, dtype)
    results = []
    for fn, module in (
        (ours, ours),
        (lambda x: FastLayerNormFN.apply(x, ours.weight, ours.bias, EPS, memory_efficient), ours),
        (theirs, theirs),
    ):
        xr = x.detach().requires_grad_()
        out = fn(xr)
        results.append((out, *torch.autograd.grad(out, (xr, module.weight, module.bias), dy)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    y64, _, _, _ = reference(x, ours.weight, ours.bias)
    assert_close(results[0][0], y64, TOL[dtype], "output")


@pytest.mark.parametrize("pair", PAIRS[3:7], ids=pair_id)
def test_module_with_parameters_of_another_dtype(device, pair):
    # Output in the parameters' dtype: float32 input with 16-bit parameters (upstream's pair, through
    # FastLayerNormFN) and 16-bit input with float32 parameters (apex.normalization's mixed module).
    x_dtype, w_dtype = pair
    m = FastLayerNorm(768, device=device, dtype=w_dtype)
    gamma, beta = params(768, device, w_dtype)
    with torch.no_grad():
        m.weight.copy_(gamma)
        m.bias.copy_(beta)
    x = randn((6, 768), device, x_dtype, 2.0).requires_grad_()
    dy = randn((6, 768), device, w_dtype)
    out = m(x)
    assert out.dtype == w_dtype
    grads = torch.autograd.grad(out, (x, m.weight, m.bias), dy)
    y64, _, _, leaves = reference(x, gamma, beta)
    assert_close(out, y64, TOL[w_dtype], "output")
    check_gradients(grads, torch.autograd.grad(y64, leaves, dy.double()), x, gamma, dy, w_dtype, False)
    if x_dtype != torch.float32:  # the same as apex.normalization's mixed-dtype module
        mixed = MixedFusedLayerNorm(768, device=device, dtype=w_dtype)
        with torch.no_grad():
            mixed.weight.copy_(gamma)
            mixed.bias.copy_(beta)
        assert torch.equal(mixed(x), out)


def test_non_contiguous_input(device):
    m = FastLayerNorm(96, device=device)
    x = randn((96, 7), device, torch.float32).t()  # (7, 96), a transposed view
    assert not x.is_contiguous()
    y64, _, _, _ = reference(x, m.weight, m.bias)
    assert_close(m(x), y64, TOL[torch.float32], "output")
    assert_close(FastLayerNormFN.apply(x, m.weight, m.bias, EPS), y64, TOL[torch.float32], "output")


def test_gamma_of_another_shape(device):
    # Upstream takes hidden_size = gamma.numel(); the gradients come back in gamma's shape.
    x = randn((3, 64), device, torch.float32)
    gamma, beta = (t.reshape(8, 8) for t in params(64, device, torch.float32))
    dy = randn((3, 64), device, torch.float32)
    out, grads = run(lambda *a: FastLayerNormFN.apply(*a, EPS), x, gamma, beta, dy)
    y64, _, _, leaves = reference(x, gamma, beta)
    assert_close(out, y64, TOL[torch.float32], "output")
    check_gradients(grads, torch.autograd.grad(y64, leaves, dy.double()), x, gamma, dy, torch.float32, False)


BAD_INPUT = {  # case: (x, gamma, beta, epsilon on a device, error, message after "<op>: ")
    "last dimension": (
        lambda d: (torch.ones(4, 6, device=d), torch.ones(3, device=d), torch.ones(3, device=d), EPS),
        ValueError,
        r"x has shape \(4, 6\); its last dimension must be gamma's 3 elements",
    ),
    "int x": (
        lambda d: (
            torch.ones(4, 3, dtype=torch.int32, device=d),
            torch.ones(3, device=d),
            torch.ones(3, device=d),
            1e-5,
        ),
        TypeError,
        "x has dtype torch.int32; expected float32, float16, bfloat16 or float64",
    ),
    "float16 x, bfloat16 gamma": (
        lambda d: (
            torch.ones(4, 3, dtype=torch.float16, device=d),
            torch.ones(3, dtype=torch.bfloat16, device=d),
            torch.ones(3, dtype=torch.bfloat16, device=d),
            EPS,
        ),
        TypeError,
        "gamma has dtype torch.bfloat16 and x torch.float16; supported",
    ),
    "beta dtype": (
        lambda d: (
            torch.ones(4, 3, device=d),
            torch.ones(3, device=d),
            torch.ones(3, dtype=torch.float16, device=d),
            EPS,
        ),
        TypeError,
        "beta has dtype torch.float16 but gamma has torch.float32",
    ),
    "beta shape": (
        lambda d: (torch.ones(4, 3, device=d), torch.ones(3, device=d), torch.ones(1, 3, device=d), EPS),
        ValueError,
        r"beta has shape \(1, 3\) but gamma has \(3,\)",
    ),
    "empty gamma": (
        lambda d: (torch.ones(4, 0, device=d), torch.ones(0, device=d), torch.ones(0, device=d), EPS),
        ValueError,
        "gamma is empty",
    ),
    "negative epsilon": (
        lambda d: (torch.ones(4, 3, device=d), torch.ones(3, device=d), torch.ones(3, device=d), -1e-5),
        ValueError,
        "epsilon must be >= 0, got -1e-05",
    ),
    "nan epsilon": (
        lambda d: (torch.ones(4, 3, device=d), torch.ones(3, device=d), torch.ones(3, device=d), float("nan")),
        ValueError,
        "epsilon must be >= 0, got nan",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_raises_naming_the_argument(device, case):
    make, error, message = BAD_INPUT[case]
    x, gamma, beta, epsilon = make(device)
    with pytest.raises(error, match="^FastLayerNormFN: " + message):
        FastLayerNormFN.apply(x, gamma, beta, epsilon)
    if case in ("last dimension", "int x", "negative epsilon", "nan epsilon"):  # the module's arguments
        m = FastLayerNorm(gamma.numel(), eps=epsilon, device=device)
        with pytest.raises(error, match="^FastLayerNorm: " + message):
            m(x)


@pytest.mark.gpu
def test_bad_device_is_named():
    x, gamma, beta = torch.ones(4, 3, device="cuda"), torch.ones(3), torch.ones(3, device="cuda")
    with pytest.raises(ValueError, match=r"^FastLayerNormFN: gamma is on cpu, expected cuda:0"):
        FastLayerNormFN.apply(x, gamma, beta, EPS)
    with pytest.raises(ValueError, match=r"^FastLayerNormFN: beta is on cpu, expected cuda:0"):
        FastLayerNormFN.apply(x, beta, gamma, EPS)


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves-input", "memory-efficient"])
def test_opcheck_of_the_op_calls(device, pair, memory_efficient):
    # The calls FastLayerNorm makes: the forward with its registered autograd, and the backward.
    x_dtype, w_dtype = pair
    w_dtype = torch.float32 if x_dtype == torch.float32 else w_dtype  # the upcast pair's call
    out_dtype = None if w_dtype == x_dtype else w_dtype
    x = randn((5, 1000), device, x_dtype).requires_grad_()
    gamma, beta = (t.requires_grad_() for t in params(1000, device, w_dtype))
    ops = torch.ops.apex_normalization
    forward_args = (x, gamma, beta, (1000,), EPS, False, memory_efficient, out_dtype)
    torch.library.opcheck(ops.norm_forward.default, forward_args)
    z, mu, rsigma = ops.norm_forward(*(t.detach() if isinstance(t, torch.Tensor) else t for t in forward_args))
    dz = randn((5, 1000), device, z.dtype)
    saved = z if memory_efficient else x.detach()
    mean = rsigma.new_empty((0,)) if memory_efficient else mu
    backward_args = (dz, saved, gamma.detach(), beta.detach(), mean, rsigma, (1000,), False, memory_efficient, x_dtype)
    torch.library.opcheck(ops.norm_backward.default, backward_args)


@pytest.mark.slow
@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves-input", "memory-efficient"])
def test_torch_compile_fullgraph(device, memory_efficient):
    # Inductor on the GPU; on the CPU, AOT autograd without code generation (fast, same tracing).
    backend = "inductor" if device == "cuda" else "aot_eager"
    m = FastLayerNorm(1000, memory_efficient=memory_efficient, device=device)
    gamma, beta = params(1000, device, torch.float32)
    with torch.no_grad():
        m.weight.copy_(gamma)
        m.bias.copy_(beta)
    x = randn((8, 1000), device, torch.float32, 2.0)
    w16, b16 = (p.detach().to(torch.bfloat16).requires_grad_() for p in (m.weight, m.bias))

    def loss(x, w16, b16):
        a = m(x * 1.5)  # the op with its registered autograd
        b = FastLayerNormFN.apply(x, w16, b16, EPS, memory_efficient)  # the Function, the upcast pair
        return (a.square() * 0.5).sum() + (b.float() * a).sum()

    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    results = []
    for fn in (loss, compiled):
        xr = x.detach().requires_grad_()
        value = fn(xr, w16, b16)
        results.append((value, *torch.autograd.grad(value, (xr, m.weight, m.bias, w16, b16))))
    for got, expected in zip(results[1], results[0]):
        if backend == "inductor":
            # Inductor may round the bfloat16 Function's intermediates (its gradient, in bf16)
            # differently from eager: a bfloat16 ulp of the result, relative to its largest element.
            scale = max(expected.abs().max().item(), 1.0)
            torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * scale)
        else:
            torch.testing.assert_close(got, expected, rtol=1e-4 if got.dtype == torch.float32 else 2e-2, atol=1e-3)


@pytest.mark.gpu
def test_cuda_autocast_casts_as_upstream():
    m = FastLayerNorm(1024, device="cuda")
    x = randn((16, 1024), "cuda", torch.float32, 2.0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = m(x)
    assert out.dtype == torch.bfloat16
    cast = [t.detach().to(torch.bfloat16) for t in (x, m.weight, m.bias)]
    y64, _, _, _ = reference(*cast)
    assert_close(out, y64, TOL[torch.bfloat16], "output")
    out.float().sum().backward()
    assert m.weight.grad.dtype == torch.float32


@pytest.mark.multigpu
def test_second_gpu():
    # cuda:0 is current; everything lives on cuda:1.
    m = FastLayerNorm(4096, device="cuda:1", dtype=torch.bfloat16)
    x = randn((33, 4096), "cuda:1", torch.bfloat16, 2.0).requires_grad_()
    out = m(x)
    assert out.device == torch.device("cuda", 1)
    y64, _, _, _ = reference(x, m.weight, m.bias)
    assert_close(out, y64, TOL[torch.bfloat16], "output")
    out = FastLayerNormFN.apply(x, m.weight, m.bias, EPS, True)
    (dx,) = torch.autograd.grad(out.float().sum(), x)
    assert dx.device == torch.device("cuda", 1)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves-input", "memory-efficient"])
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_off_cuda_the_module_is_torchs(monkeypatch, pair, memory_efficient):
    monkeypatch.setattr(layer_norm_module, "_TORCH_OFF_CUDA", True)
    x_dtype, w_dtype = pair
    x = randn((2, 5, 1000), "cpu", x_dtype, 2.0, 0.5)
    gamma, beta = params(1000, "cpu", w_dtype)
    dy = randn((2, 5, 1000), "cpu", w_dtype)
    m = FastLayerNorm(1000, memory_efficient=memory_efficient, dtype=w_dtype)
    with torch.no_grad():
        m.weight.copy_(gamma)
        m.bias.copy_(beta)
    y64, _, _, leaves = reference(x, gamma, beta)
    expected = torch.autograd.grad(y64, leaves, dy.double())
    for fn, w, b in (
        (m, m.weight, m.bias),
        (lambda x: FastLayerNormFN.apply(x, gamma, beta, EPS, memory_efficient), gamma, beta),
    ):
        w.requires_grad_()
        b.requires_grad_()
        xr = x.detach().requires_grad_()
        out = fn(xr)
        assert graph_reaches(out.grad_fn, "NativeLayerNorm", depth=6), out.grad_fn
        assert (out.dtype, out.shape) == (w_dtype, x.shape)
        if x_dtype == w_dtype:
            torch.testing.assert_close(out, F.layer_norm(x, (1000,), gamma, beta, EPS), rtol=0, atol=0)
        assert_close(out, y64, TOL[w_dtype], "output")
        grads = torch.autograd.grad(out, (xr, w, b), dy)
        check_gradients(grads, expected, x, gamma, dy, w_dtype, False)
    # the op's checks, and upstream's gamma of any shape with hidden_size elements
    with pytest.raises(ValueError, match=r"^FastLayerNormFN: x has shape \(2, 5, 1000\); its last dimension"):
        FastLayerNormFN.apply(x, gamma[:999], beta[:999], EPS)
    gamma2 = gamma.view(10, 100).detach().requires_grad_()
    out = FastLayerNormFN.apply(x, gamma2, beta.view(10, 100), EPS)
    assert torch.autograd.grad(out, gamma2, dy)[0].shape == (10, 100)
