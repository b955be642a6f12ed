"""The rotary-embedding ops themselves: opcheck, torch.compile, bad input (the same words from the
Python checks and the CUDA kernels), the legacy module, devices other than cuda:0, determinism
and tensors past 2^31 elements."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import apex.transformer._rope_ops  # noqa: F401  (registers the ops)
from apex.transformer.functional import fused_rope as F

OPS = torch.ops.apex_transformer


def freqs_of(positions, d2, device):
    return (torch.randn(positions, 1, 1, d2) * 3).to(device)


def tables_2d(positions, half, device, dtype=torch.float32):
    f = freqs_of(positions, half, device).transpose(0, 1)
    return f.cos().to(dtype), f.sin().to(dtype)


# opcheck ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("backward", [False, True])
def test_opcheck_rope(device, transpose, backward):
    x = torch.randn(5, 3, 2, 16, device=device, dtype=torch.bfloat16)
    torch.library.opcheck(OPS.rope.default, (x, freqs_of(5, 8, device), transpose, backward))


@pytest.mark.parametrize("transpose", [False, True])
def test_opcheck_rope_cached(device, transpose):
    x = torch.randn(5, 3, 2, 16, device=device, dtype=torch.float16)
    f = freqs_of(5, 16, device)
    torch.library.opcheck(OPS.rope_cached.default, (x, f.cos().half(), f.sin().half(), transpose, True))


def test_opcheck_rope_thd(device):
    x = torch.randn(11, 3, 16, device=device)[:, :, :8]  # strided
    cu = torch.tensor([0, 4, 4, 10], dtype=torch.int32, device=device)
    torch.library.opcheck(OPS.rope_thd.default, (x, cu, freqs_of(6, 8, device), False))


def test_opcheck_rope_2d(device):
    x = torch.randn(2, 3, 4, 2, 16, device=device, dtype=torch.bfloat16)
    cos_h, sin_h = tables_2d(3, 8, device)
    cos_w, sin_w = tables_2d(5, 8, device)
    torch.library.opcheck(OPS.rope_2d.default, (x, cos_h, sin_h, cos_w, sin_w, False))


# torch.compile ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_compile_fullgraph():
    torch._dynamo.reset()
    device = "cuda"
    s, b, h, d = 6, 2, 3, 32
    # float32: the four layouts' gradients are summed; in bfloat16 eager mode rounds after each
    # sum and inductor once at the end, which put them 2 ulp apart on the H200
    x = torch.randn(s, b, h, d, device=device, requires_grad=True)
    freqs = freqs_of(s, 16, device)
    cu = torch.tensor([0, 6, 12], dtype=torch.int32, device=device)
    cos_h, sin_h = tables_2d(3, d // 2, device)
    cos_w, sin_w = tables_2d(4, d // 2, device)

    def all_layouts(x):
        a = F.fused_apply_rotary_pos_emb(x, freqs, True)
        c = F.fused_apply_rotary_pos_emb_cached(x, freqs.cos(), freqs.sin())
        t = F.fused_apply_rotary_pos_emb_thd(x.reshape(s * b, h, d), cu, freqs)
        i = F.fused_apply_rotary_pos_emb_2d(x.reshape(1, s * b, h, d), 3, 4, cos_h, sin_h, cos_w, sin_w)
        return a.float().sum() + (c.float() * 2).sum() + (t.float() * 3).sum() + (i.float() * 4).sum(), a

    compiled = torch.compile(all_layouts, fullgraph=True)
    loss, a = compiled(x)
    (grad,) = torch.autograd.grad(loss, x)
    eager_loss, eager_a = all_layouts(x)
    (eager_grad,) = torch.autograd.grad(eager_loss, x)
    torch.testing.assert_close(a, eager_a)
    assert a.stride() == eager_a.stride()
    torch.testing.assert_close(grad, eager_grad, rtol=1e-5, atol=1e-5)


# bad input -------------------------------------------------------------------------------------


def bad_cases(device):
    x = torch.randn(4, 2, 3, 16, device=device, dtype=torch.bfloat16)
    f = freqs_of(4, 16, device)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=device)
    x5 = torch.randn(2, 3, 4, 2, 16, device=device, dtype=torch.bfloat16)
    ch, sh = tables_2d(3, 8, device)
    cw, sw = tables_2d(4, 8, device)
    return {
        "input-dtype": (OPS.rope, (x.double(), f), TypeError, "rope: input has dtype torch.float64"),
        "input-dims": (
            OPS.rope,
            (x[0], f),
            ValueError,
            r"rope: input must be 4-D \[s, b, h, d\], got shape \(2, 3, 16\)",
        ),
        "freqs-dtype": (OPS.rope, (x, f.half()), TypeError, "rope: freqs has dtype torch.float16; expected float32"),
        "freqs-shape": (
            OPS.rope,
            (x, f.reshape(4, 1, 16)),
            ValueError,
            r"rope: freqs must have shape \[positions, 1, 1, d2\]",
        ),
        "freqs-broadcast-dims": (OPS.rope, (x, f.expand(4, 2, 1, 16)), ValueError, "freqs must have shape"),
        "freqs-too-wide": (OPS.rope, (x, freqs_of(4, 18, device)), ValueError, "rope: freqs has d2 = 18 channels"),
        "freqs-odd": (
            OPS.rope,
            (x, freqs_of(4, 7, device)),
            ValueError,
            r"freqs has an odd number of channels \(d2 = 7\)",
        ),
        "freqs-positions": (
            OPS.rope,
            (x, freqs_of(5, 16, device)),
            ValueError,
            "freqs has 5 positions but the input's sequence length is 4",
        ),
        "freqs-device": (OPS.rope, (x, f.to("meta")), ValueError, "rope: freqs is on meta"),
        "cos-dtype": (
            OPS.rope_cached,
            (x, f.half(), f.half()),
            TypeError,
            "rope_cached: cos has dtype torch.float16; expected float32 or bfloat16",
        ),
        "cos-dtype-fp32-input": (
            OPS.rope_cached,
            (x.float(), f.bfloat16(), f.bfloat16()),
            TypeError,
            "cos has dtype torch.bfloat16; expected float32$",
        ),
        "sin-dtype": (
            OPS.rope_cached,
            (x, f, f.bfloat16()),
            TypeError,
            "rope_cached: sin has dtype torch.bfloat16 but cos has dtype torch.float32",
        ),
        "sin-shape": (
            OPS.rope_cached,
            (x, f, f[:, :, :, :8]),
            ValueError,
            r"rope_cached: sin has shape \(4, 1, 1, 8\) but cos has shape",
        ),
        "thd-input-dims": (OPS.rope_thd, (x, cu, f), ValueError, r"rope_thd: input must be 3-D \[t, h, d\]"),
        "cu_seqlens-dtype": (
            OPS.rope_thd,
            (x[0], cu.long(), f),
            TypeError,
            "rope_thd: cu_seqlens has dtype torch.int64; expected int32",
        ),
        "cu_seqlens-shape": (OPS.rope_thd, (x[0], cu[:0], f), ValueError, "rope_thd: cu_seqlens must be 1-D with b"),
        "cu_seqlens-device": (OPS.rope_thd, (x[0], cu.to("meta"), f), ValueError, "rope_thd: cu_seqlens is on meta"),
        "2d-head-dim": (
            OPS.rope_2d,
            (x5[..., :6], ch, sh, cw, sw),
            ValueError,
            "rope_2d: input's head dim d = 6 must be a multiple of 4",
        ),
        "2d-table-shape": (
            OPS.rope_2d,
            (x5, ch[..., :4], sh, cw, sw),
            ValueError,
            r"rope_2d: cos_h must have shape \[1, positions, 1, d/2 = 8\]",
        ),
        "2d-table-short": (
            OPS.rope_2d,
            (x5, ch, sh, cw[:, :3], sw[:, :3]),
            ValueError,
            "rope_2d: cos_w has 3 positions but the image needs 4",
        ),
        "2d-table-dtype": (
            OPS.rope_2d,
            (x5, ch, sh, cw.bfloat16(), sw),
            TypeError,
            "rope_2d: cos_w has dtype torch.bfloat16 but cos_h has dtype torch.float32",
        ),
    }


BAD = list(bad_cases("cpu"))


@pytest.mark.parametrize("case", BAD)
def test_bad_input(device, case):
    op, args, error, message = bad_cases(device)[case]
    with pytest.raises(error, match=message):
        op(*args)


def test_2d_sequence_length_checked():
    x = torch.randn(2, 12, 2, 16)
    ch, sh = tables_2d(3, 8, "cpu")
    with pytest.raises(ValueError, match=r"t must be \[b, img_h \* img_w = 15, h, d\]"):
        F.fused_apply_rotary_pos_emb_2d(x, 3, 5, ch, sh, ch, sh)


# legacy module ---------------------------------------------------------------------------------

LEGACY = [
    "forward",
    "backward",
    "forward_cached",
    "backward_cached",
    "forward_thd",
    "backward_thd",
    "forward_2d",
    "backward_2d",
]


def test_legacy_module_in_fresh_interpreter():
    # freqs with equal halves: the backward (the transposed rotation) undoes the forward
    code = (
        "import sys, torch, fused_rotary_positional_embedding as m; "
        f"missing = [f for f in {LEGACY!r} if not callable(getattr(m, f, None))]; "
        "x = torch.randn(3, 2, 2, 8); f = torch.randn(3, 1, 1, 4).repeat(1, 1, 1, 2); "
        "y = m.forward(x, f, False); z = m.backward(y, f, False); "
        "ok = torch.allclose(z, x, atol=1e-5); print(missing, ok); sys.exit(0 if ok and not missing else 1)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_legacy_module_against_functional(device):
    import fused_rotary_positional_embedding as legacy

    s, b, h, d = 5, 2, 3, 32
    x = torch.randn(s, b, h, d, device=device, dtype=torch.float16)
    g = torch.randn_like(x)
    f = freqs_of(s, 16, device)

    def functional_grad(fn):
        leaf = x.detach().requires_grad_()
        (grad,) = torch.autograd.grad(fn(leaf), leaf, g)
        return grad

    for transpose in (False, True):
        out = legacy.forward(x, f, transpose)
        assert out.stride() == F.fused_apply_rotary_pos_emb(x, f, transpose).stride()
        torch.testing.assert_close(out, F.fused_apply_rotary_pos_emb(x, f, transpose), rtol=0, atol=0)
        torch.testing.assert_close(
            legacy.backward(g, f, transpose),
            functional_grad(lambda t, tr=transpose: F.fused_apply_rotary_pos_emb(t, f, tr)),
        )
        cos, sin = f.cos().half(), f.sin().half()
        torch.testing.assert_close(
            legacy.forward_cached(x, cos, sin, transpose), F.fused_apply_rotary_pos_emb_cached(x, cos, sin, transpose)
        )
        torch.testing.assert_close(
            legacy.backward_cached(g, cos, sin, transpose),
            functional_grad(lambda t, c=cos, si=sin, tr=transpose: F.fused_apply_rotary_pos_emb_cached(t, c, si, tr)),
        )
    packed, gp = x.reshape(s * b, h, d), g.reshape(s * b, h, d)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32, device=device)
    f7 = freqs_of(7, 16, device)
    torch.testing.assert_close(legacy.forward_thd(packed, cu, f7), F.fused_apply_rotary_pos_emb_thd(packed, cu, f7))
    leaf = packed.detach().requires_grad_()
    (expected,) = torch.autograd.grad(F.fused_apply_rotary_pos_emb_thd(leaf, cu, f7), leaf, gp)
    torch.testing.assert_close(legacy.backward_thd(gp, cu, f7), expected)
    image = torch.randn(2, 15, h, d, device=device, dtype=torch.float16)
    gi = torch.randn_like(image)
    ch, sh = tables_2d(3, d // 2, device)
    cw, sw = tables_2d(5, d // 2, device)
    out = legacy.forward_2d(image.reshape(2, 3, 5, h, d), ch, sh, cw, sw)
    assert out.shape == (2, 15, h, d)
    torch.testing.assert_close(out, F.fused_apply_rotary_pos_emb_2d(image, 3, 5, ch, sh, cw, sw))
    leaf = image.detach().requires_grad_()
    (expected,) = torch.autograd.grad(F.fused_apply_rotary_pos_emb_2d(leaf, 3, 5, ch, sh, cw, sw), leaf, gi)
    torch.testing.assert_close(legacy.backward_2d(gi.reshape(2, 3, 5, h, d), ch, sh, cw, sw), expected)


# devices, determinism, size ---------------------------------------------------------------------


@pytest.mark.multigpu
def test_second_device():
    """Tensors on cuda:1 while cuda:0 is current: the kernel runs there and writes the right values."""
    torch.cuda.set_device(0)
    x = torch.randn(7, 3, 4, 64, dtype=torch.bfloat16)
    f = freqs_of(7, 32, "cpu")
    cu = torch.tensor([0, 9, 21], dtype=torch.int32)
    out = F.fused_apply_rotary_pos_emb(x.to("cuda:1"), f.to("cuda:1"), True)
    assert out.device == torch.device("cuda:1")
    torch.testing.assert_close(out.cpu(), F.fused_apply_rotary_pos_emb(x, f, True))
    packed = x.reshape(21, 4, 64)
    out = F.fused_apply_rotary_pos_emb_thd(packed.to("cuda:1"), cu.to("cuda:1"), f.to("cuda:1"))
    torch.testing.assert_close(out.cpu(), F.fused_apply_rotary_pos_emb_thd(packed, cu, f))


def test_deterministic(device):
    x = torch.randn(33, 4, 8, 128, device=device, dtype=torch.bfloat16)
    f = freqs_of(33, 64, device)
    first = F.fused_apply_rotary_pos_emb(x, f)
    assert torch.equal(first, F.fused_apply_rotary_pos_emb(x, f))


@pytest.mark.gpu
def test_past_2_to_the_31_elements():
    """Offsets past 2^31 elements (64-bit indexing): the last positions are right."""
    s, b, h, d = 65537, 1, 256, 128  # 2^31 + 2^15 elements
    need = 3 * 2**32  # x and the output in bf16 (4 GiB each), and headroom
    if torch.cuda.mem_get_info()[0] < need:  # (under pytest-xdist other workers may hold the memory)
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory")
    x = torch.empty(s, b, h, d, device="cuda", dtype=torch.bfloat16).normal_()
    f = freqs_of(s, 64, "cuda")
    out = F.fused_apply_rotary_pos_emb(x, f)
    for part in (slice(0, 2), slice(s - 2, s)):
        torch.testing.assert_close(out[part], F.fused_apply_rotary_pos_emb(x[part], f[part]), rtol=0, atol=0)
    del out
    out = F.fused_apply_rotary_pos_emb(x, f, True)  # transposed output: offsets past 2^31 too
    torch.testing.assert_close(out[-2:], F.fused_apply_rotary_pos_emb(x[-2:], f[-2:]), rtol=0, atol=0)
