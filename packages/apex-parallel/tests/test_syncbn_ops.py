"""The apex_parallel SyncBatchNorm ops against a float64 reference: numerics for every layout and
dtype, odd and empty sizes, opcheck, torch.compile, and bad input."""

from __future__ import annotations

import pytest
import torch

from apex.parallel import _ops, _reference

OPS = torch.ops.apex_parallel
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative tolerance of a result rounded to the dtype (statistics stay float32).
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# (shape, channel_last): channels-first shapes have C at dim 1, channels-last ones last.
SHAPES = [
    ((6, 3, 7, 7), False),
    ((5, 65, 1, 1), False),
    ((4, 1, 5, 3), False),
    ((3, 16, 8, 8), False),
    ((7, 5), False),
    ((2, 4, 3, 5, 2), False),
    ((6, 7, 7, 3), True),
    ((4, 5, 3, 65), True),
    ((9, 1), True),
    ((3, 2, 2, 16), True),
]
SHAPE_IDS = [("c_last-" if last else "nchw-") + "x".join(map(str, s)) for s, last in SHAPES]


def channels_of(shape, channel_last):
    return shape[-1] if channel_last else shape[1]


def f64(t):
    return None if t is None else t.double()


def assert_close(actual, expected, dtype, what):
    tol = TOL[dtype]
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual.double().cpu(), expected.cpu(), rtol=tol, atol=tol * (scale + 1.0), msg=lambda m: f"{what}: {m}"
    )


def make_case(device, shape, channel_last, dtype, weight_dtype=torch.float32):
    c = channels_of(shape, channel_last)
    x = (torch.randn(shape, device=device) * 2 + 0.7).to(dtype)
    dy = torch.randn(shape, device=device).to(dtype)
    z = torch.randn(shape, device=device).to(dtype)
    weight = (torch.rand(c, device=device) + 0.5).to(weight_dtype)
    bias = torch.randn(c, device=device).to(weight_dtype)
    return x, dy, z, weight, bias


def welford_op(channel_last):
    return OPS.welford_mean_var_c_last if channel_last else OPS.welford_mean_var


# numerics --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("shape", "channel_last"), SHAPES, ids=SHAPE_IDS)
def test_forward_backward_ops(device, shape, channel_last, dtype):
    x, dy, z, weight, bias = make_case(device, shape, channel_last, dtype)
    mean, var = welford_op(channel_last)(x)
    ref_mean, ref_var = _reference.welford_mean_var(x.double(), channel_last)
    assert mean.dtype == var.dtype == torch.float32
    assert_close(mean, ref_mean, torch.float32, "mean")
    assert_close(var, ref_var, torch.float32, "var_biased")

    count = torch.tensor([x.numel() / x.shape[-1 if channel_last else 1]], device=device)
    mean, invstd = OPS.welford_parallel(mean[None], var[None], count, 1e-5)
    ref_mean, ref_invstd = _reference.welford_parallel(ref_mean[None], ref_var[None], count.double(), 1e-5)
    assert_close(invstd, ref_invstd, torch.float32, "invstd")

    args64 = (f64(x), ref_mean, ref_invstd, f64(weight), f64(bias))
    if channel_last:
        out = OPS.batch_norm_forward_c_last(x, None, mean, invstd, weight, bias, False)
        fused = OPS.batch_norm_forward_c_last(x, z, mean, invstd, weight, bias, True)
        ref_fused = _reference.batch_norm_forward(x.double(), f64(z), *args64[1:], True, True)
        assert_close(fused, ref_fused, dtype, "forward with z and relu")
    else:
        out = OPS.batch_norm_forward(x, mean, invstd, weight, bias)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, _reference.batch_norm_forward(args64[0], None, *args64[1:], False, channel_last), dtype, "out")

    reduce = OPS.reduce_bn_c_last if channel_last else OPS.reduce_bn
    sum_dy, sum_dy_xmu, grad_weight, grad_bias = reduce(dy, x, mean, invstd, weight)
    ref = _reference.reduce_bn(dy.double(), x.double(), ref_mean, ref_invstd, f64(weight), channel_last)
    # The sums run in float32 over float32 products of the rounded inputs.
    for name, actual, expected in zip(
        ("sum_dy", "sum_dy_xmu", "grad_weight", "grad_bias"), (sum_dy, sum_dy_xmu, grad_weight, grad_bias), ref
    ):
        assert_close(actual, expected, torch.float32 if dtype == torch.float32 else torch.float16, name)

    backward = OPS.batch_norm_backward_c_last if channel_last else OPS.batch_norm_backward
    grad_input = backward(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count)
    ref_grad = _reference.batch_norm_backward(
        dy.double(), x.double(), ref_mean, ref_invstd, f64(weight), ref[0], ref[1], count.double(), channel_last
    )
    assert grad_input.dtype == dtype
    assert_close(grad_input, ref_grad, dtype, "grad_input")

    if channel_last:
        masked = OPS.relu_backward_c_last(dy, x, z, mean, invstd, weight, bias)
        ref_masked = _reference.relu_backward(dy.double(), x.double(), f64(z), *args64[1:], True)
        assert_close(masked, ref_masked, dtype, "relu_backward")


FUSED_SHAPES = [s for s, last in SHAPES if last] + [(0, 6), (5, 0, 4)]


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=["x".join(map(str, s)) for s in FUSED_SHAPES])
def test_fused_relu_backward_ops(device, shape, dtype):
    """reduce_bn_relu_c_last and batch_norm_backward_relu_c_last against float64 references of
    relu_backward followed by reduce_bn / batch_norm_backward, and against our unfused ops, with and
    without z, with and without z's gradient; the reduction's masked output (masked=True) equal to
    relu_backward_c_last's, with the same sums as without it."""
    x, dy, z, weight, bias = make_case(device, shape, True, dtype)
    c = shape[-1]
    mean, var = OPS.welford_mean_var_c_last(x)
    count = torch.tensor([x.numel() / max(c, 1)], device=device)
    mean, invstd = OPS.welford_parallel(mean[None], var[None], count, 1e-5)
    sums_dtype = torch.float32 if dtype in (torch.float32, torch.float64) else torch.float16

    def near(actual, expected, tol_dtype, what):
        if actual.dtype == torch.float64:  # float64 to float64 accuracy (float32 weights' gradients: float32)
            torch.testing.assert_close(actual.double(), expected, rtol=1e-10, atol=1e-10, msg=lambda m: f"{what}: {m}")
        else:
            assert_close(actual, expected, tol_dtype, what)

    for zi in (z, None):
        args = (mean, invstd, weight, bias)
        args64 = (f64(mean), f64(invstd), f64(weight), f64(bias))
        masked64 = _reference.relu_backward(f64(dy), f64(x), f64(zi), *args64, True)
        *sums, no_masked = OPS.reduce_bn_relu_c_last(dy, x, zi, *args)
        assert no_masked.numel() == 0
        ref = _reference.reduce_bn(masked64, f64(x), args64[0], args64[1], args64[2], True)
        for name, actual, expected in zip(("sum_dy", "sum_dy_xmu", "grad_weight", "grad_bias"), sums, ref):
            near(actual, expected, sums_dtype, name)
        masked = OPS.relu_backward_c_last(dy, x, zi, *args)
        *sums_too, masked_too = OPS.reduce_bn_relu_c_last(dy, x, zi, *args, True)
        assert masked_too.dtype == dtype and masked_too.shape == x.shape
        torch.testing.assert_close(masked_too, masked, rtol=0, atol=0)  # the mask: exact
        for a, e in zip(sums_too, sums):
            torch.testing.assert_close(a, e, rtol=0, atol=0)
        unfused = OPS.reduce_bn_c_last(masked, x, mean, invstd, weight)
        for a, e in zip(sums, unfused):
            torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6 * (1 + e.abs().max().item() if e.numel() else 1))
        for want_z in (True, False):
            grad_input, grad_z = OPS.batch_norm_backward_relu_c_last(dy, x, zi, *args, sums[0], sums[1], count, want_z)
            ref_grad = _reference.batch_norm_backward(
                masked64, f64(x), args64[0], args64[1], args64[2], ref[0], ref[1], count.double(), True
            )
            assert grad_input.dtype == dtype and grad_input.shape == x.shape
            near(grad_input, ref_grad, dtype, "grad_input")
            unfused_grad = OPS.batch_norm_backward_c_last(masked, x, mean, invstd, weight, sums[0], sums[1], count)
            torch.testing.assert_close(grad_input, unfused_grad)
            if want_z:
                torch.testing.assert_close(grad_z, masked, rtol=0, atol=0)  # the mask: exact
            else:
                assert grad_z.numel() == 0


@pytest.mark.parametrize(("shape", "channel_last"), SHAPES, ids=SHAPE_IDS)
def test_float64_ops(device, shape, channel_last):
    """float64 input (as upstream's Python SyncBatchNorm takes it): statistics, sums and gradients in
    float64, to float64 accuracy (weight float64 or float32; count float32 or float64)."""
    for weight_dtype in (torch.float64, torch.float32):
        x, dy, z, weight, bias = make_case(device, shape, channel_last, torch.float64, weight_dtype)
        mean, var = welford_op(channel_last)(x)
        ref_mean, ref_var = _reference.welford_mean_var(x, channel_last)
        assert mean.dtype == var.dtype == torch.float64
        tight = dict(rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(mean, ref_mean, **tight)
        torch.testing.assert_close(var, ref_var, **tight)
        n = x.numel() // x.shape[-1 if channel_last else 1]
        for count in (torch.tensor([n], device=device, dtype=torch.float32), torch.tensor([n], device=device).double()):
            running = (torch.zeros_like(mean), torch.ones_like(var))
            merged, invstd = OPS.welford_parallel(mean[None], var[None], count, 1e-5, *running, 0.5)
            assert merged.dtype == invstd.dtype == torch.float64
            torch.testing.assert_close(invstd, torch.rsqrt(ref_var + 1e-5), **tight)
            torch.testing.assert_close(running[0], ref_mean * 0.5, **tight)
            unbiased = ref_var * n / (n - 1) if n > 1 else torch.full_like(ref_var, float("nan"))
            torch.testing.assert_close(running[1], 0.5 + unbiased * 0.5, equal_nan=True, **tight)
        args = (merged, invstd, weight, bias)
        if channel_last:
            out = OPS.batch_norm_forward_c_last(x, z, *args, True)
            expected = _reference.batch_norm_forward(x, z, *args, True, True)
            masked = OPS.relu_backward_c_last(dy, x, z, *args)
            torch.testing.assert_close(masked, _reference.relu_backward(dy, x, z, *args, True), **tight)
        else:
            out = OPS.batch_norm_forward(x, *args)
            expected = _reference.batch_norm_forward(x, None, *args, False, False)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, expected, **tight)
        reduce = OPS.reduce_bn_c_last if channel_last else OPS.reduce_bn
        sums = reduce(dy, x, merged, invstd, weight)
        ref = _reference.reduce_bn(dy, x, merged, invstd, weight, channel_last)
        assert [t.dtype for t in sums] == [torch.float64, torch.float64, weight_dtype, weight_dtype]
        for a, e in zip(sums, ref):
            torch.testing.assert_close(a, e, **tight)
        backward = OPS.batch_norm_backward_c_last if channel_last else OPS.batch_norm_backward
        grad_input = backward(dy, x, merged, invstd, weight, sums[0], sums[1], count)
        assert grad_input.dtype == torch.float64
        expected = _reference.batch_norm_backward(dy, x, merged, invstd, weight, *sums[:2], count, channel_last)
        torch.testing.assert_close(grad_input, expected, **tight)


WELFORD_C_LAST_SHAPES = [(2048, 64), (8, 56, 56, 64), (3, 1000, 7), (100003, 3), (4, 17, 17, 130), (1, 1, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
@pytest.mark.parametrize("shape", WELFORD_C_LAST_SHAPES, ids=["x".join(map(str, s)) for s in WELFORD_C_LAST_SHAPES])
def test_welford_c_last_kernel(dtype, shape):
    """The channels-last Welford kernel against float64, over row counts that take many flushes and
    chunks, with a mean far from zero (300, std 2)."""
    torch.manual_seed(0)
    x = (torch.randn(shape, device="cuda", dtype=torch.float64) * 2 + 300).to(dtype)
    mean, var = OPS.welford_mean_var_c_last(x)
    ref_mean, ref_var = _reference.welford_mean_var(x.double(), True)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=0)
    torch.testing.assert_close(mean.double(), ref_mean, **tol, msg=lambda m: f"mean: {m}")
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=3e-4, atol=0)
    torch.testing.assert_close(var.double(), ref_var, **tol, msg=lambda m: f"var: {m}")


@pytest.mark.parametrize("channel_last", [False, True], ids=["nchw", "c_last"])
def test_batch_norm_matches_torch(device, channel_last):
    """The ops composed as the module does equal torch's batch norm (weight in the input dtype too)."""
    shape = (5, 4, 6, 3) if not channel_last else (5, 6, 3, 4)
    x, _dy, _, weight, bias = make_case(device, shape, channel_last, torch.float16, weight_dtype=torch.float16)
    mean, var = welford_op(channel_last)(x)
    count = torch.tensor([x.numel() / 4.0], device=device)
    mean, invstd = OPS.welford_parallel(mean[None], var[None], count, 1e-3)
    forward = (
        OPS.batch_norm_forward_c_last(x, None, mean, invstd, weight, bias, False)
        if channel_last
        else OPS.batch_norm_forward(x, mean, invstd, weight, bias)
    )
    xt = x.double().movedim(-1, 1) if channel_last else x.double()
    expected = torch.nn.functional.batch_norm(xt, None, None, weight.double(), bias.double(), True, 0.0, 1e-3)
    expected = expected.movedim(1, -1) if channel_last else expected
    assert_close(forward, expected, torch.float16, "forward")


def test_welford_parallel_merges_uneven_ranks(device):
    ranks = [torch.randn(n, 6, device=device) * (r + 1) + r for r, n in enumerate([5, 1, 0, 12])]
    stats = [_reference.welford_mean_var(t, True) for t in ranks]
    mean = torch.stack([m for m, _ in stats]).float()
    var = torch.stack([v for _, v in stats]).float()
    count = torch.tensor([float(t.shape[0]) for t in ranks], device=device)
    running_mean = torch.randn(6, device=device)
    running_var = torch.rand(6, device=device) + 0.5
    expected_rm = running_mean.double() * 0.7 + torch.cat(ranks).double().mean(0) * 0.3
    expected_rv = running_var.double() * 0.7 + torch.cat(ranks).double().var(0, unbiased=True) * 0.3
    merged, invstd = OPS.welford_parallel(mean, var, count, 1e-5, running_mean, running_var, 0.3)
    whole = torch.cat(ranks).double()
    assert_close(merged, whole.mean(0), torch.float32, "mean")
    assert_close(invstd, torch.rsqrt(whole.var(0, unbiased=False) + 1e-5), torch.float32, "invstd")
    assert_close(running_mean, expected_rm, torch.float32, "running_mean")
    assert_close(running_var, expected_rv, torch.float32, "running_var")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_welford_parallel_low_precision_running_stats(device, dtype):
    mean = torch.randn(2, 5, device=device)
    var = torch.rand(2, 5, device=device)
    count = torch.tensor([3.0, 4.0], device=device)
    running_mean = torch.zeros(5, device=device, dtype=dtype)
    running_var = torch.ones(5, device=device, dtype=dtype)
    expected_mean, _ = _reference.welford_parallel(mean.double(), var.double(), count.double(), 1e-5)
    OPS.welford_parallel(mean, var, count, 1e-5, running_mean, running_var, 0.5)
    assert running_mean.dtype == dtype
    assert_close(running_mean, expected_mean * 0.5, dtype, "running_mean")


def test_strided_gathered_stats(device):
    """welford_parallel reads the per-rank rows of one gathered [W, 2C + 1] buffer in place."""
    gathered = torch.randn(3, 2 * 4 + 1, device=device)
    gathered[:, 4:8] = gathered[:, 4:8].abs()
    gathered[:, -1] = torch.tensor([2.0, 5.0, 3.0])
    mean, var, count = gathered[:, :4], gathered[:, 4:8], gathered[:, -1]
    actual = OPS.welford_parallel(mean, var, count, 1e-5)
    expected = _reference.welford_parallel(mean.double(), var.double(), count.double(), 1e-5)
    for a, e, name in zip(actual, expected, ("mean", "invstd")):
        assert_close(a, e, torch.float32, name)


@pytest.mark.parametrize("channel_last", [False, True], ids=["nchw", "c_last"])
def test_empty_batch(device, channel_last):
    """No elements: statistics and sums are 0 (so an empty rank counts for nothing), outputs empty."""
    shape = (0, 3, 4, 4) if not channel_last else (0, 4, 4, 3)
    x = torch.empty(shape, device=device, dtype=torch.bfloat16)
    mean, var = welford_op(channel_last)(x)
    assert torch.equal(mean.cpu(), torch.zeros(3)) and torch.equal(var.cpu(), torch.zeros(3))
    invstd = torch.ones(3, device=device)
    weight = torch.ones(3, device=device)
    reduce = OPS.reduce_bn_c_last if channel_last else OPS.reduce_bn
    sums = reduce(x, x, mean, invstd, weight)
    for t in sums:
        assert torch.equal(t.cpu(), torch.zeros(3, dtype=t.dtype))
    backward = OPS.batch_norm_backward_c_last if channel_last else OPS.batch_norm_backward
    count = torch.tensor([0.0, 5.0], device=device)
    assert backward(x, x, mean, invstd, weight, sums[0], sums[1], count).shape == shape
    if channel_last:
        assert OPS.batch_norm_forward_c_last(x, x, mean, invstd, weight, None, True).shape == shape
    else:
        assert OPS.batch_norm_forward(x, mean, invstd, weight, None).shape == shape


def test_no_affine(device):
    x, dy, _, _, _ = make_case(device, (4, 3, 5, 5), False, torch.float32)
    mean, var = OPS.welford_mean_var(x)
    invstd = torch.rsqrt(var + 1e-5)
    out = OPS.batch_norm_forward(x, mean, invstd, None, None)
    expected = torch.nn.functional.batch_norm(x.double(), None, None, None, None, True, 0.0, 1e-5)
    assert_close(out, expected, torch.float32, "out")
    sum_dy, sum_dy_xmu, grad_weight, grad_bias = OPS.reduce_bn(dy, x, mean, invstd, None)
    assert grad_weight.numel() == 0 and grad_bias.numel() == 0
    ref = _reference.reduce_bn(dy.double(), x.double(), mean.double(), invstd.double(), None, False)
    assert_close(sum_dy, ref[0], torch.float32, "sum_dy")
    assert_close(sum_dy_xmu, ref[1], torch.float32, "sum_dy_xmu")


@pytest.mark.gpu
def test_multi_chunk_reductions():
    """Large enough that the reductions split channels into chunks merged by a second kernel."""
    for shape, channel_last in [((64, 8, 56, 56), False), ((64 * 56 * 56, 8), True), ((32, 3, 17, 19), False)]:
        x = (torch.randn(shape, device="cuda") * 3 + 5).to(torch.bfloat16)
        dy = torch.randn(shape, device="cuda").to(torch.bfloat16)
        mean, var = welford_op(channel_last)(x)
        ref_mean, ref_var = _reference.welford_mean_var(x.double(), channel_last)
        assert_close(mean, ref_mean, torch.float32, "mean")
        assert_close(var, ref_var, torch.float32, "var")
        invstd = torch.rsqrt(var + 1e-5)
        reduce = OPS.reduce_bn_c_last if channel_last else OPS.reduce_bn
        sums = reduce(dy, x, mean, invstd, None)
        ref = _reference.reduce_bn(dy.double(), x.double(), mean.double(), invstd.double(), None, channel_last)
        assert_close(sums[0], ref[0], torch.float16, "sum_dy")
        assert_close(sums[1], ref[1], torch.float16, "sum_dy_xmu")
        # Deterministic: the same bits on a second run.
        assert torch.equal(welford_op(channel_last)(x)[1], var)
        assert torch.equal(reduce(dy, x, mean, invstd, None)[1], sums[1])


@pytest.mark.gpu
def test_other_device_and_stream():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs a second GPU")
    device = torch.device("cuda", 1)
    x, _dy, _, weight, bias = make_case(device, (4, 6, 5, 5), False, torch.float32)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        mean, var = OPS.welford_mean_var(x)
        out = OPS.batch_norm_forward(x, mean, torch.rsqrt(var + 1e-5), weight, bias)
    stream.synchronize()
    assert out.device == device
    expected = torch.nn.functional.batch_norm(x.double(), None, None, weight.double(), bias.double(), True, 0.0, 1e-5)
    assert_close(out, expected, torch.float32, "out")


# opcheck ---------------------------------------------------------------------------------------


def opcheck_cases(device):
    x, dy, _z, weight, bias = make_case(device, (3, 4, 5, 3), False, torch.float16)
    xl, dyl, zl, _, _ = make_case(device, (3, 5, 3, 4), True, torch.float16)
    mean, var = OPS.welford_mean_var(x)
    invstd = torch.rsqrt(var + 1e-5)
    count = torch.tensor([45.0], device=device)
    gathered = torch.rand(2, 9, device=device) + 1
    return {
        "welford_mean_var": (OPS.welford_mean_var.default, (x,)),
        "welford_mean_var_c_last": (OPS.welford_mean_var_c_last.default, (xl,)),
        "welford_parallel": (
            OPS.welford_parallel.default,
            (
                gathered[:, :4],
                gathered[:, 4:8],
                gathered[:, -1],
                1e-5,
                torch.zeros(4, device=device),
                torch.ones(4, device=device),
                0.1,
            ),
        ),
        "welford_parallel-no-running": (OPS.welford_parallel.default, (mean[None], var[None], count, 1e-5)),
        "batch_norm_forward": (OPS.batch_norm_forward.default, (x, mean, invstd, weight, bias)),
        "batch_norm_forward_c_last": (
            OPS.batch_norm_forward_c_last.default,
            (xl, zl, mean, invstd, weight, bias, True),
        ),
        "reduce_bn": (OPS.reduce_bn.default, (dy, x, mean, invstd, weight)),
        "reduce_bn_c_last": (OPS.reduce_bn_c_last.default, (dyl, xl, mean, invstd, None)),
        "batch_norm_backward": (
            OPS.batch_norm_backward.default,
            (dy, x, mean, invstd, weight, mean.clone(), var.clone(), count),
        ),
        "batch_norm_backward_c_last": (
            OPS.batch_norm_backward_c_last.default,
            (dyl, xl, mean, invstd, None, mean.clone(), var.clone(), count),
        ),
        "relu_backward_c_last": (OPS.relu_backward_c_last.default, (dyl, xl, zl, mean, invstd, weight, bias)),
        "reduce_bn_relu_c_last": (OPS.reduce_bn_relu_c_last.default, (dyl, xl, zl, mean, invstd, weight, bias)),
        "reduce_bn_relu_c_last-masked": (
            OPS.reduce_bn_relu_c_last.default,
            (dyl, xl, zl, mean, invstd, weight, bias, True),
        ),
        "reduce_bn_relu_c_last-no-z": (
            OPS.reduce_bn_relu_c_last.default,
            (dyl, xl, None, mean, invstd, None, None),
        ),
        "batch_norm_backward_relu_c_last": (
            OPS.batch_norm_backward_relu_c_last.default,
            (dyl, xl, zl, mean, invstd, weight, bias, mean.clone(), var.clone(), count, True),
        ),
        "batch_norm_backward_relu_c_last-no-z": (
            OPS.batch_norm_backward_relu_c_last.default,
            (dyl, xl, None, mean, invstd, weight, None, mean.clone(), var.clone(), count, False),
        ),
        # float64: float64 statistics and sums (the fakes follow the input's dtype)
        "welford_mean_var-float64": (OPS.welford_mean_var.default, (x.double(),)),
        "welford_parallel-float64": (
            OPS.welford_parallel.default,
            (mean[None].double(), var[None].double(), count.double(), 1e-5, mean.double(), var.double(), 0.1),
        ),
        "reduce_bn_c_last-float64": (
            OPS.reduce_bn_c_last.default,
            (dyl.double(), xl.double(), mean.double(), invstd.double(), None),
        ),
        "batch_norm_backward-float64": (
            OPS.batch_norm_backward.default,
            (dy.double(), x.double(), mean.double(), invstd.double(), weight, mean.double(), var.double(), count),
        ),
    }


OPCHECK_NAMES = list(opcheck_cases("cpu"))


@pytest.mark.parametrize("name", OPCHECK_NAMES)
def test_opcheck(device, name):
    op, args = opcheck_cases(device)[name]
    torch.library.opcheck(op, args)


# bad input ---------------------------------------------------------------------------------------


def bad_cases(device):
    x, dy, z, weight, bias = make_case(device, (3, 4, 5, 3), False, torch.float32)
    stat = torch.ones(4, device=device)
    count = torch.tensor([45.0], device=device)
    return [
        (
            "integer input",
            lambda: OPS.welford_mean_var(x.long()),
            TypeError,
            r"welford_mean_var: input has dtype torch.int64; expected one of float32, float16, bfloat16, float64",
        ),
        (
            "float32 statistics of a float64 input",
            lambda: OPS.batch_norm_forward(x.double(), stat, stat, None, None),
            TypeError,
            r"batch_norm_forward: mean has dtype torch.float32; expected torch.float64 \(the input's statistics\)",
        ),
        (
            "1-D input",
            lambda: OPS.welford_mean_var_c_last(stat),
            ValueError,
            r"welford_mean_var_c_last: input must have at least 2 dimensions, got shape \(4,\)",
        ),
        (
            "non-contiguous input",
            lambda: OPS.welford_mean_var(x.transpose(2, 3)),
            ValueError,
            r"welford_mean_var: input is not contiguous",
        ),
        (
            "mean shape",
            lambda: OPS.batch_norm_forward(x, stat[:3], stat, weight, bias),
            ValueError,
            r"batch_norm_forward: mean has shape \(3,\), expected \(4,\)",
        ),
        (
            "invstd dtype",
            lambda: OPS.batch_norm_forward(x, stat, stat.half(), weight, bias),
            TypeError,
            r"batch_norm_forward: invstd has dtype torch.float16; expected torch.float32",
        ),
        (
            "weight dtype",
            lambda: OPS.batch_norm_forward(x.half(), stat, stat, weight.bfloat16(), None),
            TypeError,
            r"batch_norm_forward: weight has dtype torch.bfloat16 but the input has torch.float16; "
            r"weight must be float16 or float32",
        ),
        (
            "bias without weight",
            lambda: OPS.batch_norm_forward(x, stat, stat, None, bias),
            ValueError,
            r"batch_norm_forward: bias given without weight",
        ),
        (
            "z shape",
            lambda: OPS.batch_norm_forward_c_last(x, z[:1], stat[:3], stat[:3], None, None, True),
            ValueError,
            r"batch_norm_forward_c_last: z has shape \(1, 4, 5, 3\) but input has \(3, 4, 5, 3\)",
        ),
        (
            "grad_output dtype",
            lambda: OPS.reduce_bn(dy.half(), x, stat, stat, weight),
            TypeError,
            r"reduce_bn: grad_output has dtype torch.float16 but input has torch.float32",
        ),
        (
            "count dtype",
            lambda: OPS.batch_norm_backward(dy, x, stat, stat, weight, stat, stat, count.long()),
            TypeError,
            r"batch_norm_backward: count has dtype torch.int64; expected torch.float32",
        ),
        (
            "sum_dy shape",
            lambda: OPS.batch_norm_backward_c_last(dy, x, stat[:3], stat[:3], None, stat, stat[:3], count),
            ValueError,
            r"batch_norm_backward_c_last: sum_dy has shape \(4,\), expected \(3,\)",
        ),
        (
            "fused relu: z shape",
            lambda: OPS.reduce_bn_relu_c_last(dy, x, z[:1], stat[:3], stat[:3], None, None),
            ValueError,
            r"reduce_bn_relu_c_last: z has shape \(1, 4, 5, 3\) but input has \(3, 4, 5, 3\)",
        ),
        (
            "fused relu: grad_output dtype",
            lambda: OPS.batch_norm_backward_relu_c_last(
                dy.half(), x, None, stat[:3], stat[:3], None, None, stat[:3], stat[:3], count
            ),
            TypeError,
            r"batch_norm_backward_relu_c_last: grad_output has dtype torch.float16 but input has torch.float32",
        ),
        (
            "fused relu: bias without weight",
            lambda: OPS.reduce_bn_relu_c_last(dy, x, None, stat[:3], stat[:3], None, bias[:3]),
            ValueError,
            r"reduce_bn_relu_c_last: bias given without weight",
        ),
        (
            "count per rank",
            lambda: OPS.welford_parallel(stat[None], stat[None], count.repeat(2), 1e-5),
            ValueError,
            r"welford_parallel: count has 2 elements, expected one per rank \(1\)",
        ),
        (
            "running pair",
            lambda: OPS.welford_parallel(stat[None], stat[None], count, 1e-5, stat.clone(), None),
            ValueError,
            r"welford_parallel: running_mean and running_var must be given together",
        ),
        (
            "running dtype",
            lambda: OPS.welford_parallel(stat[None], stat[None], count, 1e-5, stat.long(), stat.long()),
            TypeError,
            r"welford_parallel: running_mean has dtype torch.int64; expected one of float32",
        ),
        (
            "mean 1-D",
            lambda: OPS.welford_parallel(stat, stat, count, 1e-5),
            ValueError,
            r"welford_parallel: mean must be 2-D \(ranks, channels\), got shape \(4,\)",
        ),
        (
            "strided mean",
            lambda: OPS.welford_parallel(stat.repeat(1, 2)[:, ::2], stat[None], count, 1e-5),
            ValueError,
            r"welford_parallel: mean must have unit stride in its last dimension",
        ),
    ]


BAD_NAMES = [case[0] for case in bad_cases("cpu")]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_input(device, name):
    _, call, error, message = next(case for case in bad_cases(device) if case[0] == name)
    with pytest.raises(error, match=message):
        call()


@pytest.mark.gpu
def test_wrong_device():
    x = torch.randn(3, 4, 5, device="cuda")
    stat = torch.ones(4)
    with pytest.raises(ValueError, match=r"batch_norm_forward: mean is on cpu, expected cuda:0"):
        OPS.batch_norm_forward(x, stat, stat.cuda(), None, None)


# torch.compile ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("channel_last", [False, True], ids=["nchw", "c_last"])
def test_torch_compile_fullgraph(channel_last):
    def step(x, z, weight, bias, running_mean, running_var):
        welford = OPS.welford_mean_var_c_last if channel_last else OPS.welford_mean_var
        mean, var = welford(x)
        count = torch.full((1,), x.numel() / weight.numel(), device=x.device)
        mean, invstd = OPS.welford_parallel(mean[None], var[None], count, 1e-5, running_mean, running_var, 0.1)
        if channel_last:
            return OPS.batch_norm_forward_c_last(x, z, mean, invstd, weight, bias, True)
        return OPS.batch_norm_forward(x, mean, invstd, weight, bias)

    shape = (4, 6, 5, 8) if channel_last else (4, 8, 5, 6)
    x, _, z, weight, bias = make_case("cuda", shape, channel_last, torch.bfloat16)
    buffers = [torch.zeros(8, device="cuda"), torch.ones(8, device="cuda")]
    eager_buffers = [b.clone() for b in buffers]
    compiled = torch.compile(step, fullgraph=True)
    out = compiled(x, z, weight, bias, *buffers)
    expected = step(x, z, weight, bias, *eager_buffers)
    assert torch.equal(out, expected)
    for a, e in zip(buffers, eager_buffers):
        assert torch.equal(a, e)


def test_ops_module_reexports():
    assert _ops.welford_parallel is OPS.welford_parallel.default
