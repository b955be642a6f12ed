"""Fused scale-mask softmax against a float64 computation written out here, on random data.

Every test runs on the CPU (the PyTorch reference) and on CUDA (the kernels; marked gpu) through
the ``device`` fixture. Row lengths cover the warp path (1, 17, 128, 1000), the block path (2048 to
20000) and, on CUDA, the streaming path (rows longer than the registers hold, and long unaligned
ones); batches and heads are not multiples of 4 and sq is odd.
"""

from __future__ import annotations

import pytest
import torch

from apex.core.testing import graph_reaches
from apex.transformer import _softmax_ops
from apex.transformer.functional import fused_softmax as F

SK_ALL = [1, 17, 128, 1000, 2048, 4096, 8192, 16384, 20000]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# Relative tolerance of one output (rounding to the dtype, plus fp32 math with exp2).
RTOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}
ATOL = {torch.float16: 1e-5, torch.bfloat16: 1e-5, torch.float32: 1e-7}


@pytest.fixture(autouse=True)
def _op_off_cuda(monkeypatch):
    """Off CUDA the functions take torch's softmax by default; these tests run the op's reference there
    (test_softmax_numerics.test_off_cuda_the_functions_are_torchs checks the default)."""
    monkeypatch.setattr(F, "_TORCH_OFF_CUDA", False)


def oracle_forward(x, mask, scale, causal):
    """softmax(scale * x, masked) in float64: causal j > i excluded, padding-masked scores -10000,
    rows with every element masked 0."""
    s = x.double() * scale
    sq, sk = s.shape[-2:]
    if causal:
        i = torch.arange(sq, device=x.device).unsqueeze(-1)
        j = torch.arange(sk, device=x.device)
        s = torch.where(j <= i, s, torch.full_like(s, float("-inf")))
    if mask is not None:
        m = mask.bool()
        s = torch.where(m, torch.full_like(s, -10000.0), s)
    e = (s - s.amax(-1, keepdim=True)).exp()
    y = e / e.sum(-1, keepdim=True)
    if mask is not None:
        y = torch.where(m.all(-1, keepdim=True), torch.zeros_like(y), y)
    return y


def oracle_backward(dy, y, scale):
    y, dy = y.double(), dy.double()
    return scale * y * (dy - (y * dy).sum(-1, keepdim=True))


def assert_close(actual, expected, dtype, what=""):
    scale = max(expected.abs().max().item(), 1e-30)
    torch.testing.assert_close(
        actual.double(), expected, rtol=RTOL[dtype], atol=max(ATOL[dtype], RTOL[dtype] * 1e-3 * scale), msg=what
    )


def grad_close(actual, expected, dtype):
    # dx = scale * y * (dy - dot) cancels: the error is relative to the row's largest term.
    scale = max(expected.abs().max().item(), 1e-30)
    torch.testing.assert_close(actual.double(), expected, rtol=RTOL[dtype], atol=RTOL[dtype] * scale)


def shape_for(sk, device):
    """[b, np, sq, sk] with b, np not multiples of 4 and odd sq; fewer rows for long rows."""
    if sk >= 4096:
        return (3, 1, 3, sk) if device == "cpu" else (3, 5, 7, sk)
    return (3, 5, 7, sk)


def random_mask(b, sq, sk, device, batched=True):
    mask = torch.rand(b if batched else 1, 1, sq, sk, device=device) < 0.3
    mask[0, 0, min(1, sq - 1)] = True  # one row fully masked
    if sq > 2:
        mask[-1, 0, 2] = False  # one row unmasked
    return mask


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sk", SK_ALL)
def test_forward_unmasked_and_padding(device, dtype, sk):
    b, np_, sq, sk = shape_for(sk, device)
    x = torch.randn(b, np_, sq, sk, device=device).mul_(4).to(dtype)
    y = _softmax_ops.scaled_softmax_forward(x, None, 0.7, False)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert_close(y, oracle_forward(x, None, 0.7, False), dtype, "unmasked")
    for batched in (True, False):
        mask = random_mask(b, sq, sk, device, batched)
        for m in (mask, mask.to(torch.uint8)):
            y = _softmax_ops.scaled_softmax_forward(x, m, 0.7, False)
            assert_close(y, oracle_forward(x, m, 0.7, False), dtype, f"padding batched={batched} {m.dtype}")
        assert torch.all(y[0, :, min(1, sq - 1)] == 0), "a fully masked row gives 0"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sk", [17, 1000, 2048, 20000])
@pytest.mark.parametrize("scale", [-0.7, 0.0, 1.0])
def test_padding_mask_values_signs_and_dominant_masked_scores(device, dtype, sk, scale):
    """Mask bytes of any nonzero value, negative and zero scales, and rows whose unmasked scores lie
    near or below the masked score -10000 (masked elements then take the weight, as upstream's)."""
    b, np_, sq = 2, 3, 5
    x = torch.randn(b, np_, sq, sk, device=device).mul_(4)
    x[:, :, 1] += -10000.0 / (scale if scale != 0.0 else 1.0)  # near the masked score (scale 1: equal)
    x[:, :, 2] += -20000.0 / (scale if scale != 0.0 else 1.0)  # below it: masked elements dominate
    x = x.to(dtype)
    mask = torch.randint(0, 256, (b, 1, sq, sk), device=device, dtype=torch.uint8)
    mask[torch.rand(b, 1, sq, sk, device=device) < 0.6] = 0
    mask[0, 0, 3] = 0  # one row unmasked
    mask[1, 0, 4] = 1 + torch.arange(sk, device=device).remainder(255).to(torch.uint8)  # fully masked
    y = _softmax_ops.scaled_softmax_forward(x, mask, scale, False)
    # float32 scores near -10000 carry half an ulp (5e-4) of absolute error, and exp turns that
    # into a relative one: the float32 tolerance here is float16's.
    expected = oracle_forward(x, mask, scale, False)
    rtol = max(RTOL[dtype], RTOL[torch.float16])
    torch.testing.assert_close(y.double(), expected, rtol=rtol, atol=rtol * 1e-3, msg=f"scale {scale}")
    assert torch.all(y[1, :, 4] == 0), "a fully masked row gives 0"
    assert y[:, :, 2].isfinite().all() and (y[:, :, 2] > 0).any(), "masked elements take the weight"


def check_causal_forward(device, dtype, sk, batches):
    x = torch.randn(batches, sk, sk, device=device).mul_(4).to(dtype)
    # poison what a causal softmax must not read: the elements above the diagonal
    x.masked_fill_(torch.ones(sk, sk, dtype=torch.bool, device=device).triu_(1), float("nan"))
    y = _softmax_ops.scaled_softmax_forward(x, None, 1.3, True)
    assert_close(y, oracle_forward(x.nan_to_num(0.0), None, 1.3, True), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sk", [1, 17, 128, 1000])
def test_forward_causal(device, dtype, sk):
    check_causal_forward(device, dtype, sk, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sk", [2048, 4097, 8192])  # 4097: long and unaligned (the streaming kernel)
def test_forward_causal_long_rows(dtype, sk):
    check_causal_forward("cuda", dtype, sk, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sk", [16385, 40000, 70001])
def test_forward_streaming_rows(dtype, sk):
    """Rows longer than the registers hold (and unaligned ones), with a padding mask."""
    x = torch.randn(2, 3, 3, sk, device="cuda").mul_(4).to(dtype)
    mask = random_mask(2, 3, sk, "cuda")
    for m in (None, mask):
        assert_close(_softmax_ops.scaled_softmax_forward(x, m, 0.9, False), oracle_forward(x, m, 0.9, False), dtype)
    dy = torch.randn_like(x)
    y = _softmax_ops.scaled_softmax_forward(x, mask, 0.9, False)
    grad_close(_softmax_ops.scaled_softmax_backward(dy, y, 0.9, False), oracle_backward(dy, y, 0.9), dtype)


@pytest.mark.gpu
def test_unaligned_views_and_every_element_written():
    """Tensors starting off a 16-byte boundary take the scalar path; outputs come from poisoned memory."""
    base = torch.randn(2 * 5 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    x = base[1:].view(2, 5, 1, 64)  # contiguous, 2-byte offset
    ref = oracle_forward(x, None, 0.5, False)
    for _ in range(3):
        torch.full((x.numel(),), float("nan"), device="cuda", dtype=x.dtype)  # freed: reused by the output
        assert_close(_softmax_ops.scaled_softmax_forward(x, None, 0.5, False), ref, torch.bfloat16)
    dy = torch.randn_like(x)
    y = _softmax_ops.scaled_softmax_forward(x, None, 0.5, False)
    grad_close(_softmax_ops.scaled_softmax_backward(dy, y, 0.5, False), oracle_backward(dy, y, 0.5), torch.bfloat16)


def check_backward_ops(device, dtype, shape, causal):
    x = torch.randn(shape, device=device).mul_(3).to(dtype)
    y = _softmax_ops.scaled_softmax_forward(x, None, 0.8, causal)
    dy = torch.randn(shape, device=device).to(dtype)
    dx = _softmax_ops.scaled_softmax_backward(dy, y, 0.8, causal)
    grad_close(dx, oracle_backward(dy, y, 0.8), dtype)
    inplace = dy.clone()
    assert _softmax_ops.scaled_softmax_backward_(inplace, y, 0.8, causal) is None
    torch.testing.assert_close(inplace, dx, rtol=0, atol=0)  # the same kernel either way
    if causal:  # y is zero above the diagonal, and that part of dy is not read
        sk = shape[-1]
        poisoned = dy.masked_fill(torch.ones(sk, sk, dtype=torch.bool, device=device).triu(1), float("nan"))
        torch.testing.assert_close(_softmax_ops.scaled_softmax_backward(poisoned, y, 0.8, True), dx, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sk", [1, 17, 128, 1000, 2048, 20000])
def test_backward_ops(device, dtype, sk):
    check_backward_ops(device, dtype, shape_for(sk, device), False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sk", [1, 17, 128, 1000])
def test_backward_ops_causal(device, dtype, sk):
    check_backward_ops(device, dtype, (3, sk, sk) if sk <= 128 else (1, sk, sk), True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sk", [2048, 4097])
def test_backward_ops_causal_long_rows(dtype, sk):
    check_backward_ops("cuda", dtype, (1, sk, sk), True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["plain", "padding", "causal"])
def test_autograd_gradients(device, dtype, kind):
    """x.grad through the functional API against float64 autograd of the float64 computation."""
    b, np_, sq, sk = 3, 5, 9, 9
    x = torch.randn(b, np_, sq, sk, device=device).mul_(3).to(dtype).requires_grad_()
    mask = random_mask(b, sq, sk, device) if kind == "padding" else None
    if kind == "plain":
        y = F.scaled_softmax(x, 0.6)
    elif kind == "padding":
        y = F.scaled_masked_softmax(x, mask, 0.6)
    else:
        y = F.scaled_upper_triang_masked_softmax(x, None, 0.6)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    oracle_forward(x64, mask, 0.6, kind == "causal").backward(dy.double())
    grad_close(x.grad, x64.grad, dtype)
    # double backward runs through differentiable torch ops
    x2 = x.detach().float().requires_grad_()
    (g,) = torch.autograd.grad(F.scaled_softmax(x2, 0.6), x2, torch.randn_like(x2), create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x2)
    assert torch.isfinite(gg).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_empty_and_single(device, dtype):
    x = torch.randn(0, 2, 3, 4, device=device, dtype=dtype)
    assert _softmax_ops.scaled_softmax_forward(x, None, 1.0, False).shape == x.shape
    x = torch.randn(1, 1, 1, 1, device=device, dtype=dtype)
    assert _softmax_ops.scaled_softmax_forward(x, None, 1.0, True).item() == 1.0
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
    assert _softmax_ops.scaled_softmax_forward(x, mask, 1.0, False).item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["plain", "padding", "causal"])
def test_off_cuda_the_functions_are_torchs(monkeypatch, dtype, kind):
    """The default CPU path (torch's softmax, torch's autograd) against float64, the op and its errors."""
    monkeypatch.setattr(F, "_TORCH_OFF_CUDA", True)
    b, np_, sq, sk = 3, 5, 9, 9
    x = torch.randn(b, np_, sq, sk).mul_(3).to(dtype).requires_grad_()
    mask = random_mask(b, sq, sk, "cpu") if kind == "padding" else None
    call = {
        "plain": lambda t: F.scaled_softmax(t, 0.6),
        "padding": lambda t: F.generic_scaled_masked_softmax(t, mask, 0.6),
        "causal": lambda t: F.scaled_upper_triang_masked_softmax(t, None, 0.6),
    }[kind]
    y = call(x)
    assert graph_reaches(y.grad_fn, "SoftmaxBackward"), y.grad_fn
    assert not graph_reaches(y.grad_fn, "ScaledSoftmax")
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert_close(y, oracle_forward(x.detach(), mask, 0.6, kind == "causal"), dtype)
    op_y = _softmax_ops.scaled_softmax_forward(x.detach(), mask, 0.6, kind == "causal")
    torch.testing.assert_close(y, op_y, rtol=RTOL[dtype], atol=ATOL[dtype])
    if kind == "padding":
        assert torch.all(y[0, :, 1] == 0), "a fully masked row gives 0"
    dy = torch.randn_like(y)
    if kind == "causal":  # not read above the diagonal, as by the op's backward
        dy.masked_fill_(torch.ones(sk, sk, dtype=torch.bool).triu(1), float("nan"))
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_()
    oracle_forward(x64, mask, 0.6, kind == "causal").backward(dy.double().nan_to_num(0.0))
    grad_close(dx, x64.grad, dtype)
    if kind == "padding":
        assert torch.all(dx[0, :, 1] == 0), "a fully masked row has no gradient"
    # the op's backward, also where masked scores carry the weight (row 2: unmasked scores below -10000)
    x2 = x.detach().clone()
    if kind == "padding":
        x2[:, :, 2] -= 20000.0 / 0.6
    grads = []
    for default in (True, False):
        monkeypatch.setattr(F, "_TORCH_OFF_CUDA", default)
        leaf = x2.clone().requires_grad_()
        grads.append(torch.autograd.grad(call(leaf), leaf, dy)[0])
    monkeypatch.setattr(F, "_TORCH_OFF_CUDA", True)
    if kind == "padding":
        assert grads[1][:, :, 2].abs().amax() > 0, "masked scores with weight have a gradient in the op"
    torch.testing.assert_close(grads[0], grads[1], rtol=RTOL[dtype], atol=RTOL[dtype] * grads[1].abs().max().item())
    # the op's checks, in its words
    with pytest.raises(TypeError, match=r"scaled_softmax_forward: input has dtype torch\.float64"):
        call(x.detach().double())
    if kind == "padding":
        with pytest.raises(ValueError, match=r"scaled_softmax_forward: mask has shape \(3, 5, 9, 9\)"):
            F.scaled_masked_softmax(x, mask.expand(b, np_, sq, sk), 0.6)


def test_off_cuda_the_functions_compile(monkeypatch):
    monkeypatch.setattr(F, "_TORCH_OFF_CUDA", True)
    x = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16)
    mask = torch.rand(2, 1, 8, 8) < 0.3

    def step(t):
        a = F.scaled_masked_softmax(t, mask, 0.5)
        return (a.float() * 2 + F.scaled_upper_triang_masked_softmax(t, None, 0.5).float()).sum()

    eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    step(eager_x).backward()
    torch.compile(step, fullgraph=True, backend="aot_eager")(compiled_x).backward()
    torch.testing.assert_close(compiled_x.grad, eager_x.grad)
