"""Upstream's top-level ``fast_multihead_attn`` module: every forward against a float64 reference written
from the definition (with the dropout masks it returned), every backward against autograd of that reference."""

from __future__ import annotations

import math

import fast_multihead_attn as fma
import pytest
import torch

T, TK, B, E, H = 5, 7, 3, 16, 4
D = E // H
P = 0.25


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


def tol(dtype):
    eps = torch.finfo(dtype).eps
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 16 * eps, "atol": 16 * eps}


def close(actual, expected, dtype):
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.double(), expected.detach().double(), **tol(dtype))


def ref_probs(scores, heads, mask, kind):
    """scores [B*H, Tq, Tk] float64; kind: None, 'pad', 'time', 'additive'."""
    bh, tq, tk = scores.shape
    s = scores.view(bh // heads, heads, tq, tk)
    if kind == "pad":
        s = s.masked_fill(mask.bool()[:, None, None, :], -math.inf)
    elif kind == "additive":
        s = s + mask.double()[:, None, None, :]
    elif kind == "time":
        s = s.masked_fill(mask.bool(), -math.inf)
    return torch.softmax(s, -1).view(bh, tq, tk)


def ref_attention(q, k, v, mask, kind, keep):
    """q [Tq, B, E], k and v [Tk, B, E] float64 (heads side by side) -> context [Tq, B, E]."""
    tq, b, e = q.shape
    qh = q.reshape(tq, b * H, D).transpose(0, 1)
    kh = k.reshape(k.shape[0], b * H, D).transpose(0, 1)
    vh = v.reshape(v.shape[0], b * H, D).transpose(0, 1)
    probs = ref_probs(qh @ kh.transpose(1, 2) / math.sqrt(D), H, mask, kind)
    dropped = probs * keep.double() / (1 - P)
    return (dropped @ vh).transpose(0, 1).reshape(tq, b, e)


def ref_norm(x, g, b):
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + 1e-5) * g + b


def make_mask(kind, tq, tk, dtype):
    if kind is None:
        return None
    if kind == "pad":
        m = torch.zeros(B, tk, dtype=torch.uint8)
        m[0, -2:] = 1
        m[2, -1] = 1
        return m
    if kind == "time":
        return torch.ones(tq, tk, dtype=torch.uint8).triu(1)
    m = rand(B, tk, dtype=dtype)
    m[1, -1] = -10000.0
    return m


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _grads(out, inputs, grad):
    return torch.autograd.grad(out, inputs, grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [None, "pad", "time"])
@pytest.mark.parametrize("family", ["self_attn", "self_attn_bias", "self_attn_norm_add"])
def test_self_attention_families(dtype, kind, family):
    torch.manual_seed(0)
    x, wi, wo = rand(T, B, E, dtype=dtype), rand(3 * E, E, dtype=dtype) / 4, rand(E, E, dtype=dtype) / 4
    bi, bo, g, beta = rand(3 * E, dtype=dtype), rand(E, dtype=dtype), rand(E, dtype=dtype), rand(E, dtype=dtype)
    mask = make_mask(kind, T, T, dtype)
    flags = (mask is not None, kind == "time", True, H)
    if family == "self_attn":
        saved = fma.self_attn_forward(*flags, x, wi, wo, mask, P)
    elif family == "self_attn_bias":
        saved = fma.self_attn_bias_forward(*flags, x, wi, wo, bi, bo, mask, P)
    else:
        saved = fma.self_attn_norm_add_forward(*flags, x, g, beta, wi, wo, mask, P)
    keep = saved[3] if family != "self_attn_norm_add" else saved[6]
    assert keep.dtype == torch.uint8 and keep.shape == (B * H, T, T)
    assert 0.5 < keep.double().mean() < 0.95  # p = 0.25 over 300 draws

    leaves = [t.double().requires_grad_() for t in (x, wi, wo, bi, bo, g, beta)]
    x64, wi64, wo64, bi64, bo64, g64, beta64 = leaves
    h = ref_norm(x64, g64, beta64) if family == "self_attn_norm_add" else x64
    lin = h @ wi64.T + (bi64 if family == "self_attn_bias" else 0)
    grouped = lin.view(T, B, H, 3, D)
    q, k, v = (grouped[..., i, :].reshape(T, B, E) for i in range(3))
    context = ref_attention(q, k, v, mask, kind, keep)
    out = context @ wo64.T + (bo64 if family == "self_attn_bias" else 0)
    if family == "self_attn_norm_add":
        out = x64 + out * saved[8].double() / (1 - P)
    close(saved[-1], out, dtype)
    close(saved[-2] if family != "self_attn_norm_add" else saved[7], context, dtype)

    grad = rand(T, B, E, dtype=dtype)
    if family == "self_attn":
        got = fma.self_attn_backward(H, grad, saved[4], saved[2], saved[1], saved[0], x, wi, wo, saved[3], P)
        wrt = [x64, wi64, wo64]
    elif family == "self_attn_bias":
        got = fma.self_attn_bias_backward(H, grad, saved[4], saved[2], saved[1], saved[0], x, wi, wo, saved[3], P)
        wrt = [x64, wi64, wo64, bi64, bo64]
    else:
        ln, mean, invvar, lin_r, soft, drop, dmask, m2, amask, _ = saved
        assert mean.dtype == invvar.dtype == torch.float32 and mean.shape == (T * B,)
        got = fma.self_attn_norm_add_backward(
            H, grad, m2, drop, soft, lin_r, ln, mean, invvar, x, g, beta, wi, wo, dmask, amask, P
        )
        wrt = [x64, g64, beta64, wi64, wo64]
    want = _grads(out, wrt, grad.double())
    assert len(got) == len(want)
    for a, w in zip(got, want):
        close(a, w, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_self_attn_bias_additive_mask(dtype):
    torch.manual_seed(1)
    x, wi, wo = rand(T, B, E, dtype=dtype), rand(3 * E, E, dtype=dtype) / 4, rand(E, E, dtype=dtype) / 4
    bi, bo = rand(3 * E, dtype=dtype), rand(E, dtype=dtype)
    mask = make_mask("additive", T, T, dtype)
    lin_r, bmm1, drop, keep, m2, outputs = fma.self_attn_bias_additive_mask_forward(
        True, False, True, H, x, wi, wo, bi, bo, mask, P
    )
    x64, wi64, wo64, bi64, bo64 = (t.double().requires_grad_() for t in (x, wi, wo, bi, bo))
    grouped = (x64 @ wi64.T + bi64).view(T, B, H, 3, D)
    q, k, v = (grouped[..., i, :].reshape(T, B, E) for i in range(3))
    out = ref_attention(q, k, v, mask, "additive", keep) @ wo64.T + bo64
    close(outputs, out, dtype)
    grad = rand(T, B, E, dtype=dtype)
    got = fma.self_attn_bias_additive_mask_backward(H, grad, m2, drop, bmm1, mask, lin_r, x, wi, wo, keep, P)
    for a, w in zip(got, _grads(out, [x64, wi64, wo64, bi64, bo64], grad.double())):
        close(a, w, dtype)
    with pytest.raises(
        ValueError, match=r"^self_attn_bias_additive_mask_forward: the additive-mask functions need a mask"
    ):
        fma.self_attn_bias_additive_mask_forward(False, False, True, H, x, wi, wo, bi, bo, None, P)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [None, "pad", "time"])
@pytest.mark.parametrize("norm_add", [False, True])
def test_encdec_families(dtype, kind, norm_add):
    torch.manual_seed(2)
    x, mem = rand(T, B, E, dtype=dtype), rand(TK, B, E, dtype=dtype)
    wq, wkv, wo = rand(E, E, dtype=dtype) / 4, rand(2 * E, E, dtype=dtype) / 4, rand(E, E, dtype=dtype) / 4
    g, beta = rand(E, dtype=dtype), rand(E, dtype=dtype)
    mask = make_mask(kind, T, TK, dtype)
    flags = (mask is not None, kind == "time", True, H)
    if norm_add:
        saved = fma.encdec_multihead_attn_norm_add_forward(*flags, x, mem, g, beta, wq, wkv, wo, mask, P)
        keep, add_keep = saved[7], saved[9]
    else:
        saved = fma.encdec_multihead_attn_forward(*flags, x, mem, wq, wkv, wo, mask, P)
        keep = saved[4]
    x64, mem64, wq64, wkv64, wo64, g64, beta64 = (t.double().requires_grad_() for t in (x, mem, wq, wkv, wo, g, beta))
    h = ref_norm(x64, g64, beta64) if norm_add else x64
    kv = (mem64 @ wkv64.T).view(TK, B, H, 2, D)
    k, v = (kv[..., i, :].reshape(TK, B, E) for i in range(2))
    out = ref_attention(h @ wq64.T, k, v, mask, kind, keep) @ wo64.T
    if norm_add:
        out = x64 + out * add_keep.double() / (1 - P)
    close(saved[-1], out, dtype)
    grad = rand(T, B, E, dtype=dtype)
    if norm_add:
        ln, mean, invvar, lq, lkv, soft, drop, dmask, m2, amask, _ = saved
        got = fma.encdec_multihead_attn_norm_add_backward(
            H, grad, m2, drop, soft, lq, lkv, ln, mean, invvar, x, mem, g, beta, wq, wkv, wo, dmask, amask, P
        )
        wrt = [x64, mem64, g64, beta64, wq64, wkv64, wo64]
    else:
        lq, lkv, soft, drop, dmask, m2, _ = saved
        got = fma.encdec_multihead_attn_backward(H, grad, m2, drop, soft, lq, lkv, x, mem, wq, wkv, wo, dmask, P)
        wrt = [x64, mem64, wq64, wkv64, wo64]
    want = _grads(out, wrt, grad.double())
    assert len(got) == len(want)
    for a, w in zip(got, want):
        close(a, w, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("additive", [False, True])
def test_mask_softmax_dropout_families(dtype, additive):
    torch.manual_seed(3)
    scores = rand(B * H, T, TK, dtype=dtype)
    mask = make_mask("additive" if additive else "pad", T, TK, dtype)
    forward = fma.additive_mask_softmax_dropout_forward if additive else fma.mask_softmax_dropout_forward
    dropped, keep, soft = forward(True, True, H, scores, mask, P)
    s64 = scores.double().requires_grad_()
    probs = ref_probs(s64, H, mask, "additive" if additive else "pad")
    close(soft, probs, dtype)
    out = probs * keep.double() / (1 - P)
    close(dropped, out, dtype)
    grad = rand(B * H, T, TK, dtype=dtype)
    if additive:
        got = fma.additive_mask_softmax_dropout_backward(True, H, grad, soft, keep, P)
    else:
        got = fma.mask_softmax_dropout_backward(True, H, grad, soft, keep, mask, P)
    # the backward reads the rounded softmax: compare against autograd at float64 within the dtype's tolerance
    close(got, _grads(out, [s64], grad.double())[0], dtype)


def test_not_training_is_exact_and_masks_are_ones():
    torch.manual_seed(4)
    x, wi, wo = rand(T, B, E), rand(3 * E, E) / 4, rand(E, E) / 4
    _, soft, drop, keep, _, out = fma.self_attn_forward(False, False, False, H, x, wi, wo, None, 0.5)
    assert torch.equal(drop, soft) and bool((keep == 1).all())
    again = fma.self_attn_forward(False, False, False, H, x, wi, wo, None, 0.0)[-1]
    torch.testing.assert_close(out, again, rtol=0, atol=0)


def test_bad_input():
    x, wi, wo = rand(T, B, E), rand(3 * E, E), rand(E, E)
    with pytest.raises(ValueError, match=r"^self_attn_forward: heads \(3\) must divide the embedding width \(16\)"):
        fma.self_attn_forward(False, False, True, 3, x, wi, wo, None, 0.1)
    with pytest.raises(ValueError, match=r"^self_attn_forward: inputs must be a 3-D tensor"):
        fma.self_attn_forward(False, False, True, H, x[0], wi, wo, None, 0.1)
    with pytest.raises(ValueError, match=r"^self_attn_forward: pad_mask has shape \(5, 3\)"):
        fma.self_attn_forward(True, False, True, H, x, wi, wo, torch.zeros(T, B, dtype=torch.uint8), 0.1)
    with pytest.raises(ValueError, match=r"^mask_softmax_dropout_forward: heads \(5\) must divide"):
        fma.mask_softmax_dropout_forward(False, True, 5, rand(12, 3, 3), None, 0.1)
    with pytest.raises(ValueError, match=r"^self_attn_forward: dropout_prob must be in \[0, 1\), got 1.5"):
        fma.self_attn_forward(False, False, True, H, x, wi, wo, None, 1.5)


def test_module_exports_upstreams_functions():
    names = {
        "additive_mask_softmax_dropout", "encdec_multihead_attn", "encdec_multihead_attn_norm_add",
        "mask_softmax_dropout", "self_attn", "self_attn_bias", "self_attn_bias_additive_mask", "self_attn_norm_add",
    }  # fmt: skip
    for name in names:
        for suffix in ("_forward", "_backward"):
            assert callable(getattr(fma, name + suffix))
    assert set(fma.__all__) == {n + s for n in names for s in ("_forward", "_backward")} | {"__version__"}
