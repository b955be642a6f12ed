"""The legacy module ``bnp`` (upstream's groupbn extension) against BatchNorm2d_NHWC and a float64
reference: training forward/backward with and without the fused add + ReLU, eval, in-place statistics,
the launch queries, and the CUDA-IPC functions that raise."""

from __future__ import annotations

import bnp
import pytest
import torch

from apex.contrib.groupbn import BatchNorm2d_NHWC
from apex.parallel import sync_batchnorm

from ._reference import batch_norm_nhwc, close, reference_step

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IGNORED = (None, None, None, None)  # my_data, pair_data, pair_data2, pair_data3


def data(shape, dtype, device, seed=3):
    g = torch.Generator().manual_seed(seed)
    x, z, dy = (torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device) for _ in range(3))
    c = shape[-1]
    weight = (torch.rand(c, generator=g) + 0.5).to(device)
    bias = torch.randn(c, generator=g).to(device)
    return x, z, dy, weight, bias


def state(c, device):
    """rm, riv, mini_m, mini_riv, ret_cta, as upstream's module allocates them."""
    f = dict(device=device)
    return torch.zeros(c, **f), torch.ones(c, **f), torch.empty(c, **f), torch.empty(c, **f), torch.zeros(8192, **f)


@pytest.mark.parametrize("fuse_relu", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bn_fwd_and_bwd_match_float64_and_the_module(device, dtype, fuse_relu, monkeypatch):
    # the module through the ops, as the legacy functions (off CUDA it takes torch's batch norm by default)
    monkeypatch.setattr(sync_batchnorm, "_TORCH_OFF_CUDA", False)
    shape = (3, 4, 5, 13)
    x, _, dy, weight, bias = data(shape, dtype, device)
    rm, riv, mini_m, mini_riv, ret_cta = state(13, device)
    magic = torch.IntTensor([0])
    common = (rm, riv, mini_m, mini_riv, ret_cta, 0.1, 1e-5, fuse_relu, *IGNORED, 1, magic)
    y = bnp.bn_fwd_nhwc(x, weight, bias, *common, 2, 100, False)
    dx, dweight, dbias = bnp.bn_bwd_nhwc(x, dy, weight, bias, *common, 2, 100, False)
    rm64, rv64 = torch.zeros(13, dtype=torch.float64), torch.ones(13, dtype=torch.float64)
    ref = reference_step(x.cpu(), None, dy.cpu(), weight.cpu(), bias.cpu(), rm64, rv64, relu=fuse_relu)
    for name, got in (("y", y), ("dx", dx), ("dweight", dweight), ("dbias", dbias), ("mean", mini_m)):
        close(got, ref[name], dtype, name)
    close(mini_riv, ref["invstd"], dtype, "mini_riv")
    close(rm, rm64, dtype, "rm")
    close(riv, rv64, dtype, "riv (the running variance)")
    assert y.dtype == dx.dtype == dtype and dweight.dtype == torch.float32

    m = BatchNorm2d_NHWC(13, fuse_relu=fuse_relu).to(device)
    with torch.no_grad():
        m.weight.copy_(weight)
        m.bias.copy_(bias)
    xr = x.clone().requires_grad_()
    ym = m(xr)
    ym.backward(dy)
    # The same ops in the same order: the legacy functions and the module agree exactly on the CPU
    # (on CUDA up to the reductions' order).
    same = {"rtol": 0, "atol": 0} if device == "cpu" else {}
    torch.testing.assert_close(ym, y, **same)
    torch.testing.assert_close(xr.grad, dx, **same)
    torch.testing.assert_close(m.weight.grad, dweight, **same)
    torch.testing.assert_close(m.running_var, riv, **same)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bn_addrelu_fwd_and_bwd_with_the_bitmask(device, dtype):
    shape = (2, 3, 7, 10)  # 420 elements: the mask's last word is partly used
    x, z, dy, weight, bias = data(shape, dtype, device)
    rm, riv, mini_m, mini_riv, ret_cta = state(10, device)
    bitmask = torch.full((((x.numel() + 31) // 32) * 2,), -7, dtype=torch.int32, device=device)
    magic = torch.IntTensor([0])
    common = (rm, riv, mini_m, mini_riv, bitmask, ret_cta, 0.1, 1e-5, *IGNORED, 1, magic)
    y = bnp.bn_addrelu_fwd_nhwc(x, z, weight, bias, *common, 2, 100, False)
    dx, dz, dweight, dbias = bnp.bn_addrelu_bwd_nhwc(x, dy, weight, bias, *common, 2, 100, False)
    rm64, rv64 = torch.zeros(10, dtype=torch.float64), torch.ones(10, dtype=torch.float64)
    ref = reference_step(x.cpu(), z.cpu(), dy.cpu(), weight.cpu(), bias.cpu(), rm64, rv64, relu=True)
    for name, got in (("y", y), ("dx", dx), ("dz", dz), ("dweight", dweight), ("dbias", dbias)):
        close(got, ref[name], dtype, name)
    close(rm, rm64, dtype, "rm")
    # Where the output is positive the bit is set: dz is dy there and 0 elsewhere.
    assert torch.equal(dz != 0, (y > 0) & (dy != 0))


@pytest.mark.parametrize("fuse_relu", [False, True])
def test_eval_functions(device, fuse_relu):
    x, z, _, weight, bias = data((2, 3, 3, 9), torch.float16, device)
    g = torch.Generator().manual_seed(1)
    rm, riv = torch.randn(9, generator=g).to(device), (torch.rand(9, generator=g) + 0.5).to(device)
    ret_cta = torch.zeros(8192, dtype=torch.uint8)
    y = bnp.bn_fwd_eval_nhwc(x, weight, bias, rm, riv, ret_cta, 1, 0.1, 1e-5, fuse_relu)
    ref = batch_norm_nhwc(x.cpu(), None, weight.cpu(), bias.cpu(), rm.cpu().double(), riv.cpu().double(), 0.0, 1e-5,
                          fuse_relu, False)  # fmt: skip
    close(y, ref, torch.float16, "bn_fwd_eval_nhwc")
    y = bnp.bn_addrelu_fwd_eval_nhwc(x, z, weight, bias, rm, riv, ret_cta, 1, 0.1, 1e-5)
    ref = batch_norm_nhwc(x.cpu(), z.cpu(), weight.cpu(), bias.cpu(), rm.cpu().double(), riv.cpu().double(), 0.0,
                          1e-5, True, False)  # fmt: skip
    close(y, ref, torch.float16, "bn_addrelu_fwd_eval_nhwc")
    assert y.is_contiguous() and y.shape == x.shape


def test_launch_queries():
    for query in (
        bnp.bn_fwd_nhwc_occupancy,
        bnp.bn_bwd_nhwc_occupancy,
        bnp.bn_addrelu_fwd_nhwc_occupancy,
        bnp.bn_addrelu_bwd_nhwc_occupancy,
    ):
        assert isinstance(query(), int) and query() >= 1
    assert bnp.get_buffer_size(1) == bnp.get_buffer_size(3) == 0


@pytest.mark.parametrize(
    "call",
    [
        lambda: bnp.get_data_ptr(torch.zeros(8, dtype=torch.uint8)),
        lambda: bnp.get_remote_data_ptr(torch.zeros(64, dtype=torch.uint8), 0),
        lambda: bnp.close_remote_data(torch.zeros(64, dtype=torch.uint8)),
    ],
    ids=["get_data_ptr", "get_remote_data_ptr", "close_remote_data"],
)
def test_cuda_ipc_functions_raise(call):
    with pytest.raises(NotImplementedError, match=r"torch\.distributed process group"):
        call()


def test_bad_input_raises_naming_the_argument():
    x, z, dy, weight, bias = data((2, 3, 3, 8), torch.float32, "cpu")
    rm, riv, mini_m, mini_riv, ret_cta = state(8, "cpu")
    magic = torch.IntTensor([0])
    small = torch.empty(1, dtype=torch.int32)
    args = (rm, riv, mini_m, mini_riv, small, ret_cta, 0.1, 1e-5, *IGNORED, 1, magic, 2, 100, False)
    with pytest.raises(ValueError, match=r"^bnp\.bn_addrelu_fwd_nhwc: bitmask must be .* at least 5 elements"):
        bnp.bn_addrelu_fwd_nhwc(x, z, weight, bias, *args)
    wrong = torch.empty(16, dtype=torch.int64)
    args = (rm, riv, mini_m, mini_riv, wrong, ret_cta, 0.1, 1e-5, *IGNORED, 1, magic, 2, 100, False)
    with pytest.raises(TypeError, match=r"^bnp\.bn_addrelu_bwd_nhwc: bitmask must be an int32 tensor"):
        bnp.bn_addrelu_bwd_nhwc(x, dy, weight, bias, *args)
    with pytest.raises(ValueError, match=r"^bnp.bn_fwd_eval_nhwc: x must be an \(N, H, W, C\) tensor"):
        bnp.bn_fwd_eval_nhwc(x[0], weight, bias, rm, riv, ret_cta, 1, 0.1, 1e-5, False)
    with pytest.raises(RuntimeError, match=r"^bnp\.bn_fwd_nhwc: .*init_process_group"):
        bnp.bn_fwd_nhwc(x, weight, bias, rm, riv, mini_m, mini_riv, ret_cta, 0.1, 1e-5, False, *IGNORED, 2, magic,
                        2, 100, False)  # fmt: skip
