"""apex.contrib.gpu_direct_storage's example op against float64, on the CPU and (marked gpu) on CUDA: values, the
gradient, bad input, opcheck, torch.compile."""

from __future__ import annotations

import math

import pytest
import torch

from apex.contrib.gpu_direct_storage import _ops, scale

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Empty, one element, odd, not a multiple of any vector width, several blocks of the kernel.
SIZES = [0, 1, 7, 33, 1000, 70_001]
ALPHA = -1.37


def random_tensor(shape, dtype, device, offset=0):
    """Normal values in ``dtype`` (exact in float64); the tensor starts ``offset`` elements into its storage."""
    numel = math.prod(shape)
    storage = torch.randn(numel + offset, dtype=torch.float64).to(dtype=dtype, device=device)
    return storage[offset:].view(shape)


def assert_close_to_float64(actual, expected):
    """Within two units in the last place of ``actual``'s dtype (below its normal range, one step)."""
    info = torch.finfo(actual.dtype)
    torch.testing.assert_close(
        actual.cpu().double(), expected.cpu(), rtol=2 * info.eps, atol=info.smallest_normal * info.eps
    )


def poison_allocator(like):
    """Leave NaNs in a freed block like ``like``: the next allocation of that size likely gets it,
    so output elements the op does not write show up."""
    torch.full_like(like, float("nan"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_scale_matches_float64(device, dtype, size):
    x = random_tensor((size,), dtype, device)
    poison_allocator(x)
    out = _ops.scale(x, ALPHA)
    assert (out.shape, out.dtype, out.device) == (x.shape, x.dtype, x.device)
    assert_close_to_float64(out, x.double() * ALPHA)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_of_shaped_and_unaligned_tensors(device, dtype):
    # An odd 3-d shape, and a tensor one element into its storage (not 16-byte aligned).
    for x in (random_tensor((3, 5, 7), dtype, device), random_tensor((4099,), dtype, device, offset=1)):
        assert_close_to_float64(_ops.scale(x, 0.25), x.double() * 0.25)


def test_gradient(device):
    x = random_tensor((2, 333), torch.float32, device).requires_grad_()
    dy = random_tensor((2, 333), torch.float32, device)
    y = scale(x, ALPHA)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert_close_to_float64(y.detach(), x.detach().double() * ALPHA)
    assert_close_to_float64(dx, dy.double() * ALPHA)


def test_gradient_that_arrives_expanded(device):
    x = random_tensor((3, 4), torch.float16, device).requires_grad_()
    scale(x, ALPHA).sum().backward()
    assert_close_to_float64(x.grad, torch.full(x.shape, ALPHA, dtype=torch.float64))


BAD_INPUT = {  # case: (x on a device, alpha, error, message)
    "float64 x": (lambda d: torch.ones(4, dtype=torch.float64, device=d), 2.0, TypeError, "x has dtype torch.float64"),
    "int x": (lambda d: torch.ones(4, dtype=torch.int32, device=d), 2.0, TypeError, "x has dtype torch.int32"),
    "non-contiguous x": (lambda d: torch.ones(4, 6, device=d).t(), 2.0, ValueError, "x is not contiguous"),
    "infinite alpha": (lambda d: torch.ones(4, device=d), math.inf, ValueError, "alpha must be finite, got inf"),
    "nan alpha": (lambda d: torch.ones(4, device=d), math.nan, ValueError, "alpha must be finite, got nan"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_raises_naming_the_argument(device, case):
    make_x, alpha, error, message = BAD_INPUT[case]
    with pytest.raises(error, match="^scale: " + message):
        _ops.scale(make_x(device), alpha)


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(device, dtype):
    torch.library.opcheck(_ops.scale, (random_tensor((3, 67), dtype, device), ALPHA))


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    def loss(x, w):
        return scale(x * w, ALPHA).square().sum()

    # Inductor on the GPU; on the CPU, AOT autograd without code generation (fast, same tracing).
    compiled = torch.compile(loss, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    x = random_tensor((8, 65), torch.float32, device)
    w = random_tensor((8, 65), torch.float32, device).requires_grad_()
    results = []
    for fn in (loss, compiled):
        value = fn(x, w)
        results.append((value.detach(), *torch.autograd.grad(value, w)))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_runs_on_the_current_stream():
    # Work on another stream than the caller's would race with the side stream's writes to x.
    source = random_tensor((1 << 24,), torch.float16, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = source * 1.0
        out = _ops.scale(x, ALPHA)
    torch.cuda.current_stream().wait_stream(side)
    assert_close_to_float64(out, source.double() * ALPHA)


@pytest.mark.multigpu
def test_second_gpu():
    # cuda:0 is current; x lives on cuda:1.
    x = random_tensor((70_001,), torch.bfloat16, "cuda:1")
    out = _ops.scale(x, ALPHA)
    assert out.device == x.device
    assert_close_to_float64(out, x.double() * ALPHA)
