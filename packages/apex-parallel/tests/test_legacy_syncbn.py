"""The top-level ``syncbn`` module (upstream Apex's extension module name): upstream's functions,
argument orders, return values and dtypes, on apex_parallel's ops. Each test drives the functions
the way upstream's SyncBatchnormFunction does, over a batch split between two "ranks" in one
process, and compares with torch batch norm in float64 over the whole batch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

FUNCTIONS = (
    "welford_mean_var",
    "welford_parallel",
    "batchnorm_forward",
    "reduce_bn",
    "batchnorm_backward",
    "welford_mean_var_c_last",
    "batchnorm_forward_c_last",
    "reduce_bn_c_last",
    "batchnorm_backward_c_last",
    "relu_bw_c_last",
)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float64: 1e-10}
EPS = 1e-5
BATCHES = (3, 2)  # the two ranks' batch sizes


def close(actual, expected, dtype, what):
    tol = TOL[dtype]
    expected = expected.double().cpu()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual.double().cpu(), expected, rtol=tol, atol=tol * (scale + 1.0), msg=lambda m: f"{what}: {m}"
    )


def test_import_in_a_fresh_interpreter():
    code = (
        "import sys, syncbn\n"
        f"missing = [n for n in {FUNCTIONS!r} if not callable(getattr(syncbn, n, None))]\n"
        "assert not missing, missing\n"
        "assert 'apex.parallel' in sys.modules\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_plugin_lists_it():
    from apex.parallel._plugin import PLUGIN

    assert PLUGIN.provides[0] == "apex.parallel" and "syncbn" in PLUGIN.provides


def whole_batch(device, dtype, channel_last, weight_dtype):
    """Input, gradient and residual of the whole batch as (N, C, H, W), float64 on ``device``."""
    g = torch.Generator().manual_seed(7)
    shape = (sum(BATCHES), 5, 3, 4)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 1.5 + 0.4
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    z = torch.randn(shape, generator=g, dtype=torch.float64)
    weight = torch.rand(5, generator=g, dtype=torch.float64) + 0.5
    bias = torch.randn(5, generator=g, dtype=torch.float64)
    # the data rounded to the dtype, so the float64 reference sees what the functions see
    x, dy, z = (t.to(dtype).double().to(device) for t in (x, dy, z))
    weight, bias = (t.to(weight_dtype).double().to(device) for t in (weight, bias))
    return x, dy, z, weight, bias


def to_layout(t, channel_last):
    return t.permute(0, 2, 3, 1).contiguous() if channel_last else t


def from_layout(t, channel_last):
    return t.permute(0, 3, 1, 2) if channel_last else t


def torch_reference(x, dy, z, weight, bias, relu):
    """Output, input/residual gradients, weight gradients and statistics of torch batch norm (float64)."""
    x = x.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    b = bias.clone().requires_grad_()
    zz = z.clone().requires_grad_()
    y = F.batch_norm(x, None, None, w, b, True, 0.0, EPS) + (zz if relu else 0)
    out = torch.relu(y) if relu else y
    out.backward(dy)
    var, mean = torch.var_mean(x.detach(), dim=(0, 2, 3), unbiased=False)
    return dict(
        out=out.detach(), grad_input=x.grad, grad_z=zz.grad, grad_weight=w.grad, grad_bias=b.grad, mean=mean, var=var
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channel_last", [False, True], ids=["nchw", "c_last"])
@pytest.mark.parametrize("weight_kind", ["float32", "input"])
def test_functions_as_upstream_drives_them(device, dtype, channel_last, weight_kind):
    import syncbn

    weight_dtype = torch.float32 if weight_kind == "float32" else dtype
    x64, dy64, z64, w64, b64 = whole_batch(device, dtype, channel_last, weight_dtype)
    relu = channel_last  # upstream fuses the residual and ReLU only in the channels-last kernels
    expected = torch_reference(x64, dy64, z64, w64, b64, relu)
    stat_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    weight, bias = w64.to(weight_dtype), b64.to(weight_dtype)
    rows = torch.split(torch.arange(sum(BATCHES), device=device), BATCHES)
    ranks = [
        {k: to_layout(t[r].to(dtype), channel_last) for k, t in (("x", x64), ("dy", dy64), ("z", z64))} for r in rows
    ]

    # forward: per-rank Welford, the merge over the "all-gathered" statistics, the normalization
    welford = syncbn.welford_mean_var_c_last if channel_last else syncbn.welford_mean_var
    stats = [welford(rank["x"]) for rank in ranks]
    assert all(isinstance(s, list) and len(s) == 2 for s in stats)
    assert all(t.dtype == stat_dtype and t.shape == (5,) for s in stats for t in s)
    mean_all = torch.stack([s[0] for s in stats])
    var_all = torch.stack([s[1] for s in stats])
    count_all = torch.tensor(BATCHES, device=device, dtype=torch.int32) * 12  # elements per channel, as upstream
    merged = syncbn.welford_parallel(mean_all, var_all, count_all, EPS)
    assert isinstance(merged, list) and len(merged) == 3
    mean, var, inv_std = merged
    assert mean.dtype == var.dtype == inv_std.dtype == stat_dtype
    n = count_all.sum().item()
    close(mean, expected["mean"], torch.float32 if dtype != torch.float64 else dtype, "mean")
    close(var, expected["var"] * n / (n - 1), torch.float32 if dtype != torch.float64 else dtype, "var (unbiased)")
    close(inv_std, torch.rsqrt(expected["var"] + EPS), torch.float32 if dtype != torch.float64 else dtype, "inv_std")
    for r, rank in enumerate(ranks):
        if channel_last:
            out = syncbn.batchnorm_forward_c_last(rank["x"], rank["z"], mean, inv_std, weight, bias, relu)
        else:
            out = syncbn.batchnorm_forward(rank["x"], mean, inv_std, weight, bias)
        assert out.dtype == dtype and out.shape == rank["x"].shape
        close(from_layout(out, channel_last), expected["out"][rows[r]], dtype, f"rank {r} out")
        rank["out"] = out

    # backward: the ReLU mask, per-rank sums, their "all-reduce", the input gradient
    sums = []
    for rank in ranks:
        dy = rank["dy"]
        if relu:
            dy = syncbn.relu_bw_c_last(dy, rank["x"], rank["z"], mean, inv_std, weight, bias)
            assert dy.dtype == dtype
            # the residual's gradient is the masked one; the mask is the forward's own output > 0
            torch.testing.assert_close(dy, torch.where(rank["out"] > 0, rank["dy"], torch.zeros_like(dy)))
            rank["grad_z"] = dy
        rank["dy_masked"] = dy
        reduce = syncbn.reduce_bn_c_last if channel_last else syncbn.reduce_bn
        out = reduce(dy, rank["x"], mean, inv_std, weight)
        assert isinstance(out, list) and len(out) == 4
        assert [t.dtype for t in out] == [stat_dtype, stat_dtype, weight_dtype, weight_dtype]
        sums.append(out)
    sum_dy = sum(s[0] for s in sums)
    sum_dy_xmu = sum(s[1] for s in sums)
    # the sums run in the statistics' dtype over products of the rounded inputs, then round to the weight's
    sums_dtype = torch.float16 if dtype in (torch.float16, torch.bfloat16) else dtype
    wtol = max((sums_dtype, weight_dtype), key=TOL.get)
    close(sum(s[2].double() for s in sums), expected["grad_weight"], wtol, "grad_weight")
    close(sum(s[3].double() for s in sums), expected["grad_bias"], wtol, "grad_bias")
    backward = syncbn.batchnorm_backward_c_last if channel_last else syncbn.batchnorm_backward
    for r, rank in enumerate(ranks):
        grad_input = backward(rank["dy_masked"], rank["x"], mean, inv_std, weight, sum_dy, sum_dy_xmu, count_all)
        assert grad_input.dtype == dtype
        close(from_layout(grad_input, channel_last), expected["grad_input"][rows[r]], dtype, f"rank {r} grad_input")
        if relu:
            close(from_layout(rank["grad_z"], channel_last), expected["grad_z"][rows[r]], dtype, f"rank {r} grad_z")


def test_without_weight_and_with_upstreams_older_int_count(device):
    """No weight/shift: empty weight gradients (in the statistics' dtype), as upstream; and the older
    ``welford_parallel(mean, var, numel: int, eps)`` with one element count for every rank."""
    import syncbn

    x = torch.randn(4, 3, 5, device=device)
    mean, var = syncbn.welford_mean_var(x)
    merged_mean, merged_var, inv_std = syncbn.welford_parallel(mean[None].repeat(2, 1), var[None].repeat(2, 1), 20, EPS)
    close(merged_mean, mean, torch.float32, "mean")
    close(merged_var, var * 40 / 39, torch.float32, "var")
    out = syncbn.batchnorm_forward(x, mean, inv_std, None, None)
    close(out, F.batch_norm(x.double(), None, None, None, None, True, 0.0, EPS), torch.float32, "out")
    sum_dy, sum_dy_xmu, grad_weight, grad_bias = syncbn.reduce_bn(x, x, mean, inv_std, None)
    assert grad_weight.shape == grad_bias.shape == (0,) and grad_weight.dtype == torch.float32
    count = torch.tensor([20], dtype=torch.int32, device=device)
    grad = syncbn.batchnorm_backward(x, x, mean, inv_std, None, sum_dy, sum_dy_xmu, count)
    xx = x.double().requires_grad_()
    F.batch_norm(xx, None, None, None, None, True, 0.0, EPS).backward(x.double())
    close(grad, xx.grad, torch.float32, "grad_input")


def test_errors_name_the_argument():
    import syncbn

    x = torch.randn(4, 3, 5)
    mean, var = syncbn.welford_mean_var(x)
    with pytest.raises(TypeError, match=r"welford_parallel: numel has dtype torch.float16"):
        syncbn.welford_parallel(mean[None], var[None], torch.ones(1, dtype=torch.float16), EPS)
    with pytest.raises(ValueError, match=r"welford_parallel: numel has 2 elements, expected one per rank \(1\)"):
        syncbn.welford_parallel(mean[None], var[None], torch.ones(2, dtype=torch.int32), EPS)
    with pytest.raises(TypeError, match=r"batchnorm_backward: count has dtype torch.bool"):
        syncbn.batchnorm_backward(x, x, mean, var, None, mean, mean, torch.ones(1, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"welford_mean_var: input has dtype torch\.int64"):
        syncbn.welford_mean_var(x.long())
