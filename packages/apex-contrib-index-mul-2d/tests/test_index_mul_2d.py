"""apex.contrib.index_mul_2d against float64 and PyTorch's ``in1[idx1] * in2``, on the CPU and (marked gpu)
on CUDA: the forward, both gradients, the second derivative, bad input and out-of-range indices, opcheck,
torch.compile, the legacy ``fused_index_mul_2d`` module, and on CUDA the kernel itself (64-bit offsets,
streams, a second device, deterministic mode)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import fused_index_mul_2d
import pytest
import torch

from apex.contrib.index_mul_2d import _ops, index_mul_2d
from apex.contrib.index_mul_2d._plugin import KERNELS
from apex.core import loader

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (N1, N2, F): empty (no rows, no features), one element, odd F (the scalar path), F a multiple of
# every vector width (the 16-byte path), more rows than one block takes, F past one warp of vectors.
SHAPES = [(3, 0, 5), (4, 6, 0), (1, 1, 1), (5, 7, 3), (10, 33, 64), (37, 1001, 24), (50, 300, 130), (9, 17, 1024)]


def random_tensor(shape, dtype, device, offset=0):
    """Normal values in ``dtype`` (exact in float64); the tensor starts ``offset`` elements into its storage."""
    numel = 1
    for n in shape:
        numel *= n
    storage = torch.randn(numel + offset, dtype=torch.float64).to(dtype=dtype, device=device)
    return storage[offset:].view(shape)


def operands(n1, n2, f, dtype, device, offset=0):
    in1 = random_tensor((n1, f), dtype, device, offset)
    in2 = random_tensor((n2, f), dtype, device, offset)
    idx1 = torch.randint(0, max(n1, 1), (n2,), device=device)
    return in1, in2, idx1


def poison_allocator(*like):
    """Leave NaNs in freed blocks like these: the next allocations of those sizes likely get them,
    so output elements the op does not write show up."""
    for t in like:
        torch.full_like(t, float("nan"))


def assert_rounded_from(actual, expected):
    """``actual`` is ``expected`` (float64) rounded once to its dtype: within one unit in the last place."""
    info = torch.finfo(actual.dtype)
    torch.testing.assert_close(
        actual.cpu().double(), expected.cpu(), rtol=info.eps, atol=info.smallest_normal * info.eps
    )


def assert_sum_close(actual, expected, abs_terms, terms):
    """A sum of ``terms`` products per element, accumulated in float32 (float64 for float64) in any
    order, then rounded once to ``actual``'s dtype: within an ulp of the dtype plus the accumulation's
    bound, ``terms * eps * sum of |products|``."""
    info = torch.finfo(actual.dtype)
    accumulation = torch.finfo(torch.float64 if actual.dtype == torch.float64 else torch.float32).eps
    error = (actual.cpu().double() - expected.cpu()).abs()
    bound = info.eps * expected.cpu().abs() + max(terms, 1) * accumulation * abs_terms.cpu() + info.smallest_normal
    worst = (error - bound).max().item() if error.numel() else 0.0
    assert worst <= 0, f"grad_in1 off by up to {error.max().item():.3g} past its bound"


def float64_backward(grad_out, in1, in2, idx1):
    """(grad_in1, sum of |terms| per element of grad_in1, grad_in2) in float64."""
    go, a, b = grad_out.double(), in1.double(), in2.double()
    grad_in1 = torch.zeros_like(a).index_add_(0, idx1, go * b)
    abs_terms = torch.zeros_like(a).index_add_(0, idx1, (go * b).abs())
    return grad_in1, abs_terms, go * a[idx1]


def most_repeated(idx1, n1):
    return int(torch.bincount(idx1.cpu(), minlength=max(n1, 1)).max()) if idx1.numel() else 0


# values -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_float64_and_eager(device, dtype, shape):
    in1, in2, idx1 = operands(*shape, dtype, device)
    poison_allocator(in2)
    out = _ops.index_mul_2d(in1, in2, idx1)
    assert (out.shape, out.dtype, out.device) == (in2.shape, in2.dtype, in2.device)
    assert_rounded_from(out, in1.double()[idx1] * in2.double())
    # one rounding of an exact product: the same bits as PyTorch's own expression
    assert torch.equal(out, in1[idx1] * in2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backward_matches_float64(device, dtype, shape):
    in1, in2, idx1 = operands(*shape, dtype, device)
    grad_out = random_tensor(in2.shape, dtype, device)
    poison_allocator(in1, in2)
    grad_in1, grad_in2 = _ops.index_mul_2d_backward(grad_out, in1, in2, idx1)
    assert (grad_in1.shape, grad_in1.dtype) == (in1.shape, dtype)
    assert (grad_in2.shape, grad_in2.dtype) == (in2.shape, dtype)
    expected_in1, abs_terms, expected_in2 = float64_backward(grad_out, in1, in2, idx1)
    assert_rounded_from(grad_in2, expected_in2)
    assert_sum_close(grad_in1, expected_in1, abs_terms, most_repeated(idx1, in1.shape[0]))


def test_rows_sharing_one_index_are_summed_in_float32(device):
    # 4096 float16 rows into one: float16 accumulation would lose most of the small terms
    in1 = torch.ones(2, 8, dtype=torch.float16, device=device)
    in2 = torch.full((4096, 8), 1.0 + 2.0**-10, dtype=torch.float16, device=device)
    in2[0] = 2048.0
    idx1 = torch.zeros(4096, dtype=torch.int64, device=device)
    grad_out = torch.ones_like(in2)
    grad_in1, _ = _ops.index_mul_2d_backward(grad_out, in1, in2, idx1)
    expected = 2048.0 + 4095 * (1.0 + 2.0**-10)
    assert_rounded_from(grad_in1[0], torch.full((8,), expected, dtype=torch.float64))
    assert torch.equal(grad_in1[1], torch.zeros(8, dtype=torch.float16, device=device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 7, 3), (10, 33, 64), (37, 1001, 24)], ids=lambda s: "x".join(map(str, s)))
def test_backward_backward_matches_float64(device, dtype, shape):
    in1, in2, idx1 = operands(*shape, dtype, device)
    grad_out = random_tensor(in2.shape, dtype, device)
    gg1, gg2 = random_tensor(in1.shape, dtype, device), random_tensor(in2.shape, dtype, device)
    grad_grad_out, grad_in1, grad_in2 = _ops.index_mul_2d_backward_backward(gg1, gg2, grad_out, in1, in2, idx1)
    a, b, go = in1.double(), in2.double(), grad_out.double()
    products = (gg1.double()[idx1] * b, gg2.double() * a[idx1])
    # a sum of two products, each exact in float32 for 16-bit inputs: two roundings at most
    info = torch.finfo(dtype)
    torch.testing.assert_close(
        grad_grad_out.cpu().double(),
        (products[0] + products[1]).cpu(),
        rtol=info.eps,
        atol=2 * info.eps * (products[0].abs() + products[1].abs()).max().item(),
    )
    assert_rounded_from(grad_in2, gg1.double()[idx1] * go)
    expected_in1 = torch.zeros_like(a).index_add_(0, idx1, gg2.double() * go)
    abs_terms = torch.zeros_like(a).index_add_(0, idx1, (gg2.double() * go).abs())
    assert_sum_close(grad_in1, expected_in1, abs_terms, most_repeated(idx1, in1.shape[0]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_public_function_gradients_and_second_derivative(device, dtype):
    # upstream's test: forces (the gradient of an energy) enter the loss, so the loss's gradient
    # goes through the backward's backward; compared with the same computation in float64 eager
    in1, in2, idx1 = operands(40, 500, 24, dtype, device)
    results = []
    cases = (
        (index_mul_2d, in1.clone(), in2.clone(), torch.Tensor.float),
        (lambda a, b, i: a[i] * b, in1.double(), in2.double(), torch.Tensor.double),
    )
    for fn, a, b, widen in cases:
        a.requires_grad_()
        b.requires_grad_()
        out = fn(a, b, idx1)
        energy = (widen(out) ** 2).sum() / out.numel()
        (force,) = torch.autograd.grad(energy, a, create_graph=True)
        loss = energy + (widen(force) ** 2).sum()
        loss.backward()
        results.append((out, force, a.grad, b.grad))
    tolerance = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    for ours, expected in zip(*results):
        assert ours.dtype == dtype and expected.dtype == torch.float64
        scale = expected.abs().max().item()
        torch.testing.assert_close(ours.detach().double(), expected.detach(), rtol=tolerance, atol=tolerance * scale)


def test_gradcheck_and_gradgradcheck_in_float64(device):
    in1, in2, idx1 = operands(4, 9, 3, torch.float64, device)
    in1.requires_grad_()
    in2.requires_grad_()
    # nondet_tol: on CUDA the rows sharing an index are summed by atomics, in any order
    assert torch.autograd.gradcheck(lambda a, b: index_mul_2d(a, b, idx1), (in1, in2), nondet_tol=1e-12)
    assert torch.autograd.gradgradcheck(lambda a, b: index_mul_2d(a, b, idx1), (in1, in2), nondet_tol=1e-12)


def test_third_derivative_raises(device):
    in1, in2, idx1 = operands(4, 9, 3, torch.float32, device)
    in1.requires_grad_()
    in2.requires_grad_()
    (g,) = torch.autograd.grad(index_mul_2d(in1, in2, idx1).square().sum(), in1, create_graph=True)
    (h,) = torch.autograd.grad(g.square().sum(), in2, create_graph=True)
    with pytest.raises(RuntimeError, match="third derivative is not supported"):
        torch.autograd.grad(h.sum(), in1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_and_non_contiguous_arguments(device, dtype):
    # one element into the storage: not 16-byte aligned, so the scalar path; transposed: made contiguous
    in1, in2, idx1 = operands(20, 70, 16, dtype, device, offset=1)
    assert torch.equal(_ops.index_mul_2d(in1, in2, idx1), in1[idx1] * in2)
    grad_out = random_tensor(in2.shape, dtype, device, offset=1)
    expected_in1, abs_terms, expected_in2 = float64_backward(grad_out, in1, in2, idx1)
    grad_in1, grad_in2 = _ops.index_mul_2d_backward(grad_out, in1, in2, idx1)
    assert_rounded_from(grad_in2, expected_in2)
    assert_sum_close(grad_in1, expected_in1, abs_terms, most_repeated(idx1, 20))
    t1, t2 = in1.t().contiguous().t(), in2.t().contiguous().t()
    assert not t1.is_contiguous()
    assert torch.equal(index_mul_2d(t1, t2, idx1), in1[idx1] * in2)


def test_gradient_that_arrives_expanded(device):
    in1, in2, idx1 = operands(6, 11, 5, torch.float32, device)
    in1.requires_grad_()
    in2.requires_grad_()
    index_mul_2d(in1, in2, idx1).sum().backward()  # the gradient is an expanded scalar
    ones = torch.ones(11, 5, dtype=torch.float64, device=in1.device)
    expected_in1, abs_terms, expected_in2 = float64_backward(ones, in1.detach(), in2.detach(), idx1)
    assert_rounded_from(in2.grad, expected_in2)
    assert_sum_close(in1.grad, expected_in1, abs_terms, most_repeated(idx1, 6))


# bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 7, 1 << 40])
def test_index_out_of_range_raises_on_the_cpu(bad):
    in1, in2, idx1 = operands(7, 5, 3, torch.float32, "cpu")
    idx1[3] = bad
    for call in (
        lambda: _ops.index_mul_2d(in1, in2, idx1),
        lambda: _ops.index_mul_2d_backward(in2, in1, in2, idx1),
        lambda: _ops.index_mul_2d_backward_backward(in1, in2, in2, in1, in2, idx1),
        lambda: index_mul_2d(in1, in2, idx1),
    ):
        with pytest.raises(IndexError, match=rf"idx1 has a value out of range: {bad} is not in \[0, 7\)"):
            call()


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [-1, 7])
def test_index_out_of_range_is_a_device_assertion_on_cuda(bad):
    # a device-side assertion ends the process's CUDA context, so it runs in a child process
    code = textwrap.dedent(
        f"""
        import torch
        import apex.contrib.index_mul_2d as m
        in1 = torch.randn(7, 64, device="cuda")
        in2 = torch.randn(5, 64, device="cuda")
        idx1 = torch.tensor([0, 1, {bad}, 3, 4], device="cuda")
        m.index_mul_2d(in1, in2, idx1)
        torch.cuda.synchronize()
        print("NOT RAISED")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "NOT RAISED" not in done.stdout, done.stdout + done.stderr
    # the device's assertion message goes through its printf buffer (stdout), the error to stderr
    assert "idx1 has a value out of range" in done.stdout + done.stderr, done.stdout + done.stderr


BAD_INPUT = {  # case: (make (in1, in2, idx1) on a device, error, message)
    "int in1": (lambda d: (torch.ones(3, 4, dtype=torch.int32, device=d), torch.ones(2, 4, device=d),
                           torch.zeros(2, dtype=torch.int64, device=d)),
                TypeError, "in1 has dtype torch.int32; expected one of float32, float16, bfloat16, float64"),
    "mixed dtypes": (lambda d: (torch.ones(3, 4, device=d), torch.ones(2, 4, dtype=torch.float16, device=d),
                                torch.zeros(2, dtype=torch.int64, device=d)),
                     TypeError, "in2 has dtype torch.float16 but in1 has dtype torch.float32"),
    "1-D in1": (lambda d: (torch.ones(3, device=d), torch.ones(2, 4, device=d),
                           torch.zeros(2, dtype=torch.int64, device=d)),
                ValueError, r"in1 must be 2-D, got shape \(3,\)"),
    "3-D in2": (lambda d: (torch.ones(3, 4, device=d), torch.ones(2, 4, 1, device=d),
                           torch.zeros(2, dtype=torch.int64, device=d)),
                ValueError, r"in2 must be 2-D, got shape \(2, 4, 1\)"),
    "features differ": (lambda d: (torch.ones(3, 4, device=d), torch.ones(2, 5, device=d),
                                   torch.zeros(2, dtype=torch.int64, device=d)),
                        ValueError, r"in2 has 5 features \(shape \(2, 5\)\) but in1 has 4 \(shape \(3, 4\)\)"),
    "int32 idx1": (lambda d: (torch.ones(3, 4, device=d), torch.ones(2, 4, device=d),
                              torch.zeros(2, dtype=torch.int32, device=d)),
                   TypeError, "idx1 has dtype torch.int32; expected int64"),
    "short idx1": (lambda d: (torch.ones(3, 4, device=d), torch.ones(2, 4, device=d),
                              torch.zeros(1, dtype=torch.int64, device=d)),
                   ValueError, r"idx1 must have shape \(2,\) \(one index per row of in2\), got \(1,\)"),
    "2-D idx1": (lambda d: (torch.ones(3, 4, device=d), torch.ones(2, 4, device=d),
                            torch.zeros(2, 1, dtype=torch.int64, device=d)),
                 ValueError, r"idx1 must have shape \(2,\) \(one index per row of in2\), got \(2, 1\)"),
    "non-contiguous in2": (lambda d: (torch.ones(3, 4, device=d), torch.ones(4, 2, device=d).t(),
                                      torch.zeros(2, dtype=torch.int64, device=d)),
                           ValueError, "in2 is not contiguous"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_raises_naming_the_argument(device, case):
    make, error, message = BAD_INPUT[case]
    in1, in2, idx1 = make(device)
    with pytest.raises(error, match="^index_mul_2d: " + message):
        _ops.index_mul_2d(in1, in2, idx1)
    # the backwards check their operands first, in the same words
    grad_out = torch.ones(2, 4, device=device)
    with pytest.raises(error, match="^index_mul_2d_backward: " + message):
        _ops.index_mul_2d_backward(grad_out, in1, in2, idx1)


@pytest.mark.gpu
def test_tensors_on_another_device_raise_naming_the_argument():
    in1, in2, idx1 = operands(3, 5, 4, torch.float32, "cuda")
    with pytest.raises(ValueError, match=r"^index_mul_2d: idx1 is on cpu, expected cuda:0"):
        _ops.index_mul_2d(in1, in2, idx1.cpu())
    with pytest.raises(ValueError, match=r"^index_mul_2d: in2 is on cpu, expected cuda:0"):
        _ops.index_mul_2d(in1, in2.cpu(), idx1)
    with pytest.raises(ValueError, match=r"^index_mul_2d_backward: grad_out is on cpu, expected cuda:0"):
        _ops.index_mul_2d_backward(in2.cpu(), in1, in2, idx1)


def test_bad_gradients_raise_naming_the_argument(device):
    in1, in2, idx1 = operands(3, 5, 4, torch.float32, device)
    with pytest.raises(ValueError, match=r"^index_mul_2d_backward: grad_out has shape \(5, 3\) but in2 has shape"):
        _ops.index_mul_2d_backward(torch.ones(5, 3, device=device), in1, in2, idx1)
    with pytest.raises(TypeError, match=r"^index_mul_2d_backward: grad_out has dtype torch\.float16 but in1 has"):
        _ops.index_mul_2d_backward(in2.half(), in1, in2, idx1)
    with pytest.raises(ValueError, match=r"^index_mul_2d_backward_backward: grad_grad_in1 has shape \(5, 4\) but in1"):
        _ops.index_mul_2d_backward_backward(in2, in2, in2, in1, in2, idx1)
    with pytest.raises(ValueError, match=r"^index_mul_2d_backward_backward: grad_grad_in2 is not contiguous"):
        _ops.index_mul_2d_backward_backward(in1, in2.t().contiguous().t(), in2, in1, in2, idx1)


# opcheck and torch.compile ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
def test_opcheck(device, dtype):
    in1, in2, idx1 = operands(6, 13, 24, dtype, device)
    grad_out = random_tensor(in2.shape, dtype, device)
    torch.library.opcheck(_ops.index_mul_2d, (in1, in2, idx1))
    # the backward sums with atomics on CUDA: opcheck compares runs of the op bit for bit, so
    # indices without repeats keep that sum a single term
    unique = torch.randperm(6, device=device)[: in2.shape[0] // 3]
    few = in2[: unique.shape[0]].contiguous()
    torch.library.opcheck(_ops.index_mul_2d_backward, (grad_out[: unique.shape[0]].contiguous(), in1, few, unique))
    torch.library.opcheck(
        _ops.index_mul_2d_backward_backward,
        (random_tensor(in1.shape, dtype, device), few, grad_out[: unique.shape[0]].contiguous(), in1, few, unique),
    )


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    def loss(in1, in2, idx1):
        return (index_mul_2d(in1 * 2, in2, idx1) ** 2).sum()

    torch._dynamo.reset()
    # Inductor on the GPU; on the CPU, AOT autograd without code generation (fast, same tracing).
    compiled = torch.compile(loss, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    in1, in2, idx1 = operands(9, 40, 8, torch.float32, device)
    in1.requires_grad_()
    in2.requires_grad_()
    results = []
    for fn in (loss, compiled):
        value = fn(in1, in2, idx1)
        results.append((value.detach(), *torch.autograd.grad(value, (in1, in2))))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# the legacy module --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix", "dtype"), [("float", torch.float32), ("half", torch.float16), ("half", torch.bfloat16)]
)
def test_legacy_module_matches_the_ops(device, prefix, dtype):
    in1, in2, idx1 = operands(8, 30, 16, dtype, device)
    grad_out, gg1, gg2 = (random_tensor(t.shape, dtype, device) for t in (in2, in1, in2))
    out = torch.full_like(in2, float("nan"))
    assert getattr(fused_index_mul_2d, f"{prefix}_forward")(out, in1, in2, idx1) is None
    assert torch.equal(out, _ops.index_mul_2d(in1, in2, idx1))

    grad_in1, grad_in2 = torch.zeros_like(in1), torch.full_like(in2, float("nan"))
    getattr(fused_index_mul_2d, f"{prefix}_backward")(grad_in1, grad_in2, grad_out, in1, in2, idx1)
    expected_in1, abs_terms, expected_in2 = float64_backward(grad_out, in1, in2, idx1)
    assert_rounded_from(grad_in2, expected_in2)
    assert_sum_close(grad_in1, expected_in1, abs_terms, most_repeated(idx1, 8))

    outs = (torch.full_like(in2, float("nan")), torch.zeros_like(in1), torch.full_like(in2, float("nan")))
    getattr(fused_index_mul_2d, f"{prefix}_backward_backward")(*outs, grad_out, gg1, gg2, in1, in2, idx1)
    expected = _ops.index_mul_2d_backward_backward(gg1, gg2, grad_out, in1, in2, idx1)
    torch.testing.assert_close(outs[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(outs[2], expected[2], rtol=0, atol=0)
    info = torch.finfo(dtype)
    torch.testing.assert_close(outs[1], expected[1], rtol=2 * info.eps, atol=1e-3 if dtype != torch.float32 else 1e-5)


def test_legacy_backward_adds_into_grad_in1_as_upstream(device):
    in1, in2, idx1 = operands(4, 10, 8, torch.float32, device)
    grad_out = random_tensor(in2.shape, torch.float32, device)
    start = random_tensor(in1.shape, torch.float32, device)
    grad_in1 = start.clone()
    fused_index_mul_2d.float_backward(grad_in1, torch.empty_like(in2), grad_out, in1, in2, idx1)
    torch.testing.assert_close(grad_in1, start + _ops.index_mul_2d_backward(grad_out, in1, in2, idx1)[0])


def test_legacy_module_refuses_the_other_dtype(device):
    in1, in2, idx1 = operands(4, 10, 8, torch.float16, device)
    message = r"^fused_index_mul_2d\.float_forward: out has dtype torch\.float16; expected float32"
    with pytest.raises(TypeError, match=message):
        fused_index_mul_2d.float_forward(torch.empty_like(in2), in1, in2, idx1)
    with pytest.raises(TypeError, match=r"^fused_index_mul_2d\.half_backward: grad_in1 has dtype torch\.float32"):
        fused_index_mul_2d.half_backward(torch.zeros(4, 8, device=device), torch.empty_like(in2), in2, in1, in2, idx1)


def test_package_and_legacy_module_in_a_fresh_interpreter():
    code = (
        "import apex.contrib.index_mul_2d, sys, torch; "
        "f = apex.contrib.index_mul_2d.index_mul_2d; import fused_index_mul_2d as m; "
        "names = ['index_mul_2d', 'index_mul_2d_backward', 'index_mul_2d_backward_backward']; "
        "missing = [n for n in names if not hasattr(torch.ops.apex_contrib_index_mul_2d, n)]; "
        "missing += [n for n in ('float_forward', 'half_forward', 'float_backward', 'half_backward', "
        "'float_backward_backward', 'half_backward_backward') if not callable(getattr(m, n, None))]; "
        "print(missing); sys.exit(1 if missing or not callable(f) else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_plugin_provides_the_legacy_module():
    from apex.contrib.index_mul_2d._plugin import PLUGIN

    assert PLUGIN.provides == ("apex.contrib.index_mul_2d", "fused_index_mul_2d")


# CUDA only ----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_kernel_is_loaded():
    status = loader.load(KERNELS)
    assert status.has_kernels, f"{KERNELS.name}: tier {status.tier} ({status.reason})"


@pytest.mark.gpu
def test_deterministic_mode_refuses_the_atomic_backward():
    in1, in2, idx1 = operands(4, 10, 8, torch.float32, "cuda")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _ops.index_mul_2d(in1, in2, idx1)  # the forward is deterministic
        with pytest.raises(RuntimeError, match="index_mul_2d_backward"):
            _ops.index_mul_2d_backward(in2, in1, in2, idx1)
    finally:
        torch.use_deterministic_algorithms(previous)


@pytest.mark.gpu
@pytest.mark.slow
def test_more_than_2_pow_31_elements():
    f = 64
    n2 = (1 << 31) // f + 3
    in1 = random_tensor((1000, f), torch.float16, "cuda")
    in2 = torch.randn(n2, f, dtype=torch.float16, device="cuda")
    idx1 = torch.randint(0, 1000, (n2,), device="cuda")
    out = _ops.index_mul_2d(in1, in2, idx1)
    for rows in (slice(0, 1000), slice(n2 - 1000, n2)):
        assert torch.equal(out[rows], in1[idx1[rows]] * in2[rows])
    del out
    grad_in1, grad_in2 = _ops.index_mul_2d_backward(in2, in1, in2, idx1)
    tail = slice(n2 - 1000, n2)
    assert_rounded_from(grad_in2[tail], in2[tail].double() * in1.double()[idx1[tail]])
    assert torch.isfinite(grad_in1).all()


@pytest.mark.gpu
def test_runs_on_the_current_stream():
    # work on another stream than the caller's would race with the side stream's writes to in2
    in1, source, idx1 = operands(100, 1 << 16, 64, torch.float16, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        in2 = source * 1.0
        out = _ops.index_mul_2d(in1, in2, idx1)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, in1[idx1] * source)


@pytest.mark.multigpu
def test_second_gpu():
    # cuda:0 is current; the tensors live on cuda:1
    in1, in2, idx1 = operands(50, 700, 24, torch.bfloat16, "cuda:1")
    out = _ops.index_mul_2d(in1, in2, idx1)
    assert out.device == in2.device
    assert torch.equal(out, in1[idx1] * in2)
    grad_in1, grad_in2 = _ops.index_mul_2d_backward(in2, in1, in2, idx1)
    assert grad_in1.device == in1.device
    assert_rounded_from(grad_in2, in2.double() * in1.double()[idx1])
