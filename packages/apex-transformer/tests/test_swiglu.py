"""fused_swiglu and its ops against float64 on random data (fp32 / fp16 / bf16; odd, one-element
and empty sizes; 16-byte and scalar paths), bad input naming the argument, opcheck, torch.compile,
double backward, and what it saves for the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from apex.transformer.functional import fused_swiglu

OPS = torch.ops.apex_transformer
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative to the float64 result's largest magnitude: one rounding of the output in 16-bit types.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# Leading shapes x half widths: one element, odd halves (the scalar path), multiples of 8 (16-byte
# vectors), a row count that leaves a partial step, empty leading and empty halves.
SHAPES = [((1,), 1), ((3, 5), 7), ((2, 33), 64), ((257,), 40), ((4, 3), 1000), ((0, 3), 8), ((5,), 0)]


def expected_float64(x: torch.Tensor, dy: torch.Tensor):
    x64 = x.detach().double().requires_grad_()
    gate, up = x64.chunk(2, dim=-1)
    out = F.silu(gate) * up
    (grad,) = torch.autograd.grad(out, x64, dy.double())
    return out.detach(), grad


def assert_close(actual, expected, dtype):
    scale = expected.abs().max().item() if expected.numel() else 1.0
    tol = TOL[dtype] * max(scale, 1.0)
    torch.testing.assert_close(actual.double().cpu(), expected.cpu(), rtol=TOL[dtype], atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_against_float64(device, dtype, shape):
    lead, half = shape
    torch.manual_seed(0)
    x = (2 * torch.randn(*lead, 2 * half, dtype=torch.float64)).to(device=device, dtype=dtype).requires_grad_()
    out = fused_swiglu(x)
    assert out.shape == (*lead, half) and out.dtype == dtype and out.device == x.device
    dy = torch.randn(out.shape, dtype=torch.float64).to(device=device, dtype=dtype)
    (grad,) = torch.autograd.grad(out, x, dy) if out.numel() else (torch.zeros_like(x),)
    expected_out, expected_grad = expected_float64(x, dy)
    assert_close(out.detach(), expected_out, dtype)
    assert grad.dtype == dtype and grad.shape == x.shape
    assert_close(grad, expected_grad, dtype)


def test_large_magnitudes_stay_finite(device):
    x = torch.tensor([[-1000.0, -90.0, 0.0, 90.0, 1000.0, 1.0, 2.0, 3.0, 4.0, 5.0]], device=device)
    x.requires_grad_()
    out = fused_swiglu(x)
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    expected_out, expected_grad = expected_float64(x, torch.ones_like(out))
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()
    assert_close(out.detach(), expected_out, torch.float32)
    assert_close(grad, expected_grad, torch.float32)


def test_unaligned_input_takes_the_scalar_path_correctly(device):
    # one element into its storage: no 16-byte accesses, same values
    storage = torch.randn(4 * 64 + 1, device=device, dtype=torch.bfloat16)
    x = storage[1:].view(4, 64)
    dy = torch.randn(4, 32, device=device, dtype=torch.bfloat16)
    expected_out, expected_grad = expected_float64(x, dy)
    assert_close(OPS.swiglu(x), expected_out, torch.bfloat16)
    assert_close(OPS.swiglu_backward(dy, x), expected_grad, torch.bfloat16)


def test_non_contiguous_input_through_the_function(device):
    x = torch.randn(16, 6, device=device).t()  # [6, 16], not contiguous
    assert_close(fused_swiglu(x), expected_float64(x, torch.zeros(6, 8, device=device))[0], torch.float32)


def test_autograd_saves_only_the_input(device):
    x = torch.randn(8, 32, device=device, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fused_swiglu(x)
    assert len(saved) == 1 and saved[0].shape == x.shape
    # the eager expression keeps three [8, 16] tensors
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gate, up = x.chunk(2, dim=-1)
        F.silu(gate) * up
    assert len(saved) == 3


def test_double_backward(device):
    x = torch.randn(3, 10, device=device, dtype=torch.float64, requires_grad=True)
    if torch.device(device).type == "cuda":
        pytest.skip("float64 is the CPU reference's; the CUDA kernels take float32, float16, bfloat16")
    assert torch.autograd.gradcheck(fused_swiglu, (x,))
    assert torch.autograd.gradgradcheck(fused_swiglu, (x,))


def test_double_backward_float32(device):
    # create_graph=True differentiates the gradient's expression (on CUDA too)
    x = torch.randn(3, 10, device=device, requires_grad=True)
    out = fused_swiglu(x)
    (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (grad2,) = torch.autograd.grad(grad.sum(), x)
    x64 = x.detach().double().requires_grad_()
    gate, up = x64.chunk(2, dim=-1)
    (g64,) = torch.autograd.grad((F.silu(gate) * up).sum(), x64, create_graph=True)
    (expected,) = torch.autograd.grad(g64.sum(), x64)
    assert_close(grad2, expected, torch.float32)


BAD_INPUT = {
    "odd width": (
        lambda d: (torch.randn(4, 7, device=d),),
        "swiglu",
        ValueError,
        r"input's last dimension must be even",
    ),
    "integer": (lambda d: (torch.ones(4, 8, dtype=torch.int64, device=d),), "swiglu", TypeError, r"input has dtype"),
    "not contiguous": (lambda d: (torch.randn(8, 4, device=d).t(),), "swiglu", ValueError, r"input is not contiguous"),
    "grad dtype": (
        lambda d: (torch.randn(4, 4, device=d).half(), torch.randn(4, 8, device=d)),
        "swiglu_backward",
        TypeError,
        r"grad_output has dtype torch.float16 but input has torch.float32",
    ),
    "grad shape": (
        lambda d: (torch.randn(4, 8, device=d), torch.randn(4, 8, device=d)),
        "swiglu_backward",
        ValueError,
        r"grad_output has shape \(4, 8\), expected \(4, 4\)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_raises_naming_the_argument(device, case):
    make, name, error, message = BAD_INPUT[case]
    with pytest.raises(error, match=f"^{name}: {message}"):
        getattr(OPS, name)(*make(device))


@pytest.mark.gpu
def test_float64_on_cuda_raises():
    with pytest.raises(TypeError, match=r"^swiglu: input has dtype torch.float64; expected one of float32"):
        OPS.swiglu(torch.randn(2, 8, device="cuda", dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(device, dtype):
    x = torch.randn(5, 3, 16, device=device, dtype=dtype)
    torch.library.opcheck(OPS.swiglu.default, (x,))
    torch.library.opcheck(OPS.swiglu_backward.default, (torch.randn(5, 3, 8, device=device, dtype=dtype), x))


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    w = torch.randn(16, 64, device=device, requires_grad=True)

    def loss(x):
        return fused_swiglu(x @ w).square().sum()

    backend = "inductor" if torch.device(device).type == "cuda" else "aot_eager"
    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    x = torch.randn(3, 7, 16, device=device)
    results = []
    for fn in (loss, compiled):
        value = fn(x)
        results.append((value.detach(), *torch.autograd.grad(value, [w])))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
