"""fast_mask_softmax_dropout_func against a float64 softmax written here: masks, gradients, dropout statistics."""

from __future__ import annotations

import math

import pytest
import torch

from apex.contrib.multihead_attn import fast_mask_softmax_dropout_func

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
B, H, TQ, TK = 3, 2, 5, 9


def reference(scores, mask, additive):
    s = scores.double().view(B, H, TQ, TK)
    if mask is not None:
        s = s + mask.double()[:, None, None, :] if additive else s.masked_fill(mask.bool()[:, None, None, :], -math.inf)
    return torch.softmax(s, -1).view(B * H, TQ, TK)


def tolerance(dtype):
    eps = torch.finfo(dtype).eps
    return {"rtol": 4 * eps, "atol": 4 * eps} if dtype != torch.float32 else {"rtol": 1e-6, "atol": 1e-6}


def make_mask(kind, device, dtype):
    if kind == "none":
        return None
    if kind == "additive":
        m = torch.randn(B, TK)
        m[:, 0] = -10000.0
        return m.to(device=device, dtype=dtype)
    m = torch.zeros(B, TK, dtype=torch.bool)
    m[0, 3:] = True
    m[2, -1] = True
    return m.to(device) if kind == "bool" else m.to(device=device, dtype=torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["none", "bool", "uint8", "additive"])
def test_matches_float64_with_gradient(device, dtype, kind):
    torch.manual_seed(0)
    scores = (torch.randn(B * H, TQ, TK) * 3).to(device=device, dtype=dtype).requires_grad_()
    mask = make_mask(kind, device, dtype)
    additive = kind == "additive"
    out = fast_mask_softmax_dropout_func(False, H, scores, mask, additive, 0.5)  # not training: no dropout
    s64 = scores.detach().cpu().double().requires_grad_()
    expected = reference(s64, None if mask is None else mask.cpu(), additive)
    assert out.dtype == dtype and out.shape == scores.shape
    torch.testing.assert_close(out.detach().cpu().double(), expected.detach(), **tolerance(dtype))
    grad = torch.randn(B * H, TQ, TK, dtype=torch.float64)
    (got,) = torch.autograd.grad(out, scores, grad.to(device=device, dtype=dtype))
    (want,) = torch.autograd.grad(expected, s64, grad)
    torch.testing.assert_close(got.cpu().double(), want, **{k: 4 * v for k, v in tolerance(dtype).items()})


def test_dropout_statistics_and_determinism():
    p = 0.3
    scores = torch.randn(64 * 4, 32, 33)
    exact = fast_mask_softmax_dropout_func(False, 4, scores, None, False, p)
    torch.manual_seed(11)
    out = fast_mask_softmax_dropout_func(True, 4, scores, None, False, p)
    torch.manual_seed(11)
    torch.testing.assert_close(out, fast_mask_softmax_dropout_func(True, 4, scores, None, False, p), rtol=0, atol=0)
    dropped = out == 0
    n = dropped.numel()
    # the dropped fraction is binomial(n, p): within 5 standard deviations
    assert abs(dropped.double().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n)
    torch.testing.assert_close(out[~dropped], exact[~dropped] / (1 - p))


BAD = {
    "2-d inputs": ((True, 2, torch.randn(4, 5), None, False, 0.1), ValueError, "inputs must be a float"),
    "heads do not divide": ((True, 4, torch.randn(6, 5, 5), None, False, 0.1), ValueError, "not a multiple of heads"),
    "bad dropout": ((True, 2, torch.randn(6, 5, 5), None, False, 1.0), ValueError, "dropout_prob must be in"),
    "mask shape": ((True, 2, torch.randn(6, 5, 5), torch.zeros(3, 4, dtype=torch.bool), False, 0.1), ValueError,
                   "key_padding_mask has shape \\(3, 4\\)"),
    "float mask not additive": ((True, 2, torch.randn(6, 5, 5), torch.zeros(3, 5), False, 0.1), TypeError,
                                "key_padding_mask has dtype torch.float32"),
    "bool mask additive": ((True, 2, torch.randn(6, 5, 5), torch.zeros(3, 5, dtype=torch.bool), True, 0.1), TypeError,
                           "with mask_additive=True"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(case):
    args, error, message = BAD[case]
    with pytest.raises(error, match=r"^fast_mask_softmax_dropout_func: .*" + message):
        fast_mask_softmax_dropout_func(*args)


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    mask = torch.zeros(B, TK, dtype=torch.bool, device=device)
    mask[1, 2:] = True

    def fn(x):
        return fast_mask_softmax_dropout_func(False, H, x, mask, False, 0.0).square().sum()

    compiled = torch.compile(fn, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    x = torch.randn(B * H, TQ, TK, device=device, requires_grad=True)
    (expected,) = torch.autograd.grad(fn(x), x)
    (got,) = torch.autograd.grad(compiled(x), x)
    torch.testing.assert_close(got, expected)
