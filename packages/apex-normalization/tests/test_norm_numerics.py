"""Layer norm and RMS norm, forward and backward, against float64 references.

Every case runs through the public functions (so through the ops and their registered
backward) on the CPU (the PyTorch reference) and, marked ``gpu``, on CUDA (the kernels). The
float64 side is an independent formula (``F.layer_norm``, or the RMS formula) differentiated by
autograd, fed the same rounded inputs. Tolerances come from the dtype each result is stored in.

The hidden sizes cover every kernel path: sub-warp and warp row groups, whole-block groups,
several groups per block, the largest rows held in registers (16384 for the backward, 32768
for the forward of 16-bit types), rows longer than that, odd sizes (which take the streaming
kernels), one row, many rows, and a normalized shape of two dimensions.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from apex.normalization import functional as AF

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative error of one rounding to the dtype, with headroom for the float32 arithmetic.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# (input shape, number of normalized dimensions). The CUDA cases are parametrized here rather than
# through the shared ``device`` fixture, as ``where``, to go with the shapes.
SHAPES = [
    ((1, 1), 1),
    ((3, 7), 1),
    ((64, 8), 1),
    ((300, 96), 1),
    ((1, 1024), 1),
    ((257, 1000), 1),
    ((33, 1023), 1),
    ((2, 3, 5, 64), 2),
    ((40, 4096), 1),
    ((9, 16384), 1),
    ((5, 20000), 1),
    ((3, 65536), 1),
]
SMALL_SHAPES = [SHAPES[i] for i in (1, 3, 5, 6, 7, 9)]
# More rows than one wave of blocks holds on an H200: blocks walk several tiles, and the weight
# and bias gradients are added from many partial rows.
# (4099, 768) and (4099, 512): 16-bit and float32 rows of 96 and 128 vectors, with rows enough
# for the backward's one-warp rows (at least 16 per SM), the last tile part full.
MANY_ROWS = [((8192, 1024), 1), ((1536, 8192), 1), ((4099, 768), 1), ((4099, 512), 1)]
# On CUDA only (the CPU reference adds nothing): bfloat16 rows of 8192 elements fill two row
# groups per block exactly, so an even number of rows takes the unchecked backward kernel and an
# odd number the checked one (float32 rows of 8192 are one group per block: unchecked either way).
ODD_ROWS = [pytest.param("cuda", (1537, 8192), 1, id="cuda-1537x8192-n1", marks=pytest.mark.gpu)]


def cases(shapes, cpu=None):
    """(where, shape, ndim) cases: every shape (or only those of ``cpu``) on the CPU and, marked gpu,
    every shape on CUDA."""
    cases = []
    for shape, ndim in shapes:
        label = "x".join(map(str, shape)) + f"-n{ndim}"
        if cpu is None or shape in cpu:
            cases.append(pytest.param("cpu", shape, ndim, id=f"cpu-{label}"))
        cases.append(pytest.param("cuda", shape, ndim, id=f"cuda-{label}", marks=pytest.mark.gpu))
    return cases


def randn(shape, device, dtype, scale=1.0, shift=0.0):
    return (torch.randn(shape, dtype=torch.float64) * scale + shift).to(device=device, dtype=dtype)


def affine_params(normalized_shape, device, dtype, weight, bias):
    """Weights of magnitude 0.5 to 1.5 and either sign (memory_efficient divides by them)."""
    w = b = None
    if weight:
        magnitude = 0.5 + torch.rand(normalized_shape, dtype=torch.float64)
        sign = torch.where(torch.rand(normalized_shape) < 0.5, -1.0, 1.0).double()
        w = (magnitude * sign).to(device=device, dtype=dtype).requires_grad_()
    if bias:
        b = randn(normalized_shape, device, dtype, 0.3).requires_grad_()
    return w, b


def reference(x, residual, w, b, ndim, eps, rms):
    """float64 (output, residual sum) with autograd, from the same rounded inputs."""
    x64 = x.detach().double().requires_grad_()
    leaves = [x64]
    s = x64
    if residual is not None:
        r64 = residual.detach().double().requires_grad_()
        leaves.append(r64)
        rounded = (x.detach().float() + residual.detach().float()).to(x.dtype)
        exact = x64 + r64
        s = exact + (rounded.double() - exact).detach()  # the stored sum, straight-through gradient
    w64 = None if w is None else w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    leaves += [t for t in (w64, b64) if t is not None]
    shape = s.shape[s.dim() - ndim :]
    if rms:
        dims = tuple(range(-ndim, 0))
        y = s * torch.rsqrt(s.square().mean(dims, keepdim=True) + eps)
        if w64 is not None:
            y = y * w64
    else:
        y = F.layer_norm(s, shape, w64, b64, eps)
    return y, s, leaves


def assert_close(actual, expected, tol, what, scale=None):
    if scale is None:
        scale = expected.abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.double(), expected, rtol=tol, atol=tol * max(scale, 1e-3), msg=lambda m: f"{what}: {m}"
    )


def call(x, residual, w, b, normalized_shape, eps, rms, memory_efficient, mixed):
    if rms:
        if residual is not None:
            assert not mixed
            if w is None:
                return AF.fused_add_rms_norm(x, residual, normalized_shape, eps, memory_efficient)
            return AF.fused_add_rms_norm_affine(x, residual, w, normalized_shape, eps, memory_efficient)
        if w is None:
            return AF.fused_rms_norm(x, normalized_shape, eps, memory_efficient)
        fn = AF.mixed_dtype_fused_rms_norm_affine if mixed else AF.fused_rms_norm_affine
        return fn(x, w, normalized_shape, eps, memory_efficient)
    if residual is not None:
        if w is None:
            return AF.fused_add_layer_norm(x, residual, normalized_shape, eps, memory_efficient)
        return AF.fused_add_layer_norm_affine(x, residual, w, b, normalized_shape, eps, memory_efficient)
    if w is None:
        return AF.fused_layer_norm(x, normalized_shape, eps, memory_efficient)
    fn = AF.mixed_dtype_fused_layer_norm_affine if mixed else AF.fused_layer_norm_affine
    return fn(x, w, b, normalized_shape, eps, memory_efficient)


def check(
    device,
    shape,
    ndim,
    dtype,
    rms,
    weight=True,
    bias=True,
    weight_dtype=None,
    mixed=False,
    memory_efficient=False,
    residual=False,
    eps=1e-5,
):
    weight_dtype = weight_dtype or dtype
    normalized_shape = shape[len(shape) - ndim :]
    x = randn(shape, device, dtype, 2.0, 0.5).requires_grad_()
    r = randn(shape, device, dtype).requires_grad_() if residual else None
    w, b = affine_params(normalized_shape, device, weight_dtype, weight, bias and not rms)
    result = call(x, r, w, b, normalized_shape, eps, rms, memory_efficient, mixed)
    out, total = result if residual else (result, None)

    out_dtype = weight_dtype if mixed else dtype
    assert out.dtype == out_dtype and out.shape == x.shape and out.device == x.device
    y64, s64, leaves = reference(x, r, w, b, ndim, eps, rms)
    assert_close(out, y64, TOL[out_dtype], "output")
    if residual:
        assert total.dtype == dtype
        assert torch.equal(total, (x.detach().float() + r.detach().float()).to(dtype)), "residual sum"

    dy = randn(shape, device, out_dtype)
    ds = randn(shape, device, dtype) if residual else None
    ours = [t for t in (x, r, w, b) if t is not None]
    outputs, grads = ([out, total], [dy, ds]) if residual else ([out], [dy])
    got = torch.autograd.grad(outputs, ours, grads)
    ref_outputs = [y64, s64] if residual else [y64]
    ref_grads = [dy.double(), ds.double()] if residual else [dy.double()]
    expected = torch.autograd.grad(ref_outputs, leaves, ref_grads)
    # Recovering xhat from a rounded output costs about one rounding of the output.
    slack = 2.0 if memory_efficient and out_dtype != torch.float32 else 1.0
    # dx = rstd * (w * dy - ...) cancels; its error is relative to the size of the terms.
    dims = tuple(range(-ndim, 0))
    centered = s64 if rms else s64 - s64.mean(dims, keepdim=True)
    rstd = torch.rsqrt(centered.detach().square().mean(dims, keepdim=True) + eps)
    wdy = dy.double() * (1.0 if w is None else w.detach().double().abs().max())
    term_scale = (rstd * wdy).abs().max().item() if x.numel() else 1.0
    names = ("grad input", "grad residual") if residual else ("grad input",)
    names += ("grad weight", "grad bias")
    for name, g, e, t in zip(names, got, expected, ours):
        assert g.dtype == t.dtype and g.shape == t.shape
        scale = max(term_scale, e.abs().max().item()) if name.startswith("grad input") else None
        assert_close(g, e, slack * max(TOL[t.dtype], TOL[out_dtype]), name, scale)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves-input", "memory-efficient"])
@pytest.mark.parametrize("affine", ["none", "weight", "weight+bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("where", "shape", "ndim"), cases(SHAPES))
def test_layer_norm(where, shape, ndim, dtype, affine, memory_efficient):
    check(
        where,
        shape,
        ndim,
        dtype,
        rms=False,
        weight=affine != "none",
        bias=affine == "weight+bias",
        memory_efficient=memory_efficient,
    )


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves-input", "memory-efficient"])
@pytest.mark.parametrize("affine", ["none", "weight"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("where", "shape", "ndim"), cases(SHAPES))
def test_rms_norm(where, shape, ndim, dtype, affine, memory_efficient):
    check(where, shape, ndim, dtype, rms=True, weight=affine == "weight", memory_efficient=memory_efficient)


# The weight variants of the kernels that walk several tiles (the backward prefetches the next
# tile's rows): 16-bit input with float32 weights, with the output in either dtype.
MANY_ROWS_WEIGHTS = {"same": (None, False), "fp32": (torch.float32, False), "fp32-out": (torch.float32, True)}


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves-input", "memory-efficient"])
@pytest.mark.parametrize("weights", list(MANY_ROWS_WEIGHTS))
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
# The CPU reference's sums over many rows need one of these shapes (an odd row count): the
# others exist for the kernels' tiling and cost the CPU suite two minutes for nothing more.
@pytest.mark.parametrize(("where", "shape", "ndim"), cases(MANY_ROWS, cpu=[(4099, 768)]) + ODD_ROWS)
def test_many_rows(where, shape, ndim, dtype, rms, weights, memory_efficient):
    weight_dtype, mixed = MANY_ROWS_WEIGHTS[weights]
    if weight_dtype is not None and dtype == torch.float32:
        pytest.skip("float32 input takes float32 weights only")
    check(where, shape, ndim, dtype, rms, weight_dtype=weight_dtype, mixed=mixed, memory_efficient=memory_efficient)


# CUDA only: layer norm with a bias on rows long enough for blocks of more than 512 threads and
# more rows than fit at once, the one case where the forward's plan holds the weight and bias in
# registers while it prefetches the next tile.
HELD_WEIGHTS = [
    pytest.param(torch.float32, (1536, 16384), id="cuda-float32-1536x16384", marks=pytest.mark.gpu),
    pytest.param(torch.bfloat16, (1000, 32768), id="cuda-bfloat16-1000x32768", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize(("dtype", "shape"), HELD_WEIGHTS)
def test_prefetching_forward_with_held_weight_and_bias(dtype, shape):
    check("cuda", shape, 1, dtype, rms=False)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves-input", "memory-efficient"])
@pytest.mark.parametrize("mixed", [False, True], ids=["input-dtype-out", "mixed-weight-dtype-out"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("where", "shape", "ndim"), cases(SHAPES))
def test_float32_weights_with_16_bit_input(where, shape, ndim, dtype, rms, mixed, memory_efficient):
    check(where, shape, ndim, dtype, rms, weight_dtype=torch.float32, mixed=mixed, memory_efficient=memory_efficient)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves-sum", "memory-efficient"])
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("where", "shape", "ndim"), cases(SMALL_SHAPES))
def test_residual_add(where, shape, ndim, dtype, rms, affine, memory_efficient):
    check(where, shape, ndim, dtype, rms, weight=affine, bias=affine, memory_efficient=memory_efficient, residual=True)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("where", "shape", "ndim"), cases(SMALL_SHAPES))
def test_statistics_are_float32(where, shape, ndim, dtype, rms):
    """mean and rstd come back in float32 at float32 accuracy, whatever the input dtype."""
    normalized_shape = shape[len(shape) - ndim :]
    x = randn(shape, where, dtype, 3.0, 10.0)  # a large mean: cancellation would show
    _, mean, rstd = torch.ops.apex_normalization.norm_forward(x, None, None, normalized_shape, 1e-5, rms)
    x64 = x.double()
    dims = tuple(range(-ndim, 0))
    lead = shape[: len(shape) - ndim]
    assert rstd.dtype == torch.float32 and tuple(rstd.shape) == lead
    if rms:
        assert mean.numel() == 0
        var = x64.square().mean(dims)
    else:
        assert mean.dtype == torch.float32 and tuple(mean.shape) == lead
        torch.testing.assert_close(mean.double(), x64.mean(dims), rtol=1e-6, atol=1e-6)
        var = x64.var(dims, unbiased=False)
    torch.testing.assert_close(rstd.double(), torch.rsqrt(var + 1e-5), rtol=2e-6, atol=0)


def test_eps_is_used(device):
    x = torch.zeros(4, 16, device=device)
    x[:, 0] = 1e-3  # variance ~6e-8: eps dominates
    out = AF.fused_layer_norm(x, 16, eps=1e-2)
    expected = F.layer_norm(x.double(), (16,), eps=1e-2)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)


def test_empty_batch(device):
    x = torch.randn(0, 3, 32, device=device, requires_grad=True)
    w = torch.ones(32, device=device, requires_grad=True)
    b = torch.zeros(32, device=device, requires_grad=True)
    out = AF.fused_layer_norm_affine(x, w, b, 32)
    assert out.shape == (0, 3, 32)
    out.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


def test_empty_batch_rms(device):
    x = torch.randn(0, 3, 64, device=device, requires_grad=True)
    w = torch.ones(64, device=device, requires_grad=True)
    out = AF.fused_rms_norm_affine(x, w, 64)
    assert out.shape == (0, 3, 64)
    out.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))


def test_constant_rows_give_bias(device):
    """Zero variance: xhat is 0, the output is the bias, the gradient finite."""
    x = torch.full((5, 40), 3.0, device=device, requires_grad=True)
    w = torch.randn(40, device=device, requires_grad=True)
    b = torch.randn(40, device=device, requires_grad=True)
    out = AF.fused_layer_norm_affine(x, w, b, 40, eps=1e-5)
    torch.testing.assert_close(out, b.detach().expand(5, 40), rtol=0, atol=1e-5)
    dy = torch.randn_like(out)
    out.backward(dy)
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(w.grad, torch.zeros_like(w), rtol=0, atol=1e-5)
    torch.testing.assert_close(b.grad, dy.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("where", "shape", "ndim"), cases(MANY_ROWS))
def test_many_rows_statistics_with_outliers(where, shape, ndim, dtype):
    """Layer norm statistics of rows with a large mean and one element far out (here the first,
    which some one-pass methods take as their shift) stay at float32 accuracy."""
    x = randn(shape, where, torch.float32, 3.0, 1000.0)
    x[..., 0] += 300.0
    x[..., -1] -= 100.0
    x = x.to(dtype)
    _, mean, rstd = torch.ops.apex_normalization.norm_forward(x, None, None, shape[-ndim:], 1e-5, False)
    x64 = x.double()
    torch.testing.assert_close(mean.double(), x64.mean(-1), rtol=1e-6, atol=1e-6)
    var = x64.var(-1, unbiased=False)
    torch.testing.assert_close(rstd.double(), torch.rsqrt(var + 1e-5), rtol=2e-6, atol=0)
