"""The transducer joint (op, module, legacy module) against float64 sums written here, on the CPU and
(marked gpu) on CUDA: padded and packed, ReLU, dropout's reproducible mask, gradients, bad input,
opcheck and torch.compile."""

from __future__ import annotations

import math

import pytest
import torch
import transducer_joint_cuda

from apex.contrib.transducer import TransducerJoint, _ops
from apex.contrib.transducer._plugin import KERNELS
from apex.core import loader

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# (B, T, U, H): odd sizes, H not a multiple of any vector width, several t tiles of the CUDA
# backward (T > 128), an empty batch and empty H, and one 64-row tile of the CUDA backward
# (64 < T <= 128, rows past T idle) with u's over several of its shared-memory chunks (U > 8, odd).
SHAPES = [(2, 5, 3, 8), (3, 7, 4, 13), (1, 300, 3, 16), (0, 4, 3, 8), (2, 3, 4, 0), (2, 100, 19, 24)]


def random(shape, dtype, device):
    return torch.randn(shape, dtype=torch.float64).to(dtype=dtype, device=device)


def lengths(B, T, U, device, full=False):
    f_len = torch.full((B,), T, dtype=torch.int32) if full else torch.randint(0, T + 1, (B,), dtype=torch.int32)
    g_len = torch.full((B,), U, dtype=torch.int32) if full else torch.randint(0, U + 1, (B,), dtype=torch.int32)
    if B:
        f_len[0], g_len[0] = T, U  # one batch element fills the tensor
    return f_len.to(device), g_len.to(device)


def valid(f_len, g_len, T, U):
    t = torch.arange(T, device=f_len.device)[None, :, None] < f_len.long()[:, None, None]
    u = torch.arange(U, device=f_len.device)[None, None, :] < g_len.long()[:, None, None]
    return t & u


def expected_sum(f, g):
    return f.double()[:, :, None, :] + g.double()[:, None, :, :]


def eps(dtype):
    return torch.finfo(dtype).eps


def assert_rounded(actual, expected):
    """``actual`` is ``expected`` rounded once to its dtype (within one unit in the last place)."""
    torch.testing.assert_close(actual.double().cpu(), expected.cpu(), rtol=eps(actual.dtype), atol=1e-30)


def assert_sum_close(actual, expected, abs_sum):
    """A float32-accumulated sum rounded to actual's dtype: the rounding (half a subnormal's spacing
    at the least: a sum of 1.49e-7 rounds to float16's 1.19e-7), plus accumulation error."""
    err = (actual.double() - expected).abs()
    info = torch.finfo(actual.dtype)
    bound = 2 * info.eps * expected.abs() + 32 * eps(torch.float32) * abs_sum + 0.5 * info.tiny * info.eps
    assert bool((err <= bound).all()), f"max error {err.max().item()} beyond the bound"


def packed_offsets(f_len, g_len):
    offsets = torch.cumsum(f_len.long() * g_len.long(), 0)
    return offsets, int(offsets[-1]) if offsets.numel() else 0


# forward ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_padded_forward(device, dtype, shape):
    B, T, U, H = shape
    f, g = random((B, T, H), dtype, device), random((B, U, H), dtype, device)
    f_len, g_len = lengths(B, T, U, device)
    out, mask = _ops.joint_forward(f, g, f_len, g_len)
    assert out.shape == (B, T, U, H) and out.dtype == dtype and mask.numel() == 0
    expected = expected_sum(f, g).masked_fill(~valid(f_len, g_len, T, U)[..., None], -1.0)
    assert_rounded(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_packed_forward(device, dtype, shape):
    B, T, U, H = shape
    f, g = random((B, T, H), dtype, device), random((B, U, H), dtype, device)
    f_len, g_len = lengths(B, T, U, device)
    offsets, rows = packed_offsets(f_len, g_len)
    out, _ = _ops.joint_forward(f, g, f_len, g_len, offsets, rows)
    assert out.shape == (rows, H)
    expected = expected_sum(f, g)[valid(f_len, g_len, T, U)]
    assert_rounded(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu(device, dtype):
    B, T, U, H = 3, 6, 5, 24
    f, g = random((B, T, H), dtype, device), random((B, U, H), dtype, device)
    f_len, g_len = lengths(B, T, U, device)
    out, mask = _ops.joint_forward(f, g, f_len, g_len, relu=True)
    rows = valid(f_len, g_len, T, U)[..., None]
    h = expected_sum(f, g)
    assert_rounded(out, torch.where(rows, h.clamp(min=0), -1.0))
    assert mask.dtype == torch.uint8
    assert torch.equal(mask.bool().cpu(), ((h > 0) & rows).cpu())


def dropout_case(device, dtype=torch.float32, relu=False, p=0.25, seed=1234, packed=False, shape=(2, 40, 9, 32)):
    B, T, U, H = shape
    f, g = random((B, T, H), dtype, device), random((B, U, H), dtype, device)
    f_len, g_len = lengths(B, T, U, device)
    offsets, rows = packed_offsets(f_len, g_len) if packed else (None, 0)
    seed_t = torch.tensor([seed], dtype=torch.int64, device=device)
    out, mask = _ops.joint_forward(f, g, f_len, g_len, offsets, rows, relu, p, seed_t)
    return f, g, f_len, g_len, offsets, out, mask


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [False, True])
def test_dropout_values(device, dtype, relu, packed):
    p = 0.3
    f, g, f_len, g_len, _, out, mask = dropout_case(device, dtype, relu, p, packed=packed)
    T = f.shape[1]
    U = g.shape[1]
    rows = valid(f_len, g_len, T, U)
    h = expected_sum(f, g)
    if packed:
        h = h[rows]
    kept = mask.bool()
    if relu:
        assert not bool((kept & (h <= 0)).any()), "ReLU zeros are never kept"
    compute = torch.float64 if dtype == torch.float64 else torch.float32  # the kernels' arithmetic
    expected = torch.where(kept, (h.to(compute) * torch.tensor(1 / (1 - p), dtype=compute)).double(), 0.0)
    if not packed:
        expected = expected.masked_fill(~rows[..., None], -1.0)
        assert not bool(mask.bool()[~rows].any()), "no mask outside the valid rows"
    assert_rounded(out, expected)


def test_dropout_mask_is_reproducible_and_depends_on_the_seed(device):
    f, g, f_len, g_len, _, out, mask = dropout_case(device, seed=7)

    def again(seed):
        seed_t = torch.tensor([seed], dtype=torch.int64, device=device)
        return _ops.joint_forward(f, g, f_len, g_len, None, 0, False, 0.25, seed_t)

    torch.manual_seed(123)  # the generator plays no part: the seed alone decides
    out2, mask2 = again(7)
    _, mask3 = again(8)
    assert torch.equal(mask, mask2) and torch.equal(out, out2)
    assert not torch.equal(mask, mask3)


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_dropout_rate(device, p):
    _, _, f_len, g_len, _, _, mask = dropout_case(device, p=p, shape=(4, 64, 16, 64))
    rows = valid(f_len, g_len, 64, 16)
    n = int(rows.sum()) * 64
    dropped = n - int(mask.bool().sum())
    # within six standard deviations of the binomial
    assert abs(dropped - p * n) <= 6 * math.sqrt(n * p * (1 - p)) + 1, (dropped, p * n)


def test_dropout_mask_in_neighbouring_elements_is_independent(device):
    *_, mask = dropout_case(device, p=0.5, shape=(1, 64, 64, 64))
    bits = mask.flatten().double()
    # the correlation of element e with e + 1 and with e + H is that of independent coin flips
    for lag in (1, 64):
        c = torch.corrcoef(torch.stack([bits[:-lag], bits[lag:]]))[0, 1]
        assert abs(float(c)) < 0.02, (lag, float(c))


@pytest.mark.gpu
def test_dropout_mask_is_the_same_on_cpu_and_cuda():
    for packed in (False, True):
        torch.manual_seed(42)  # the same data and lengths, made on the CPU, for both
        cpu = dropout_case("cpu", relu=True, packed=packed, seed=-99)
        torch.manual_seed(42)
        cuda = dropout_case("cuda", relu=True, packed=packed, seed=-99)
        torch.testing.assert_close(cuda[5].cpu(), cpu[5])
        assert torch.equal(cuda[6].cpu(), cpu[6])


# backward --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_backward(device, dtype, shape, packed, masked):
    B, T, U, H = shape
    f_len, g_len = lengths(B, T, U, device)
    rows = valid(f_len, g_len, T, U)
    offsets, n = packed_offsets(f_len, g_len) if packed else (None, 0)
    grad_shape = (n, H) if packed else (B, T, U, H)
    grad = random(grad_shape, dtype, device)
    mask = torch.randint(0, 2, grad_shape, dtype=torch.uint8, device=device) if masked else None
    scale = 1.25
    f_grad, g_grad = _ops.joint_backward(grad, mask, f_len, g_len, offsets, T, U, scale)
    assert f_grad.shape == (B, T, H) and g_grad.shape == (B, U, H) and f_grad.dtype == dtype
    d = grad.double() * (mask.double() if masked else 1.0) * scale
    full = torch.zeros(B, T, U, H, dtype=torch.float64, device=device)
    full[rows] = d if packed else d[rows]
    assert_sum_close(f_grad, full.sum(2), full.abs().sum(2))
    assert_sum_close(g_grad, full.sum(1), full.abs().sum(1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pack_output", [False, True])
def test_module_gradient_is_autograds(device, dtype, pack_output):
    B, T, U, H = 3, 9, 5, 16
    f = random((B, T, H), dtype, device).requires_grad_()
    g = random((B, U, H), dtype, device).requires_grad_()
    f_len, g_len = lengths(B, T, U, device)
    offsets, n = packed_offsets(f_len, g_len)
    joint = TransducerJoint(pack_output=pack_output, relu=True)
    out = joint(f, g, f_len.long(), g_len, offsets, n)  # int64 lengths are accepted
    dy = random(out.shape, dtype, device)
    f_grad, g_grad = torch.autograd.grad(out, (f, g), dy)

    f64 = f.detach().double().requires_grad_()
    g64 = g.detach().double().requires_grad_()
    h = torch.relu(f64[:, :, None] + g64[:, None])
    rows = valid(f_len, g_len, T, U)
    h = h[rows] if pack_output else h * rows[..., None]
    expected = torch.autograd.grad(h, (f64, g64), dy.double())
    # h == 0 exactly is where float32 and float64 may disagree on ReLU's gradient; random data avoids it
    for got, want in zip((f_grad, g_grad), expected):
        torch.testing.assert_close(got.double(), want, rtol=4 * eps(dtype), atol=4 * eps(dtype) * U * T)


def test_module_dropout_gradient_uses_the_mask(device):
    B, T, U, H = 2, 6, 4, 8
    f = random((B, T, H), torch.float32, device).requires_grad_()
    g = random((B, U, H), torch.float32, device).requires_grad_()
    f_len, g_len = lengths(B, T, U, device, full=True)
    joint = TransducerJoint(dropout=True, dropout_prob=0.4, probe_mask=True)
    torch.manual_seed(5)
    out = joint(f, g, f_len, g_len)
    mask = joint.mask_probe[-1]
    (f_grad,) = torch.autograd.grad(out.sum(), f)
    expected = (mask.double() / 0.6).sum(2)
    torch.testing.assert_close(f_grad.double(), expected, rtol=1e-6, atol=1e-6)
    torch.manual_seed(5)
    assert torch.equal(joint(f, g, f_len, g_len), out), "the same generator state gives the same mask"
    joint.eval()
    out_eval = joint(f, g, f_len, g_len)
    assert_rounded(out_eval, expected_sum(f.detach(), g.detach()))


# bad input -------------------------------------------------------------------------------------


def bad_joint_cases(device):
    f = torch.randn(2, 4, 8, device=device)
    g = torch.randn(2, 3, 8, device=device)
    fl = torch.tensor([4, 2], dtype=torch.int32, device=device)
    gl = torch.tensor([3, 1], dtype=torch.int32, device=device)
    seed = torch.tensor([1], device=device)
    grad = torch.randn(2, 4, 3, 8, device=device)
    fwd, bwd = _ops.joint_forward, _ops.joint_backward
    return {
        "f dtype": (fwd, (f.int(), g, fl, gl), TypeError, "joint_forward: f has dtype torch.int32"),
        "f dims": (fwd, (f[0], g, fl, gl), ValueError, r"joint_forward: f must be 3-D \[B, T, H\]"),
        "f non-contiguous": (fwd, (f.transpose(1, 2), g, fl, gl), ValueError, "f is not contiguous"),
        "g dtype": (fwd, (f, g.half(), fl, gl), TypeError, "g has dtype torch.float16 but f has torch.float32"),
        "g hidden": (fwd, (f, g[..., :4].contiguous(), fl, gl), ValueError, r"g has shape \(2, 3, 4\)"),
        "g device": (fwd, (f, g.to("meta"), fl, gl), ValueError, "g is on meta"),
        "f_len dtype": (fwd, (f, g, fl.long(), gl), TypeError, "f_len has dtype torch.int64; expected torch.int32"),
        "g_len shape": (fwd, (f, g, fl, gl[:1]), ValueError, r"g_len has shape \(1,\); expected \(2,\)"),
        "batch_offset dtype": (fwd, (f, g, fl, gl, fl, 10), TypeError, "batch_offset has dtype torch.int32"),
        "packed_batch": (fwd, (f, g, fl, gl, None, -1), ValueError, "packed_batch must be >= 0, got -1"),
        "dropout_prob": (fwd, (f, g, fl, gl, None, 0, False, 1.5, seed), ValueError, "dropout_prob must lie in"),
        "seed dtype": (fwd, (f, g, fl, gl, None, 0, False, 0.1, seed.int()), TypeError, "seed has dtype torch.int32"),
        "grad dims": (bwd, (grad[0], None, fl, gl, None, 4, 3), ValueError, r"joint_backward: grad must be 4-D"),
        "grad shape": (bwd, (grad, None, fl, gl, None, 5, 3), ValueError, "expected \\[2, max_f_len=5"),
        "mask dtype": (bwd, (grad, grad.bool(), fl, gl, None, 4, 3), TypeError, "mask has dtype torch.bool"),
        "mask shape": (bwd, (grad, grad[:1].byte(), fl, gl, None, 4, 3), ValueError, r"mask has shape \(1, 4, 3, 8\)"),
        "packed grad": (bwd, (grad, None, fl, gl, fl.long(), 4, 3), ValueError, r"grad must be 2-D \[rows, H\]"),
        "scale": (bwd, (grad, None, fl, gl, None, 4, 3, math.inf), ValueError, "scale must be finite"),
    }


@pytest.mark.parametrize("case", list(bad_joint_cases("cpu")))
def test_bad_input_raises_naming_the_argument(device, case):
    fn, args, error, message = bad_joint_cases(device)[case]
    with pytest.raises(error, match=message):
        fn(*args)


def test_bad_values_raise_in_the_reference():
    f, g = torch.randn(2, 4, 8), torch.randn(2, 3, 8)
    gl = torch.tensor([3, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"f_len must lie in \[0, 4\]"):
        _ops.joint_forward(f, g, torch.tensor([5, 1], dtype=torch.int32), gl)
    fl = torch.tensor([4, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="batch_offset must be the running sum"):
        _ops.joint_forward(f, g, fl, gl, torch.tensor([12, 13]), 13)
    with pytest.raises(ValueError, match="packed_batch is 15 but the batch has 14 valid rows"):
        _ops.joint_forward(f, g, fl, gl, torch.tensor([12, 14]), 15)


def test_module_argument_checks():
    with pytest.raises(NotImplementedError, match="only supported with opt=1"):
        TransducerJoint(relu=True, opt=0)
    with pytest.raises(ValueError, match="fwd_tile_size must be 1, 2 or 4"):
        TransducerJoint(fwd_tile_size=3)
    f, g = torch.randn(1, 2, 4), torch.randn(1, 2, 4)
    lens = torch.tensor([2], dtype=torch.int32)
    with pytest.raises(ValueError, match="pack_output needs batch_offset and packed_batch"):
        TransducerJoint(pack_output=True)(f, g, lens, lens)


# opcheck, torch.compile --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["padded", "packed", "relu", "dropout"])
def test_opcheck_forward(device, variant):
    B, T, U, H = 2, 5, 3, 16
    f, g = random((B, T, H), torch.float16, device), random((B, U, H), torch.float16, device)
    f_len, g_len = lengths(B, T, U, device)
    offsets, n = packed_offsets(f_len, g_len)
    seed = torch.tensor([3], device=device)
    args = {
        "padded": (f, g, f_len, g_len),
        "packed": (f, g, f_len, g_len, offsets, n),
        "relu": (f, g, f_len, g_len, None, 0, True),
        "dropout": (f, g, f_len, g_len, offsets, n, True, 0.2, seed),
    }[variant]
    torch.library.opcheck(_ops.joint_forward, args)


@pytest.mark.parametrize("packed", [False, True])
def test_opcheck_backward(device, packed):
    B, T, U, H = 2, 5, 3, 16
    f_len, g_len = lengths(B, T, U, device)
    offsets, n = packed_offsets(f_len, g_len)
    shape = (n, H) if packed else (B, T, U, H)
    grad = random(shape, torch.bfloat16, device)
    mask = torch.randint(0, 2, shape, dtype=torch.uint8, device=device)
    torch.library.opcheck(_ops.joint_backward, (grad, mask, f_len, g_len, offsets if packed else None, T, U, 2.0))


@pytest.mark.slow
@pytest.mark.parametrize("pack_output", [False, True])
def test_torch_compile_fullgraph(device, pack_output):
    torch._dynamo.reset()
    B, T, U, H = 2, 6, 4, 16
    f = random((B, T, H), torch.float32, device).requires_grad_()
    g = random((B, U, H), torch.float32, device).requires_grad_()
    f_len, g_len = lengths(B, T, U, device)
    offsets, n = packed_offsets(f_len, g_len)
    joint = TransducerJoint(pack_output=pack_output, relu=True)

    def loss(f, g):
        return (joint(f * 2, g, f_len, g_len, offsets, n) ** 2).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    results = []
    for fn in (loss, compiled):
        value = fn(f, g)
        results.append((value.detach(), *torch.autograd.grad(value, (f, g))))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_torch_compile_fullgraph_with_dropout(device):
    torch._dynamo.reset()
    f = random((2, 6, 16), torch.float32, device)
    g = random((2, 4, 16), torch.float32, device)
    f_len, g_len = lengths(2, 6, 4, device, full=True)
    joint = TransducerJoint(dropout=True, dropout_prob=0.5, probe_mask=True)
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(lambda f, g: joint(f, g, f_len, g_len), fullgraph=True, backend=backend)
    out = compiled(f, g)
    mask = joint.mask_probe[-1]
    torch.testing.assert_close(out, (f[:, :, None] + g[:, None]) * mask * 2.0)


# the legacy module -------------------------------------------------------------------------------


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("pack_output", [False, True])
def test_legacy_module_matches_the_ops(device, masked, pack_output):
    B, T, U, H = 3, 5, 4, 8
    f, g = random((B, T, H), torch.float16, device), random((B, U, H), torch.float16, device)
    f_len, g_len = lengths(B, T, U, device)
    offsets, n = packed_offsets(f_len, g_len)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    outs = transducer_joint_cuda.forward(
        f, g, f_len, g_len, offsets if pack_output else empty, n, 1, pack_output, masked, False, 0.0, 4
    )
    expected, mask = _ops.joint_forward(f, g, f_len, g_len, offsets if pack_output else None, n, masked)
    assert len(outs) == (2 if masked else 1)
    assert torch.equal(outs[0], expected)
    grad = random(outs[0].shape, torch.float16, device)
    inputs = [grad, outs[1]] if masked else [grad]
    f_grad, g_grad = transducer_joint_cuda.backward(inputs, f_len, g_len, offsets, T, U, pack_output, 1.0)
    want = _ops.joint_backward(grad, mask if masked else None, f_len, g_len, offsets if pack_output else None, T, U)
    assert torch.equal(f_grad, want[0]) and torch.equal(g_grad, want[1])


def test_legacy_dropout_returns_the_mask_and_the_backward_scales(device):
    f, g = random((1, 4, 8), torch.float32, device), random((1, 3, 8), torch.float32, device)
    lens = (torch.tensor([4], dtype=torch.int32, device=device), torch.tensor([3], dtype=torch.int32, device=device))
    h, mask = transducer_joint_cuda.forward(f, g, *lens, torch.empty(0), 0, 1, False, False, True, 0.5, 4)
    torch.testing.assert_close(h, (f[:, :, None] + g[:, None]) * mask * 2.0)
    grad = torch.ones_like(h)
    f_grad, _ = transducer_joint_cuda.backward([grad, mask], *lens, torch.empty(0), 4, 3, False, 2.0)
    torch.testing.assert_close(f_grad, (mask.float() * 2.0).sum(2))


# CUDA specifics ----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_kernels_are_loaded():
    status = loader.load(KERNELS)
    assert status.has_kernels, f"{KERNELS.name}: tier {status.tier} ({status.reason})"


@pytest.mark.gpu
def test_cuda_matches_the_cpu_reference_on_unaligned_inputs():
    # f one element into its storage: the kernels take their scalar path
    B, T, U, H = 2, 7, 5, 24
    storage = torch.randn(B * T * H + 1, dtype=torch.float16)
    f = storage[1:].view(B, T, H)
    g = torch.randn(B, U, H, dtype=torch.float16)
    f_len, g_len = lengths(B, T, U, "cpu")
    for relu in (False, True):
        out, mask = _ops.joint_forward(f.cuda(), g.cuda(), f_len.cuda(), g_len.cuda(), relu=relu)
        ref_out, ref_mask = _ops.joint_forward(f, g, f_len, g_len, relu=relu)
        assert torch.equal(out.cpu(), ref_out) and torch.equal(mask.cpu(), ref_mask)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("one_tile", [False, True])
def test_backward_at_a_device_filling_grid(packed, masked, one_tile):
    # T in (128, 256] with a grid of more blocks than SMs, with lengths that cut t and u inside the
    # tiles: a batch element and H chunk a block fill every SM (one 256-t tile of 1024 threads, the
    # benchmark's plan), or not quite (two 128-t tiles and their partial sums)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    B, T, U, H = sms // 8 + (1 if one_tile else -1), 200, 6, 512  # fp16: 8 chunks of H a batch element
    f_len, g_len = lengths(B, T, U, "cuda")
    rows = valid(f_len, g_len, T, U)
    offsets, n = packed_offsets(f_len, g_len) if packed else (None, 0)
    grad_shape = (n, H) if packed else (B, T, U, H)
    grad = random(grad_shape, torch.float16, "cuda")
    mask = torch.randint(0, 2, grad_shape, dtype=torch.uint8, device="cuda") if masked else None
    f_grad, g_grad = _ops.joint_backward(grad, mask, f_len, g_len, offsets, T, U, 1.25)
    d = grad.double() * (mask.double() if masked else 1.0) * 1.25
    full = torch.zeros(B, T, U, H, dtype=torch.float64, device="cuda")
    full[rows] = d if packed else d[rows]
    assert_sum_close(f_grad, full.sum(2), full.abs().sum(2))
    assert_sum_close(g_grad, full.sum(1), full.abs().sum(1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_padded_forward_larger_than_the_l2_cache(dtype):
    # the flat forward's streaming stores (an output larger than L2), many resident blocks striding
    # over it, with lengths that leave padding in most batch elements
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    T, U, H = 128, 64, 512
    B = 2 * l2 // (T * U * H * dtype.itemsize) + 1
    f, g = random((B, T, H), dtype, "cuda"), random((B, U, H), dtype, "cuda")
    f_len, g_len = lengths(B, T, U, "cuda")
    out, _ = _ops.joint_forward(f, g, f_len, g_len)
    expected = expected_sum(f, g).masked_fill(~valid(f_len, g_len, T, U)[..., None], -1.0)
    assert_rounded(out, expected)


@pytest.mark.gpu
def test_runs_on_the_current_stream():
    B, T, U, H = 4, 256, 64, 256
    f_src = torch.randn(B, T, H, device="cuda", dtype=torch.float16)
    g = torch.randn(B, U, H, device="cuda", dtype=torch.float16)
    f_len, g_len = lengths(B, T, U, "cuda", full=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        f = f_src * 1.0
        out, _ = _ops.joint_forward(f, g, f_len, g_len)
    torch.cuda.current_stream().wait_stream(side)
    assert_rounded(out, expected_sum(f_src, g))


@pytest.mark.multigpu
def test_second_gpu():
    B, T, U, H = 2, 9, 5, 32
    f, g = random((B, T, H), torch.bfloat16, "cuda:1"), random((B, U, H), torch.bfloat16, "cuda:1")
    f_len, g_len = lengths(B, T, U, "cuda:1")
    out, _ = _ops.joint_forward(f, g, f_len, g_len, relu=True)
    assert out.device == f.device
    ref, _ = _ops.joint_forward(f.cpu(), g.cpu(), f_len.cpu(), g_len.cpu(), relu=True)
    assert torch.equal(out.cpu(), ref)
    f_grad, g_grad = _ops.joint_backward(out, None, f_len, g_len, None, T, U)
    ref_grads = _ops.joint_backward(ref, None, f_len.cpu(), g_len.cpu(), None, T, U)
    torch.testing.assert_close(f_grad.cpu(), ref_grads[0])
    torch.testing.assert_close(g_grad.cpu(), ref_grads[1])
