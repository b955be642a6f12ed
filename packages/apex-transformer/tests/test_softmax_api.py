"""The fused softmax's API: FusedScaleMaskSoftmax's fused-vs-PyTorch rule, the legacy modules,
opcheck, torch.compile, bad input (the same error from the reference and the kernel) and a
device other than cuda:0."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from apex.transformer import _softmax_ops
from apex.transformer.enums import AttnMaskType
from apex.transformer.functional import fused_softmax as F

OPS = torch.ops.apex_transformer


@pytest.fixture(autouse=True)
def _op_off_cuda(monkeypatch):
    """Off CUDA the functions take torch's softmax by default; these tests run the op's reference there
    (test_softmax_numerics.test_off_cuda_the_functions_are_torchs checks the default)."""
    monkeypatch.setattr(F, "_TORCH_OFF_CUDA", False)


def masked_fill(scores, mask):
    return scores.masked_fill(mask, -10000.0)


def causal_mask(sq, sk, device):
    return torch.ones(1, 1, sq, sk, dtype=torch.bool, device=device).triu(1)


def module(dtype, mask_type, fusion, scale=0.5, generic=False):
    fp16, bf16 = dtype == torch.float16, dtype == torch.bfloat16
    if generic:
        return F.GenericFusedScaleMaskSoftmax(fp16, bf16, fusion, masked_fill, True, scale)
    return F.FusedScaleMaskSoftmax(fp16, bf16, mask_type, fusion, masked_fill, True, scale)


# FusedScaleMaskSoftmax ---------------------------------------------------------------------------


def test_constructor_checks():
    with pytest.raises(RuntimeError, match="both fp16 and bf16"):
        F.FusedScaleMaskSoftmax(True, True, AttnMaskType.causal, True, masked_fill, True, None)
    with pytest.raises(RuntimeError, match="softmax should be in fp32 when scaled"):
        F.FusedScaleMaskSoftmax(True, False, AttnMaskType.causal, True, masked_fill, False, 0.5)
    with pytest.raises(ValueError, match="Invalid attn_mask_type"):
        F.FusedScaleMaskSoftmax(True, False, None, True, masked_fill, True, None)
    F.FusedScaleMaskSoftmax(True, False, None, False, masked_fill, True, None)  # no fusion: no mask type needed


@pytest.mark.parametrize(
    "shape, mask_type, expected",
    [
        ((2, 4, 32, 32), AttnMaskType.causal, True),
        ((2, 2, 32, 32), AttnMaskType.padding, True),
        ((2, 2, 32, 32), AttnMaskType.causal, False),  # b * np % batch_per_block (8 for sk = 32)
        ((2, 2, 32, 16), AttnMaskType.padding, False),  # sk must exceed 16
        ((2, 2, 32, 20), AttnMaskType.padding, True),
        ((2, 2, 32, 18), AttnMaskType.padding, False),  # sk % 4
        ((2, 2, 30, 32), AttnMaskType.padding, False),  # sq % 4
        ((1, 3, 32, 32), AttnMaskType.causal, False),  # b * np % 4
        ((1, 4, 4, 32), AttnMaskType.padding, False),  # sq % batch_per_block
        ((2, 4, 8, 32), AttnMaskType.causal, True),
        ((1, 4, 8, 16384), AttnMaskType.padding, True),
        ((1, 4, 8, 16388), AttnMaskType.padding, False),  # sk beyond 16384
    ],
)
def test_kernel_rule(shape, mask_type, expected):
    m = module(torch.float16, mask_type, True)
    assert m.is_kernel_available(None, *shape) is expected
    assert module(torch.float16, mask_type, False).is_kernel_available(None, *shape) is False
    fp32 = F.FusedScaleMaskSoftmax(False, False, mask_type, True, masked_fill, True, None)
    assert fp32.is_kernel_available(None, *shape) is False


def test_batch_per_block_is_upstreams():
    # rows per 128-thread block: min(next_pow2(sk), 32) threads a row, 2 rows a warp up to 128
    expected = {0: 256, 1: 256, 2: 128, 3: 64, 16: 16, 17: 8, 32: 8, 128: 8, 129: 4, 1024: 4, 16384: 4}
    for sk, bpb in expected.items():
        assert F.get_batch_per_block(7, sk, 3, 5) == bpb
        assert F.FusedScaleMaskSoftmax.get_batch_per_block(7, sk, 3, 5) == bpb


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.padding], ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 32, 32), (1, 4, 16, 200), (1, 3, 5, 17)])
def test_fused_and_torch_paths_agree(device, dtype, mask_type, shape):
    b, np_, sq, sk = shape
    if mask_type == AttnMaskType.causal and sq != sk:
        sq = sk
    x = torch.randn(b, np_, sq, sk, device=device).mul_(4).to(dtype)
    if mask_type == AttnMaskType.causal:
        mask = causal_mask(sq, sk, device)
    else:
        mask = torch.rand(b, 1, sq, sk, device=device) < 0.3
        mask[0, 0, 0] = True  # the torch path gives 1/sk here, the fused one 0 (upstream's kernels)
    fused, plain = module(dtype, mask_type, True), module(dtype, mask_type, False)
    y_fused, y_torch = fused(x, mask), plain(x, mask)
    eligible = fused.is_kernel_available(mask, b, np_, sq, sk)
    assert eligible == (shape != (1, 3, 5, 17))
    if mask_type == AttnMaskType.padding and eligible:
        assert torch.all(y_fused[0, :, 0] == 0)
        y_fused, y_torch = y_fused[:, :, 1:], y_torch[:, :, 1:]
    tol = 1.6e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(y_fused.float(), y_torch.float(), rtol=tol, atol=1e-4)
    # the generic module fuses every padding shape
    generic = module(dtype, None, True, generic=True)
    assert generic.is_kernel_available(mask, b, np_, sq, sk)
    if mask_type == AttnMaskType.padding:
        assert torch.equal(generic(x, mask), F.scaled_masked_softmax(x, mask, 0.5))


def test_functions(device):
    x = torch.randn(2, 3, 5, 5, device=device, dtype=torch.bfloat16)
    mask = torch.rand(2, 1, 5, 5, device=device) < 0.3
    assert torch.equal(F.scaled_masked_softmax(x, None, 0.5), F.scaled_softmax(x, 0.5))
    assert torch.equal(F.generic_scaled_masked_softmax(x, mask, 0.5), F.scaled_masked_softmax(x, mask, 0.5))
    causal = F.scaled_upper_triang_masked_softmax(x, "ignored", 0.5)
    assert torch.equal(causal, OPS.scaled_softmax_forward(x, None, 0.5, True))
    with pytest.raises(ValueError, match="self attention"):
        F.scaled_upper_triang_masked_softmax(x[..., :4], None, 0.5)
    # non-contiguous input is copied, autocast casts
    xt = x.transpose(2, 3)
    assert torch.equal(F.scaled_softmax(xt, 0.5), F.scaled_softmax(xt.contiguous(), 0.5))
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        assert F.scaled_softmax(x.float(), 0.5).dtype == torch.bfloat16


# upstream's autograd Functions ---------------------------------------------------------------------

FUNCTIONS = {  # Function: (its arguments besides inputs, as a function of mask, the functional API's result)
    "ScaledUpperTriangMaskedSoftmax": (
        lambda mask: (),
        lambda x, mask: F.scaled_upper_triang_masked_softmax(x, None, 0.25),
    ),
    "ScaledMaskedSoftmax": (lambda mask: (mask,), lambda x, mask: F.scaled_masked_softmax(x, mask, 0.25)),
    "GenericScaledMaskedSoftmax": (
        lambda mask: (mask,),
        lambda x, mask: F.generic_scaled_masked_softmax(x, mask, 0.25),
    ),
    "ScaledSoftmax": (lambda mask: (), lambda x, mask: F.scaled_softmax(x, 0.25)),
}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_autograd_functions_as_upstream_applied_them(device, name, dtype):
    # forward(ctx, inputs, [mask,] scale) with upstream's layouts (the causal one 3-D), scale a number or a
    # one-element tensor (Megatron-Core's torch.tensor([scale])[0]); values and gradients those of the
    # functional API, and the incoming gradient left as it was.
    extra, functional = FUNCTIONS[name]
    function = getattr(F, name)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 9, device=device, dtype=dtype, requires_grad=True)
    mask = torch.rand(2, 1, 9, 9, device=device) < 0.3
    mask[0, 0, 4] = True  # a fully masked row
    inputs = x.view(6, 9, 9) if name == "ScaledUpperTriangMaskedSoftmax" else x
    for scale in (0.25, torch.tensor([0.25])[0]):
        y = function.apply(inputs, *extra(mask), scale).view(2, 3, 9, 9)
        expected = functional(x, mask)
        assert torch.equal(y, expected)
        dy = torch.randn_like(y)
        before = dy.clone()
        (grad,) = torch.autograd.grad(y, x, dy)
        (expected_grad,) = torch.autograd.grad(expected, x, dy)
        assert torch.equal(grad, expected_grad)
        assert torch.equal(dy, before)
    with pytest.raises(ValueError, match=f"{name}: inputs must be a {3 if 'Triang' in name else 4}-D tensor"):
        function.apply(
            x.view(-1, 9) if name == "ScaledUpperTriangMaskedSoftmax" else x.view(6, 9, 9), *extra(mask), 0.25
        )
    with pytest.raises(TypeError, match=f"{name}: scale must be a number"):
        function.apply(inputs, *extra(mask), "0.25")


# legacy modules ----------------------------------------------------------------------------------

LEGACY = {  # module: (setup making x, y (the module's forward) and ref, the functional API as a function of x)
    "scaled_upper_triang_masked_softmax_cuda": (
        """
        x = torch.randn(6, 9, 9, device=dev, dtype=torch.float16)
        y = m.forward(x, scale)
        """,
        "F.scaled_upper_triang_masked_softmax(t.view(2, 3, 9, 9), None, 0.25).view(6, 9, 9)",
    ),
    "scaled_masked_softmax_cuda": (
        """
        x = torch.randn(2, 3, 5, 40, device=dev, dtype=torch.bfloat16)
        mask = torch.rand(2, 1, 5, 40, device=dev) < 0.5
        mask[1, 0, 2] = True
        y = m.forward(x, mask.to(torch.uint8), scale)
        assert m.get_batch_per_block(5, 40, 2, 3) == F.get_batch_per_block(5, 40, 2, 3) == 8
        """,
        "F.scaled_masked_softmax(t, mask, 0.25)",
    ),
    "scaled_softmax_cuda": (
        """
        x = torch.randn(2, 3, 5, 40, device=dev, dtype=torch.bfloat16)
        y = m.forward(x, scale)
        """,
        "F.scaled_softmax(t, 0.25)",
    ),
    "generic_scaled_masked_softmax_cuda": (
        """
        x = torch.randn(1, 3, 5, 20001, device=dev, dtype=torch.float16)
        mask = torch.rand(1, 1, 5, 20001, device=dev) < 0.5
        y = m.forward(x, mask, scale)
        """,
        "F.generic_scaled_masked_softmax(t, mask, 0.25)",
    ),
}


@pytest.mark.parametrize("name", sorted(LEGACY))
def test_legacy_module_fresh_interpreter(device, name):
    """Imported alone, as Megatron does; forward and the in-place backward against the functional API."""
    setup, function = LEGACY[name]
    script = f"""
import importlib, torch
m = importlib.import_module({name!r})
from apex.transformer.functional import fused_softmax as F
F._TORCH_OFF_CUDA = False  # the functions' op path, which the legacy modules call
dev = {device!r}
torch.manual_seed(0)
for scale in (0.25, torch.tensor([0.25])[0]):  # Megatron-Core passes a 0-d CPU tensor
{textwrap.indent(textwrap.dedent(setup), "    ")}
    xg = x.clone().requires_grad_()
    ref = (lambda t: {function})(xg)
    assert torch.equal(y, ref), (y - ref).abs().max()
    dy = torch.randn_like(y)
    (grad,) = torch.autograd.grad(ref, xg, dy)
    buf = dy.clone()
    out = m.backward(buf, y, scale)
    assert out is buf, "backward writes into output_grads and returns it"
    assert torch.equal(out, grad), (out - grad).abs().max()
    strided = dy.transpose(-1, -2).contiguous().transpose(-1, -2)  # not contiguous: a contiguous copy
    assert torch.equal(m.backward(strided, y, scale), grad)
    assert torch.equal(strided, dy)
print("OK")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stdout + result.stderr


def test_legacy_argument_errors():
    import scaled_masked_softmax_cuda as masked
    import scaled_upper_triang_masked_softmax_cuda as causal

    x = torch.randn(2, 3, 4, 4, dtype=torch.float16)
    with pytest.raises(ValueError, match="scaled_upper_triang_masked_softmax_cuda: input must be a 3-D"):
        causal.forward(x, 1.0)
    with pytest.raises(ValueError, match="scaled_masked_softmax_cuda: mask must be a 4-D"):
        masked.forward(x, torch.zeros(4, 4, dtype=torch.bool), 1.0)
    with pytest.raises(ValueError, match="scale must be a number or a one-element tensor"):
        masked.forward(x, torch.zeros(1, 1, 4, 4, dtype=torch.bool), torch.ones(2))
    with pytest.raises(TypeError, match="scale must be a number"):
        causal.forward(x[0], "1.0")


# opcheck and compile ------------------------------------------------------------------------------


def _op_cases(device):
    x = torch.randn(2, 3, 6, 6, device=device, dtype=torch.bfloat16)
    mask = torch.rand(2, 1, 6, 6, device=device) < 0.3
    y = OPS.scaled_softmax_forward(x, None, 0.5, True)
    dy = torch.randn_like(y)
    return [
        (OPS.scaled_softmax_forward.default, (x, None, 0.5, False)),
        (OPS.scaled_softmax_forward.default, (x, None, 0.5, True)),
        (OPS.scaled_softmax_forward.default, (x, mask, 0.5, False)),
        (OPS.scaled_softmax_backward.default, (dy, y, 0.5, True)),
        (OPS.scaled_softmax_backward.default, (dy, y, 0.5, False)),
        (OPS.scaled_softmax_backward_.default, (dy.clone(), y, 0.5, True)),
    ]


def test_opcheck(device):
    for op, args in _op_cases(device):
        torch.library.opcheck(op, args)


def _train_step(x, mask):
    a = F.scaled_masked_softmax(x, mask, 0.5)
    b = F.scaled_upper_triang_masked_softmax(x, None, 0.5)
    c = F.scaled_softmax(x, 0.5)
    return (a.float() * 2 + b.float() + c.float()).sum()


def _check_compiled(device, backend):
    x = torch.randn(2, 3, 8, 8, device=device, dtype=torch.bfloat16)
    mask = torch.rand(2, 1, 8, 8, device=device) < 0.3
    eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    _train_step(eager_x, mask).backward()
    compiled = torch.compile(_train_step, fullgraph=True, backend=backend)
    compiled(compiled_x, mask).backward()
    torch.testing.assert_close(compiled_x.grad, eager_x.grad)


def test_compile_traces_cpu():
    _check_compiled("cpu", "aot_eager")


@pytest.mark.gpu
def test_compile_fullgraph_cuda():
    _check_compiled("cuda", "inductor")


@pytest.mark.parametrize("causal", [False, True])
def test_forward_of_a_strided_input_equals_its_contiguous_copy(device, causal):
    wide = torch.randn(2, 3, 9, 16, device=device, dtype=torch.bfloat16)
    x = wide[..., :9]  # rows at a stride of 16, as a padded matmul's view
    assert not x.is_contiguous()
    y = OPS.scaled_softmax_forward(x, None, 0.5, causal)
    assert y.is_contiguous()
    assert torch.equal(y, OPS.scaled_softmax_forward(x.contiguous(), None, 0.5, causal))


def _scores_softmax(q, k):
    return F.scaled_softmax(torch.bmm(q, k).view(2, 3, 17, 37), 0.5).float().sum()


@pytest.mark.gpu
def test_compile_after_a_padded_matmul():
    # Inductor pads a matmul whose sizes are not multiples of 8 (pad_mm) and hands its consumer a
    # view of the padded result, mm(a, pad(b))[:, :37]: the op must take what it is given.
    import torch._inductor.config as inductor_config

    q = torch.randn(6, 17, 40, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(6, 40, 37, device="cuda", dtype=torch.bfloat16)
    _scores_softmax(q, k).backward()
    expected = q.grad.clone()
    q.grad = None
    patch = {"force_shape_pad": True} if hasattr(inductor_config, "force_shape_pad") else {}
    with inductor_config.patch(patch):
        compiled = torch.compile(_scores_softmax, fullgraph=True, backend="inductor")
        compiled(q, k).backward()
    torch.testing.assert_close(q.grad, expected)


# bad input: one error, naming the argument, from the reference and the kernel ------------------


def _bad_cases(device):
    x = torch.randn(2, 3, 4, 4, device=device, dtype=torch.float16)
    mask = torch.zeros(2, 1, 4, 4, device=device, dtype=torch.bool)
    fwd, bwd, bwd_ = OPS.scaled_softmax_forward, OPS.scaled_softmax_backward, OPS.scaled_softmax_backward_
    return [
        (TypeError, "input has dtype torch.float64", fwd, (x.double(), None, 1.0, False)),
        (TypeError, "input has dtype torch.int32", fwd, (x.int(), None, 1.0, False)),
        (ValueError, "input must have at least 2 dimensions", fwd, (x[0, 0, 0], None, 1.0, False)),
        (ValueError, "causal masking needs a square input", fwd, (x[..., :3].contiguous(), None, 1.0, True)),
        (ValueError, "causal masking takes no mask", fwd, (x, mask, 1.0, True)),
        (TypeError, "mask has dtype torch.float16", fwd, (x, mask.half(), 1.0, False)),
        (ValueError, "input must be 4-D", fwd, (x[0], mask, 1.0, False)),
        (ValueError, r"mask has shape \(2, 3, 4, 4\)", fwd, (x, mask.expand(2, 3, 4, 4).contiguous(), 1.0, False)),
        (
            ValueError,
            r"mask has shape \(3, 1, 4, 4\)",
            fwd,
            (x, torch.zeros_like(mask[:1]).expand(3, 1, 4, 4).contiguous(), 1.0, False),
        ),
        (ValueError, "mask is not contiguous", fwd, (x, mask.transpose(2, 3), 1.0, False)),
        (
            TypeError,
            "grad_output has dtype torch.bfloat16 but output has torch.float16",
            bwd,
            (x.bfloat16(), x, 1.0, False),
        ),
        (ValueError, r"grad_output has shape \(2, 3, 4, 3\)", bwd, (x[..., :3].contiguous(), x, 1.0, False)),
        (ValueError, "grad_output is not contiguous", bwd_, (x.transpose(2, 3), x, 1.0, False)),
        (
            ValueError,
            "causal masking needs a square output",
            bwd,
            (x[..., :3].contiguous(), x[..., :3].contiguous(), 1.0, True),
        ),
    ]


def test_bad_input(device):
    for error, words, op, args in _bad_cases(device):
        with pytest.raises(error, match=words) as info:
            op(*args)
        assert str(info.value).startswith(f"{op.__name__}: "), str(info.value)


@pytest.mark.gpu
def test_same_errors_on_cpu_and_cuda():
    for cpu_case, cuda_case in zip(_bad_cases("cpu"), _bad_cases("cuda")):
        messages = []
        for error, words, op, args in (cpu_case, cuda_case):
            with pytest.raises(error, match=words) as info:
                op(*args)
            messages.append(str(info.value).splitlines()[0])
        assert messages[0] == messages[1]
    x = torch.randn(2, 3, 4, 4, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="mask is on cpu, expected cuda:0"):
        OPS.scaled_softmax_forward(x, torch.zeros(2, 1, 4, 4, dtype=torch.bool), 1.0, False)
    with pytest.raises(ValueError, match="grad_output is on cpu, expected cuda:0"):
        OPS.scaled_softmax_backward(x.cpu(), x, 1.0, False)


# devices -----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_kernels_loaded():
    from apex.core.benchmarking import require_kernels

    require_kernels("transformer")


@pytest.mark.gpu
@pytest.mark.multigpu
def test_second_device():
    x = torch.randn(3, 5, 7, 300, device="cuda:1", dtype=torch.bfloat16)
    mask = torch.rand(3, 1, 7, 300, device="cuda:1") < 0.3
    dy = torch.randn_like(x)
    for m, causal in ((mask, False), (None, False)):
        y = OPS.scaled_softmax_forward(x, m, 0.5, causal)
        assert y.device == x.device
        torch.testing.assert_close(
            y.cpu(), OPS.scaled_softmax_forward(x.cpu(), None if m is None else m.cpu(), 0.5, causal)
        )
        dx = OPS.scaled_softmax_backward(dy, y, 0.5, causal)
        torch.testing.assert_close(dx.cpu(), OPS.scaled_softmax_backward(dy.cpu(), y.cpu(), 0.5, causal))
    xc = torch.randn(2, 64, 64, device="cuda:1", dtype=torch.float16)
    torch.testing.assert_close(
        OPS.scaled_softmax_forward(xc, None, 0.5, True).cpu(), OPS.scaled_softmax_forward(xc.cpu(), None, 0.5, True)
    )
    torch.cuda.synchronize("cuda:1")


def test_module_ops_bound():
    assert _softmax_ops.scaled_softmax_forward is OPS.scaled_softmax_forward.default
