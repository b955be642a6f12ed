"""Fused rotary embeddings against a float64 rendering of Megatron's unfused expression
(``x * cos + rotate_half(x) * sin`` on the first d2 channels, the rest passed through): every
layout (sbhd, cached, thd, 2-D), every dtype, strided inputs, transpose_output_memory, gradients."""

from __future__ import annotations

import itertools

import pytest
import torch

from apex.transformer.functional import fused_rope as F

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def tol(dtype):
    # one rounding of results up to ~4 in magnitude (float32: the sin/cos approximations)
    return {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]


def close(actual, expected, dtype):
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=tol(dtype), rtol=tol(dtype))


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def reference(x, cos, sin):
    """float64 Megatron expression; cos/sin broadcast against x[..., :d2]."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    d2 = cos.shape[-1]
    rot, rest = x[..., :d2], x[..., d2:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


def megatron_freqs(positions, d2, device, base=10000.0, offset=0.0):
    inv = 1.0 / base ** (torch.arange(0, d2, 2, dtype=torch.float64) / d2)
    angles = (torch.arange(positions, dtype=torch.float64) + offset)[:, None] * inv[None, :]
    return torch.cat((angles, angles), dim=-1).float().reshape(positions, 1, 1, d2).to(device)


def random_freqs(positions, d2, device, scale=10.0):
    """Independent angles per channel (both halves differ), as upstream's kernel allows."""
    return (torch.randn(positions, 1, 1, d2) * scale).to(device)


def poison(device):
    """Leave NaN in the CUDA caching allocator's free blocks, so an unwritten output shows."""
    if torch.device(device).type == "cuda":
        torch.full((1 << 24,), float("nan"), device=device)


# sbhd ------------------------------------------------------------------------------------------

SHAPES = [  # s, b, h, d, d2
    (7, 3, 5, 64, 64),
    (9, 2, 3, 128, 64),
    (5, 1, 1, 24, 8),  # 4-element halves
    (3, 2, 3, 6, 2),  # 1-element halves
    (1, 1, 1, 2, 2),
    (4, 2, 3, 16, 0),  # nothing rotated
    (0, 2, 3, 8, 8),  # empty
    (33, 2, 4, 256, 128),
    (5, 2, 3, 40, 16),  # 3 pass-through vectors of 16 bytes: one pair and a single one
    (3, 2, 3, 7, 2),  # 5 pass-through elements (scalar accesses): two pairs and a single one
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("transpose", [False, True], ids=["sbhd-out", "bshd-memory-out"])
def test_forward(device, dtype, shape, transpose):
    s, b, h, d, d2 = shape
    x = torch.randn(s, b, h, d, device=device).to(dtype)
    freqs = random_freqs(s, d2, device)
    poison(device)
    out = F.fused_apply_rotary_pos_emb(x, freqs, transpose)
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    if transpose:
        assert out.transpose(0, 1).is_contiguous(), out.stride()
    else:
        assert out.is_contiguous(), out.stride()
    close(out, reference(x.cpu(), freqs.cpu().double().cos(), freqs.cpu().double().sin()), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("table_dtype", ["float32", "input"])
@pytest.mark.parametrize("transpose", [False, True], ids=["sbhd-out", "bshd-memory-out"])
def test_cached(device, dtype, table_dtype, transpose):
    s, b, h, d, d2 = 11, 3, 5, 64, 32
    x = torch.randn(s, b, h, d, device=device).to(dtype)
    freqs = megatron_freqs(s, d2, device)
    tdtype = torch.float32 if table_dtype == "float32" else dtype
    cos, sin = freqs.cos().to(tdtype), freqs.sin().to(tdtype)
    poison(device)
    out = F.fused_apply_rotary_pos_emb_cached(x, cos, sin, transpose)
    assert out.transpose(0, 1).is_contiguous() if transpose else out.is_contiguous()
    close(out, reference(x.cpu(), cos.cpu(), sin.cpu()), dtype)
    # float32 tables of freqs give what freqs gives
    if tdtype == torch.float32:
        close(out, F.fused_apply_rotary_pos_emb(x, freqs, transpose), dtype)


def test_large_angles(device):
    """Positions of a long context (angles past 10^4 radians) keep float32 accuracy."""
    s, d2 = 16, 64
    x = torch.randn(s, 2, 3, d2, device=device)
    freqs = megatron_freqs(s, d2, device, offset=60000.0)
    out = F.fused_apply_rotary_pos_emb(x, freqs)
    # the reference takes sin/cos of the same float32 angles, in float64
    f = freqs.cpu().double()
    torch.testing.assert_close(out.double().cpu(), reference(x.cpu(), f.cos(), f.sin()), atol=2e-5, rtol=2e-5)


def strided_inputs(s, b, h, d, device, dtype):
    """Views of the layouts Megatron passes: slices of a fused QKV tensor, a transposed batch,
    a misaligned slice, a head dim that is not unit-stride."""
    qkv = torch.randn(s, b, h, 3 * d, device=device).to(dtype)
    bshd = torch.randn(b, s, h, d, device=device).to(dtype)
    wide = torch.randn(s, b, h, d + 1, device=device).to(dtype)
    dh = torch.randn(s, b, d, h, device=device).to(dtype)
    return {
        "qkv-q": qkv[..., :d],
        "qkv-k": qkv[..., d : 2 * d],
        "qkv-v": qkv[..., 2 * d :],
        "transposed-batch": bshd.transpose(0, 1),
        "misaligned": wide[..., 1:],
        "strided-head-dim": dh.transpose(2, 3),
        "expanded-batch": torch.randn(s, 1, h, d, device=device).to(dtype).expand(s, b, h, d),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "layout", ["qkv-q", "qkv-k", "qkv-v", "transposed-batch", "misaligned", "strided-head-dim", "expanded-batch"]
)
def test_strided_input(device, dtype, layout):
    s, b, h, d, d2 = 7, 3, 4, 32, 16
    x = strided_inputs(s, b, h, d, device, dtype)[layout]
    assert not x.is_contiguous()
    freqs = random_freqs(s, d2, device)
    out = F.fused_apply_rotary_pos_emb(x, freqs)
    assert out.is_contiguous()
    close(out, reference(x.cpu(), freqs.cpu().double().cos(), freqs.cpu().double().sin()), dtype)
    out_t = F.fused_apply_rotary_pos_emb_cached(x, freqs.cos(), freqs.sin(), True)
    close(out_t, out, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["sbhd", "sbhd-transposed-out", "thd"])
def test_chunks_of_16_rows_and_a_short_last_one(layout):
    """Inputs large enough that the CUDA plan gives chunks of 16 rows (it does so where they fill
    the device) over 39 or 37 rows: 16, 16 and a last chunk of 7 or 5 rows, whose last step of 2
    rows in flight is half empty; sbhd's chunks cross batch boundaries (h = 13). float32, d = 128,
    d2 = 64: 16-byte accesses, pass-through items of two vectors. Every output element checked."""
    device, dtype, d, d2 = "cuda", torch.float32, 128, 64
    if layout == "thd":
        tokens, h = 8192, 37
        x = torch.randn(tokens, h, d, device=device)
        cu = torch.tensor([0, 3000, 3001, 3001, 8000], dtype=torch.int32, device=device)  # 192 tokens after
        freqs = random_freqs(5000, d2, device)
        torch.full((x.numel(),), float("nan"), device=device)  # the output's block, poisoned
        close(F.fused_apply_rotary_pos_emb_thd(x, cu, freqs), thd_reference(x, cu, freqs), dtype)
        return
    s, b, h = 8192, 3, 13
    x = torch.randn(s, b, h, d, device=device)
    freqs = random_freqs(s, d2, device)
    torch.full((x.numel(),), float("nan"), device=device)
    out = F.fused_apply_rotary_pos_emb(x, freqs, layout == "sbhd-transposed-out")
    close(out, reference(x.cpu(), freqs.cpu().double().cos(), freqs.cpu().double().sin()), dtype)


# gradients -------------------------------------------------------------------------------------


def grad_of(fn, x, g):
    leaf = x.detach().requires_grad_()
    (grad,) = torch.autograd.grad(fn(leaf), leaf, g)
    return grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d2", [64, 32], ids=["d2=d", "d2<d"])
@pytest.mark.parametrize("transpose", [False, True], ids=["sbhd-out", "bshd-memory-out"])
def test_gradients(device, dtype, d2, transpose):
    s, b, h, d = 9, 3, 5, 64
    x = torch.randn(s, b, h, d, device=device).to(dtype)
    g = torch.randn(s, b, h, d, device=device).to(dtype)
    freqs = random_freqs(s, d2, device)
    f64 = freqs.cpu().double()
    expected = grad_of(lambda t: reference(t, f64.cos(), f64.sin()), x.cpu().double(), g.cpu().double())
    poison(device)
    close(grad_of(lambda t: F.fused_apply_rotary_pos_emb(t, freqs, transpose), x, g), expected, dtype)
    cached = grad_of(lambda t: F.fused_apply_rotary_pos_emb_cached(t, freqs.cos(), freqs.sin(), transpose), x, g)
    close(cached, expected, dtype)


def test_gradient_of_strided_input_and_output(device):
    s, b, h, d = 5, 2, 3, 32
    qkv = torch.randn(s, b, h, 3 * d, device=device, requires_grad=True)
    freqs = megatron_freqs(s, d, device)
    out = F.fused_apply_rotary_pos_emb(qkv[..., d : 2 * d], freqs, True)
    g = torch.randn(b, s, h, d, device=device).transpose(0, 1)  # a non-contiguous incoming gradient
    (grad,) = torch.autograd.grad(out, qkv, g)
    f64 = freqs.cpu().double()
    leaf = qkv.detach().cpu().double().requires_grad_()
    (expected,) = torch.autograd.grad(reference(leaf[..., d : 2 * d], f64.cos(), f64.sin()), leaf, g.cpu().double())
    close(grad, expected, torch.float32)


def test_double_backward(device):
    """The gradient is itself differentiable: d<grad_x, v>/dg is the forward rotation of v."""
    s, b, h, d = 4, 2, 3, 16
    x = torch.randn(s, b, h, d, device=device, requires_grad=True)
    g = torch.randn(s, b, h, d, device=device, requires_grad=True)
    v = torch.randn(s, b, h, d, device=device)
    freqs = random_freqs(s, d, device)
    out = F.fused_apply_rotary_pos_emb(x, freqs)
    (grad_x,) = torch.autograd.grad(out, x, g, create_graph=True)
    (grad_g,) = torch.autograd.grad(grad_x, g, v)
    close(grad_g, F.fused_apply_rotary_pos_emb(v, freqs), torch.float32)


def test_no_gradient_to_the_tables(device):
    x = torch.randn(3, 2, 2, 8, device=device, requires_grad=True)
    freqs = random_freqs(3, 8, device).requires_grad_()
    F.fused_apply_rotary_pos_emb(x, freqs).sum().backward()
    assert x.grad is not None and freqs.grad is None


# thd -------------------------------------------------------------------------------------------


def thd_reference(x, cu, freqs):
    """Sequence by sequence, as Megatron's unfused thd path; tokens outside the sequences copied."""
    x = x.cpu().double()
    out = x.clone()
    f = freqs.cpu().double()
    bounds = cu.tolist()
    for start, end in itertools.pairwise(bounds):
        n = end - start
        if n > 0:
            out[start:end] = reference(x[start:end], f[:n, 0].cos(), f[:n, 0].sin())
    return out


THD_CASES = {  # tokens, cu_seqlens
    "uneven-with-empty-and-single": (15, [0, 5, 5, 6, 13]),
    "leading-padding": (12, [2, 9, 12]),
    "one-sequence": (8, [0, 8]),
    "no-sequences": (4, [0]),
    "no-tokens": (0, [0, 0]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(THD_CASES))
@pytest.mark.parametrize("d2", [32, 16], ids=["d2=d", "d2<d"])
def test_thd(device, dtype, case, d2):
    tokens, bounds = THD_CASES[case]
    h, d, max_s = 3, 32, 9
    x = torch.randn(tokens, h, d, device=device).to(dtype)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    freqs = random_freqs(max_s, d2, device)
    poison(device)
    out = F.fused_apply_rotary_pos_emb_thd(x, cu, freqs)
    assert out.shape == x.shape and out.is_contiguous()
    expected = thd_reference(x, cu, freqs)
    close(out, expected, dtype)
    g = torch.randn_like(x)
    leaf = x.cpu().double().requires_grad_()
    (expected_grad,) = torch.autograd.grad(thd_reference(leaf, cu, freqs), leaf, g.cpu().double())
    close(grad_of(lambda t: F.fused_apply_rotary_pos_emb_thd(t, cu, freqs), x, g), expected_grad, dtype)


def test_thd_strided_input(device):
    tokens, h, d = 20, 4, 64
    qkv = torch.randn(tokens, h, 3 * d, device=device, dtype=torch.bfloat16)
    cu = torch.tensor([0, 7, 19], dtype=torch.int32, device=device)
    freqs = megatron_freqs(12, 64, device)
    x = qkv[..., d : 2 * d]
    close(F.fused_apply_rotary_pos_emb_thd(x, cu, freqs), thd_reference(x, cu, freqs), torch.bfloat16)


def test_thd_sequence_longer_than_freqs(device):
    """Positions past max_s have no angle: their rotated channels are NaN, the rest is kept."""
    x = torch.randn(10, 2, 8, device=device)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32, device=device)
    freqs = random_freqs(5, 4, device)
    out = F.fused_apply_rotary_pos_emb_thd(x, cu, freqs).cpu()
    past = torch.tensor([8, 9])  # positions 5 and 6 of the second sequence
    assert torch.isnan(out[past, :, :4]).all()
    assert not torch.isnan(out[:8]).any()
    torch.testing.assert_close(out[:, :, 4:], x[:, :, 4:].cpu())


def test_thd_matches_sbhd_for_equal_lengths(device):
    s, b, h, d = 6, 3, 2, 16
    x = torch.randn(s, b, h, d, device=device, dtype=torch.float16)
    freqs = megatron_freqs(s, d, device)
    packed = x.transpose(0, 1).reshape(b * s, h, d)
    cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device=device)
    out = F.fused_apply_rotary_pos_emb_thd(packed, cu, freqs)
    expected = F.fused_apply_rotary_pos_emb(x, freqs).transpose(0, 1).reshape(b * s, h, d)
    torch.testing.assert_close(out, expected)


# 2-D -------------------------------------------------------------------------------------------


def image_reference(x, img_h, img_w, cos_h, sin_h, cos_w, sin_w):
    b, s, h, d = x.shape
    x5 = x.cpu().double().reshape(b, img_h, img_w, h, d)
    half = d // 2

    def rows(t):
        return t.cpu().double()[0, :img_h, 0][:, None, None, :]

    def cols(t):
        return t.cpu().double()[0, :img_w, 0][None, :, None, :]

    top = reference(x5[..., :half], rows(cos_h), rows(sin_h))
    bottom = reference(x5[..., half:], cols(cos_w), cols(sin_w))
    return torch.cat((top, bottom), dim=-1).reshape(b, s, h, d)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("table_dtype", ["float32", "input"])
@pytest.mark.parametrize("size", [(2, 3, 5, 3, 16), (1, 4, 4, 2, 64), (3, 1, 7, 1, 4)], ids=str)
def test_2d(device, dtype, table_dtype, size):
    b, img_h, img_w, h, d = size
    x = torch.randn(b, img_h * img_w, h, d, device=device).to(dtype)
    tdtype = torch.float32 if table_dtype == "float32" else dtype
    fh, fw = random_freqs(img_h + 2, d // 2, device), random_freqs(img_w + 1, d // 2, device)
    tables = [t.transpose(0, 1).to(tdtype) for t in (fh.cos(), fh.sin(), fw.cos(), fw.sin())]  # [1, H, 1, d/2]
    poison(device)
    out = F.fused_apply_rotary_pos_emb_2d(x, img_h, img_w, *tables)
    assert out.shape == x.shape and out.is_contiguous()
    close(out, image_reference(x, img_h, img_w, *tables), dtype)
    g = torch.randn_like(x)
    leaf = x.cpu().double().requires_grad_()
    (expected,) = torch.autograd.grad(image_reference(leaf, img_h, img_w, *tables), leaf, g.cpu().double())
    close(grad_of(lambda t: F.fused_apply_rotary_pos_emb_2d(t, img_h, img_w, *tables), x, g), expected, dtype)


def test_2d_strided_input(device):
    b, img_h, img_w, h, d = 2, 3, 4, 2, 32
    qkv = torch.randn(b, img_h * img_w, h, 3 * d, device=device)
    x = qkv[..., :d]
    f = random_freqs(4, d // 2, device).transpose(0, 1)
    tables = (f.cos(), f.sin(), f.cos(), f.sin())
    close(
        F.fused_apply_rotary_pos_emb_2d(x, img_h, img_w, *tables),
        image_reference(x, img_h, img_w, *tables),
        torch.float32,
    )
