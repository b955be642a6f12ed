"""The apex_normalization ops themselves: opcheck, torch.compile, autocast, bad input, memory,
devices other than cuda:0, determinism and tensors past 2^31 elements."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from apex.normalization import FusedLayerNorm, FusedRMSNorm, _ops
from apex.normalization import functional as AF

OPS = torch.ops.apex_normalization


def leaf(t):
    return t.detach().requires_grad_()


# opcheck ---------------------------------------------------------------------------------------

FORWARD_CASES = {
    "layer-affine-fp32": dict(dtype=torch.float32, weight=True, bias=True, rms=False),
    "layer-plain-fp16-2d": dict(dtype=torch.float16, weight=False, bias=False, rms=False, ndim=2),
    "rms-fp32-weight-bf16-mixed-memory-efficient": dict(
        dtype=torch.bfloat16, weight=True, bias=False, rms=True, weight_dtype=torch.float32, mixed=True, me=True
    ),
}


def forward_args(device, dtype, weight, bias, rms, ndim=1, weight_dtype=None, mixed=False, me=False):
    """norm_forward's arguments, the tensors requiring grad (opcheck checks the registered autograd)."""
    x = leaf(torch.randn(4, 3, 40, device=device).to(dtype))
    shape = list(x.shape[3 - ndim :])
    w = leaf(torch.rand(shape, device=device).add(0.5).to(weight_dtype or dtype)) if weight else None
    b = leaf(torch.randn(shape, device=device).to(weight_dtype or dtype)) if bias else None
    return x, w, b, shape, 1e-5, rms, me, (w.dtype if mixed else None)


@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_opcheck_norm_forward(device, case):
    torch.library.opcheck(OPS.norm_forward.default, forward_args(device, **FORWARD_CASES[case]))


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_opcheck_add_norm_forward(device, rms):
    x, w, b, shape, eps, _, _, _ = forward_args(device, torch.bfloat16, True, not rms, rms)
    r = leaf(torch.randn_like(x))
    torch.library.opcheck(OPS.add_norm_forward.default, (x, r, w, b, shape, eps, rms, False, None))


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves-input", "memory-efficient"])
def test_opcheck_norm_backward(device, memory_efficient):
    x, w, b, shape, eps, rms, _, _ = forward_args(device, torch.float16, True, True, False)
    x, w, b = x.detach(), w.detach(), b.detach()
    out, mean, rstd = OPS.norm_forward(x, w, b, shape, eps, rms)
    saved = out if memory_efficient else x
    dy = torch.randn_like(out)
    extra = torch.randn_like(x)
    args = (dy, saved, w, b, mean, rstd, shape, False, memory_efficient, x.dtype, True, extra)
    torch.library.opcheck(OPS.norm_backward.default, args)


# autograd (registered on the forward ops) -------------------------------------------------------


def test_the_functions_record_one_node(device):
    """One autograd node per call, shared by the output and the residual sum: on CUDA the C++ one
    (csrc/norm_autograd.cpp, once the library is loaded); on the CPU that of the eager path past the
    dispatcher (the same formula as the ops' Python registration, which the ops themselves record),
    or PyTorch's own for float32 layer norm."""
    x = torch.randn(3, 64, device=device, requires_grad=True)
    w = torch.randn(64, device=device, requires_grad=True)
    AF.fused_layer_norm_affine(x, w, None, 64)  # on CUDA the first call loads the library
    out = AF.fused_layer_norm_affine(x, w, None, 64)
    out2, total = AF.fused_add_rms_norm_affine(x, torch.randn_like(x), w, 64)
    names = out.grad_fn.name(), out2.grad_fn.name()  # type(node).__name__ is "CppFunction" on torch 2.11
    if torch.device(device).type == "cuda":
        assert "CppNode" in names[0] and "NormForward" in names[0], names
        assert "CppNode" in names[1] and "AddNormForward" in names[1], names
    else:
        # float32 layer norm is PyTorch's own op on the CPU (_ops.aten_layer_norm)
        assert names == ("NativeLayerNormBackward0", "AddNormForwardBackward")
        op_out = OPS.norm_forward(x, w, None, [64], 1e-5, False)[0]
        op_out2, op_total = OPS.add_norm_forward(x, torch.randn_like(x), w, None, [64], 1e-5, True)[:2]
        assert (op_out.grad_fn.name(), op_out2.grad_fn.name()) == (
            "GeneratedBackwardFor_apex_normalization_norm_forward_defaultBackward",
            "GeneratedBackwardFor_apex_normalization_add_norm_forward_defaultBackward",
        )
        assert op_total.grad_fn is op_out2.grad_fn
    assert total.grad_fn is out2.grad_fn


def test_without_grad_nothing_is_recorded(device):
    x = torch.randn(3, 64, device=device, requires_grad=True)
    w = torch.randn(64, device=device, requires_grad=True)
    with torch.no_grad():
        out, total = AF.fused_add_layer_norm_affine(x, x, w, None, 64)
    assert out.grad_fn is None and total.grad_fn is None and not out.requires_grad
    plain = AF.fused_rms_norm_affine(x.detach(), w.detach(), 64)
    assert plain.grad_fn is None and not plain.requires_grad


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves-input", "memory-efficient"])
@pytest.mark.parametrize("wanted", ["input", "weight", "bias"])
def test_only_the_gradients_asked_for(device, wanted, memory_efficient):
    """Each gradient is the one computed with every input requiring grad; the others stay unset."""
    x0, w0, b0 = torch.randn(5, 32, device=device), torch.rand(32, device=device) + 0.5, torch.randn(32, device=device)
    dy = torch.randn(5, 32, device=device)
    everything = [leaf(t) for t in (x0, w0, b0)]
    expected = torch.autograd.grad(AF.fused_layer_norm_affine(*everything, 32, 1e-5, memory_efficient), everything, dy)
    index = ["input", "weight", "bias"].index(wanted)
    tensors = [x0, w0, b0]
    tensors[index] = leaf(tensors[index])
    AF.fused_layer_norm_affine(*tensors, 32, 1e-5, memory_efficient).backward(dy)
    torch.testing.assert_close(tensors[index].grad, expected[index])
    assert [t.grad is None for t in tensors] == [i != index for i in range(3)]


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves-sum", "memory-efficient"])
def test_gradient_through_the_residual_sum_alone(device, memory_efficient):
    """When only the returned sum is used, its gradient goes to input and residual as is."""
    x, r = leaf(torch.randn(4, 16, device=device)), leaf(torch.randn(4, 16, device=device))
    w = leaf(torch.rand(16, device=device) + 0.5)
    _, total = AF.fused_add_rms_norm_affine(x, r, w, 16, 1e-5, memory_efficient)
    ds = torch.randn_like(total)
    total.backward(ds)
    assert torch.equal(x.grad, ds) and torch.equal(r.grad, ds) and w.grad is None


# torch.compile ---------------------------------------------------------------------------------


class Block(torch.nn.Module):
    """A pre-norm residual block shape: linear, add + layer norm, RMS norm (memory efficient)."""

    def __init__(self, hidden):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)
        self.norm1 = FusedLayerNorm(hidden)
        self.norm2 = FusedRMSNorm(hidden, memory_efficient=True)

    def forward(self, x):
        h, residual = self.norm1(self.linear(x), x)
        return self.norm2(h) + residual


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    torch.manual_seed(3)
    model = Block(64).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.randn(8, 5, 64, device=device)
    # Inductor on the GPU; on the CPU, AOT autograd without code generation (fast, same tracing).
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(model, fullgraph=True, backend=backend)

    def run(fn):
        xi = leaf(x)
        out = fn(xi)
        out.backward(torch.ones_like(out))
        return out, xi.grad, [p.grad.clone() for p in model.parameters()]

    expected = run(model)
    model.zero_grad()
    got = run(compiled)
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])
    for g, e in zip(got[2], expected[2]):
        torch.testing.assert_close(g, e)


@pytest.mark.slow
def test_torch_compile_under_autocast(device):
    model = FusedLayerNorm(32).to(device)
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = torch.randn(6, 32, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = compiled(x)
        expected = model(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected)


# autocast --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mixed", [False, True], ids=["fused", "mixed"])
def test_autocast_casts_to_the_autocast_dtype(device, mixed):
    x = torch.randn(5, 48, device=device)
    w = torch.rand(48, device=device, requires_grad=True)
    b = torch.randn(48, device=device, requires_grad=True)
    fn = AF.mixed_dtype_fused_layer_norm_affine if mixed else AF.fused_layer_norm_affine
    with torch.autocast(device, dtype=torch.bfloat16):
        out = fn(x, w, b, 48)
    assert out.dtype == torch.bfloat16  # weights are cast too, as upstream: no float32 output
    expected = fn(x.bfloat16(), w.detach().bfloat16(), b.detach().bfloat16(), 48)
    torch.testing.assert_close(out, expected)
    out.float().sum().backward()
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32


def test_autocast_rms_norm_module(device):
    model = FusedRMSNorm(48).to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = model(torch.randn(5, 48, device=device))
    assert out.dtype == torch.bfloat16


def test_no_autocast_keeps_dtypes(device):
    x = torch.randn(5, 48, device=device, dtype=torch.bfloat16)
    w = torch.rand(48, device=device)
    assert AF.fused_rms_norm_affine(x, w, 48).dtype == torch.bfloat16
    assert AF.mixed_dtype_fused_rms_norm_affine(x, w, 48).dtype == torch.float32


# bad input -------------------------------------------------------------------------------------


def test_input_not_ending_with_normalized_shape(device):
    x = torch.randn(4, 5, device=device)
    with pytest.raises(ValueError, match=r"input of shape \(4, 5\) does not end with normalized_shape \(4,\)"):
        AF.fused_layer_norm(x, 4)
    with pytest.raises(ValueError, match=r"does not end with normalized_shape \(3, 5\)"):
        FusedRMSNorm((3, 5)).to(device)(x)
    with pytest.raises(ValueError, match=r"normalized_shape must have at least one dimension"):
        OPS.norm_forward(x, None, None, [], 1e-5, False)


def test_weight_of_another_dtype(device):
    x = torch.randn(4, 8, device=device, dtype=torch.bfloat16)
    w = torch.ones(8, device=device, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"weight has dtype torch.float16 but the input has torch.bfloat16; "):
        AF.fused_rms_norm_affine(x, w, 8)
    with pytest.raises(TypeError, match=r"but the input has torch.float32; weight must be float32"):
        AF.fused_layer_norm_affine(x.float(), w, None, 8)


def test_bias_checks(device):
    x = torch.randn(4, 8, device=device)
    w = torch.ones(8, device=device)
    with pytest.raises(TypeError, match=r"bias has dtype torch.float16 but weight has torch.float32"):
        AF.fused_layer_norm_affine(x, w, torch.zeros(8, device=device, dtype=torch.float16), 8)
    with pytest.raises(ValueError, match=r"bias has shape \(7,\), expected normalized_shape \(8,\)"):
        AF.fused_layer_norm_affine(x, w, torch.zeros(7, device=device), 8)
    with pytest.raises(ValueError, match=r"RMS norm takes no bias"):
        OPS.norm_forward(x, w, torch.zeros(8, device=device), [8], 1e-5, True)
    with pytest.raises(ValueError, match=r"bias given without weight"):
        OPS.norm_forward(x, None, torch.zeros(8, device=device), [8], 1e-5, False)


def test_weight_shape_and_input_dtype(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match=r"weight has shape \(2, 4\), expected normalized_shape \(8,\)"):
        AF.fused_rms_norm_affine(x, torch.ones(2, 4, device=device), 8)
    with pytest.raises(TypeError, match=r"input has dtype torch.int32; expected one of float32, float16, bfloat16"):
        AF.fused_layer_norm(x.to(torch.int32), 8)


def test_output_dtype_and_residual_checks(device):
    x = torch.randn(4, 8, device=device, dtype=torch.float16)
    w = torch.ones(8, device=device)
    with pytest.raises(TypeError, match=r"output_dtype torch.bfloat16 is neither the input's dtype"):
        OPS.norm_forward(x, w, None, [8], 1e-5, True, False, torch.bfloat16)
    with pytest.raises(TypeError, match=r"residual has dtype torch.float32 but input has torch.float16"):
        AF.fused_add_rms_norm(x, x.float(), 8)
    with pytest.raises(ValueError, match=r"residual has shape \(2, 8\) but input has \(4, 8\)"):
        AF.fused_add_rms_norm(x, x[:2].clone(), 8)


def test_non_contiguous(device):
    x = torch.randn(8, 6, device=device).t()
    with pytest.raises(ValueError, match=r"norm_forward: input is not contiguous"):
        OPS.norm_forward(x, None, None, [8], 1e-5, False)
    # The functions make a contiguous copy first, as upstream does.
    torch.testing.assert_close(AF.fused_layer_norm(x, 8, 1e-5), F.layer_norm(x, (8,), eps=1e-5))


def test_backward_op_checks(device):
    x = torch.randn(4, 8, device=device)
    _, mean, rstd = OPS.norm_forward(x, None, None, [8], 1e-5, False)
    ok = (torch.randn_like(x), x, None, None, mean, rstd, [8], False, False, torch.float32)
    OPS.norm_backward(*ok)
    with pytest.raises(ValueError, match=r"grad_output has shape \(2, 8\) but saved has \(4, 8\)"):
        OPS.norm_backward(torch.randn(2, 8, device=device), *ok[1:])
    with pytest.raises(ValueError, match=r"rstd has 3 elements, expected one per row \(4\)"):
        OPS.norm_backward(*ok[:5], rstd[:3].clone(), *ok[6:])
    with pytest.raises(TypeError, match=r"saved has dtype torch.float16; expected torch.float32"):
        OPS.norm_backward(ok[0], x.half(), *ok[2:])
    with pytest.raises(TypeError, match=r"grad_output has dtype torch.float16; expected the output's dtype"):
        OPS.norm_backward(ok[0].half(), *ok[1:])


@pytest.mark.gpu
def test_tensors_on_another_device_are_named():
    x = torch.randn(4, 8, device="cuda")
    with pytest.raises(ValueError, match=r"weight is on cpu, expected cuda:0"):
        AF.fused_rms_norm_affine(x, torch.ones(8), 8)


# memory_efficient ------------------------------------------------------------------------------


def saved_bytes(fn, *args) -> int:
    """Bytes of the distinct storages autograd keeps for backward while fn(*args) runs."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(storages.values())


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_memory_efficient_keeps_the_output_instead_of_the_input(device, rms, dtype):
    """Pre-norm use: the norm's output feeds a linear layer, which saves it anyway. Keeping the output
    instead of the input frees rows * hidden input elements and (layer norm) rows float32 means."""
    rows, hidden = 48, 256
    x0 = torch.randn(rows, hidden, device=device, dtype=dtype)
    linear = torch.nn.Linear(hidden, 16, device=device, dtype=dtype)

    def block(memory_efficient):
        norm = (FusedRMSNorm if rms else FusedLayerNorm)(hidden, memory_efficient=memory_efficient)
        norm = norm.to(device=device, dtype=dtype)
        return lambda x: linear(norm(x * 2.0))  # x * 2.0: an activation nothing else keeps

    plain = saved_bytes(block(False), leaf(x0))
    efficient = saved_bytes(block(True), leaf(x0))
    expected_saving = rows * hidden * x0.element_size() + (0 if rms else 4 * rows)
    assert plain - efficient == expected_saving


@pytest.mark.gpu
def test_memory_efficient_frees_device_memory():
    rows, hidden = 4096, 1024
    x0 = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    linear = torch.nn.Linear(hidden, hidden, device="cuda", dtype=torch.bfloat16)

    def held_after_forward(memory_efficient):
        norm = FusedLayerNorm(hidden, memory_efficient=memory_efficient).to("cuda", torch.bfloat16)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = linear(norm(x0 * 2.0))
        held = torch.cuda.memory_allocated() - before
        out.float().sum().backward()
        return held

    held_after_forward(False)  # warm-up
    saving = held_after_forward(False) - held_after_forward(True)
    assert saving >= rows * hidden * 2, saving


# devices, determinism, size --------------------------------------------------------------------


@pytest.mark.gpu
def test_kernels_are_loaded():
    from apex.core import loader
    from apex.normalization._plugin import KERNELS

    AF.fused_layer_norm(torch.randn(2, 8, device="cuda"), 8)
    assert loader.load(KERNELS).has_kernels, loader.load(KERNELS).reason


def poison_cuda_cache(*tensors: torch.Tensor) -> None:
    """Leave NaN-filled blocks of these tensors' sizes (and larger) in the caching allocator, so that
    the op's outputs are likely carved from them: an element the kernels do not write stays NaN."""
    sizes = {t.numel() * t.element_size() for t in tensors}
    sizes |= {4 * s for s in sizes} | {64 << 20}
    blocks = [torch.full((s // 4 + 1,), float("nan"), device="cuda") for s in sorted(sizes)]
    del blocks


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [8, 96, 1024, 4096, 16384, 20000, 1023], ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_every_output_element_is_written(hidden, rms):
    rows = 777
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.rand(hidden, device="cuda") + 0.5
    b = None if rms else torch.randn(hidden, device="cuda")
    poison_cuda_cache(x, x, x.float(), w)
    out, total, mean, rstd = OPS.add_norm_forward(x, r, w, b, [hidden], 1e-5, rms, False, torch.float32)
    for t in (out, total, rstd) + (() if rms else (mean,)):
        assert torch.isfinite(t).all()
    for memory_efficient in (False, True):
        saved = out if memory_efficient else total
        poison_cuda_cache(x, w, x.float())
        grads = OPS.norm_backward(
            torch.randn_like(out), saved, w, b, mean, rstd, [hidden], rms, memory_efficient, x.dtype, True, x
        )
        for t in grads:
            assert torch.isfinite(t).all()


@pytest.mark.multigpu
@pytest.mark.parametrize(
    ("rows", "hidden", "dtype"),
    [(37, 1024, torch.float32), (37, 1023, torch.float32), (600, 8192, torch.float32), (64, 1024, torch.bfloat16)],
    ids=["registers", "streaming", "long-rows", "small-rows"],
)
def test_second_gpu(rows, hidden, dtype):
    """Tensors on cuda:1 while cuda:0 is current: results on cuda:1, equal to the CPU reference.

    long-rows takes the forward that prefetches and holds the weights, and the backward for long
    rows that sums the weight gradients in a cooperative launch; small-rows takes the small-row
    forward, which stages the weight and bias in shared memory (its smem attribute is per device)."""
    assert torch.cuda.current_device() == 0
    x_cpu = torch.randn(rows, hidden).to(dtype)
    w_cpu = (torch.rand(hidden) + 0.5).to(dtype)
    b_cpu = torch.randn(hidden).to(dtype)
    dy_cpu = torch.randn(rows, hidden).to(dtype)
    results = {}
    for device in ("cpu", "cuda:1"):
        x, w, b = (leaf(t.to(device)) for t in (x_cpu, w_cpu, b_cpu))
        out = AF.fused_layer_norm_affine(x, w, b, hidden)
        out.backward(dy_cpu.to(device))
        assert out.device == torch.device(device) and x.grad.device == torch.device(device)
        results[device] = [t.cpu() for t in (out, x.grad, w.grad, b.grad)]
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for got, expected in zip(results["cuda:1"], results["cpu"]):
        torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)
    assert torch.cuda.current_device() == 0


@pytest.mark.gpu
@pytest.mark.parametrize(
    "hidden", [384, 4096, 8192, 1023], ids=["warp-groups", "block-groups", "long-rows", "streaming"]
)
def test_weight_gradients_are_deterministic(hidden):
    x = leaf(torch.randn(8192, hidden, device="cuda", dtype=torch.bfloat16))
    w = leaf(torch.rand(hidden, device="cuda") + 0.5)
    b = leaf(torch.randn(hidden, device="cuda"))
    dy = torch.randn(8192, hidden, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(3):
        out = AF.fused_layer_norm_affine(x, w, b, hidden)
        runs.append(torch.autograd.grad(out, (x, w, b), dy))
    for run in runs[1:]:
        for a, e in zip(run, runs[0]):
            assert torch.equal(a, e)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("hidden", [4096, 4095], ids=["registers", "streaming"])
def test_more_than_2_pow_31_elements(hidden):
    rows = (1 << 31) // hidden + 3
    x = leaf(torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16))
    w = leaf(torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5)
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    out = AF.fused_rms_norm_affine(x, w, hidden)
    dx, dw = torch.autograd.grad(out, (x, w), dy)
    # Rows past element 2^31 against float64.
    for sl in (slice(0, 2), slice(rows - 2, rows)):
        xs = x.detach()[sl].double()
        rstd = torch.rsqrt(xs.square().mean(-1, keepdim=True) + 1e-6)
        expected = xs * rstd * w.detach().double()
        torch.testing.assert_close(out[sl].double(), expected, rtol=1.6e-2, atol=1.6e-2)
        xs = leaf(xs)
        ref = xs * torch.rsqrt(xs.square().mean(-1, keepdim=True) + 1e-6) * w.detach().double()
        (gx,) = torch.autograd.grad(ref, xs, dy[sl].double())
        torch.testing.assert_close(dx[sl].double(), gx, rtol=1.6e-2, atol=1.6e-2 * gx.abs().max().item())
    # The weight gradient over all rows, in float32 chunks.
    expected_dw = torch.zeros(hidden, device="cuda", dtype=torch.float64)
    for start in range(0, rows, 65536):
        xs = x.detach()[start : start + 65536].float()
        xhat = xs * torch.rsqrt(xs.square().mean(-1, keepdim=True) + 1e-6)
        expected_dw += (dy[start : start + 65536].float() * xhat).sum(0).double()
    torch.testing.assert_close(dw.double(), expected_dw, rtol=1.6e-2, atol=1.6e-2 * expected_dw.abs().max().item())


def test_ops_module_defines_three_ops():
    for name in ("norm_forward", "add_norm_forward", "norm_backward"):
        assert getattr(_ops, name).name() == f"apex_normalization::{name}"


# the eager CPU path (past the dispatcher) ------------------------------------------------------

EAGER_CASES = {
    "layer-affine-bf16": dict(rms=False, weight=True, bias=True, dtype=torch.bfloat16),
    "layer-plain-fp32-2d": dict(rms=False, weight=False, bias=False, dtype=torch.float32, ndim=2),
    "rms-weight-fp16-mixed": dict(rms=True, weight=True, bias=False, dtype=torch.float16, mixed=True),
    "layer-affine-fp32-memory-efficient": dict(rms=False, weight=True, bias=True, dtype=torch.float32, me=True),
}


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("case", list(EAGER_CASES))
def test_the_eager_cpu_path_equals_the_ops(case, residual):
    """functional.py's CPU calls skip the dispatcher (apex.core.library.direct); outputs and every
    gradient are those of the ops, to the bit."""
    c = EAGER_CASES[case]
    torch.manual_seed(0)
    x = torch.randn(5, 3, 32).to(c["dtype"])
    shape = list(x.shape[3 - c.get("ndim", 1) :])
    wdt = torch.float32 if c.get("mixed") else c["dtype"]
    w = torch.rand(shape).add(0.5).to(wdt) if c["weight"] else None
    b = torch.randn(shape).to(wdt) if c["bias"] else None
    r = torch.randn_like(x) if residual else None
    me, out_dtype = c.get("me", False), (wdt if c.get("mixed") else None)

    def run(eager):
        leaves = [leaf(t) if t is not None else None for t in (x, r, w, b)]
        xi, ri, wi, bi = leaves
        if residual:
            forward = _ops.eager_add_norm_forward if eager else OPS.add_norm_forward
            out, total = forward(xi, ri, wi, bi, shape, 1e-5, c["rms"], me, out_dtype)[:2]
            loss = (out.float() * 1.5).sum() + (total.float() * 0.5).sum()
        else:
            forward = _ops.eager_norm_forward if eager else OPS.norm_forward
            out = forward(xi, wi, bi, shape, 1e-5, c["rms"], me, out_dtype)[0]
            loss = (out.float() * 1.5).sum()
        live = [t for t in leaves if t is not None]
        return [out, *torch.autograd.grad(loss, live)]

    for got, want in zip(run(True), run(False), strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_functions_take_the_ops_under_a_mode_or_with_a_subclass():
    """Under a dispatch mode (here a recorder), a torch function mode or with tensor subclasses the
    functions call the ops, so that the mode sees apex_normalization's op and not its ATen parts."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(4, 64), torch.randn(64)
    with Record() as record:
        AF.fused_layer_norm_affine(x, w, None, 64)
    assert "apex_normalization.norm_forward.default" in record.ops
    with Record() as record:
        AF.fused_rms_norm(x, 64)
    assert any(name.startswith("apex_normalization.") for name in record.ops)
    out = AF.fused_rms_norm_affine(leaf(x), w, 64)
    assert type(out.grad_fn).__name__ == "NormForwardBackward"
    with torch.device("cpu"):
        out = AF.fused_rms_norm_affine(leaf(x), w, 64)
    assert type(out.grad_fn).__name__.startswith("GeneratedBackwardFor_apex_normalization_norm_forward")


# Tolerances of the float64 comparison below: one rounding to the dtype, with headroom.
_LAYER_TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
def test_layer_norm_on_the_cpu_is_pytorchs_op_with_the_ops_values(dtype, affine):
    """Layer norm of plain CPU tensors runs PyTorch's native_layer_norm and its autograd (no Python
    node) in float32/float64, and in float16/bfloat16 without weight and bias (given float32 ones
    as the weight, as the op's reference does, so that the saved statistics are float32): the
    op's reference and backward for these, so the same bits as the op. 16-bit layer norm with a
    weight keeps the op's formula and node (its weight gradients summed in float32)."""
    torch.manual_seed(0)
    x = (torch.randn(6, 2, 40, dtype=torch.float64) * 2 + 0.5).to(dtype)
    w = torch.rand(2, 40, dtype=torch.float64).add(0.5).to(dtype) if affine else None
    b = torch.randn(2, 40, dtype=torch.float64).to(dtype) if affine else None
    dy = torch.randn_like(x)
    aten = dtype in (torch.float32, torch.float64) or not affine

    def run(function, cast=None):
        leaves = [leaf(t if cast is None else t.to(cast)) for t in (x, w, b) if t is not None]
        out = function(*leaves)
        return out, [out, *torch.autograd.grad(out, leaves, dy if cast is None else dy.to(cast))]

    def via_functional(xi, wi=None, bi=None):
        if affine:
            return AF.fused_layer_norm_affine(xi, wi, bi, (2, 40), 1e-5)
        return AF.fused_layer_norm(xi, (2, 40), 1e-5)

    def via_op(xi, wi=None, bi=None):
        return OPS.norm_forward(xi, wi, bi, [2, 40], 1e-5, False)[0]

    def via_float64(xi, wi=None, bi=None):
        return F.layer_norm(xi, (2, 40), wi, bi, 1e-5)

    node = via_functional(*(leaf(t) for t in (x, w, b) if t is not None)).grad_fn
    assert type(node).__name__ == ("NativeLayerNormBackward0" if aten else "NormForwardBackward")
    if aten:  # mean and rstd as the backward gets them
        stats = torch.float64 if dtype == torch.float64 else torch.float32
        assert node._saved_result1.dtype == node._saved_result2.dtype == stats
    _, got = run(via_functional)
    for g, want in zip(got, run(via_op)[1], strict=True):
        torch.testing.assert_close(g, want, rtol=0, atol=0)
    tol = _LAYER_TOL[dtype]
    for g, want in zip(got, run(via_float64, torch.float64)[1], strict=True):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    expected = r"norm_forward: input of shape \(6, 2, 40\) does not end with normalized_shape \(2, 41\)"
    with pytest.raises(ValueError, match=expected):
        AF.fused_layer_norm(x, (2, 41))
    with pytest.raises(ValueError, match="norm_forward: bias given without weight"):
        AF.fused_layer_norm_affine(x, None, torch.zeros(2, 40, dtype=dtype), (2, 40))
    expected = r"norm_forward: weight has shape \(40,\), expected normalized_shape \(2, 40\)"
    with pytest.raises(ValueError, match=expected):
        AF.fused_layer_norm_affine(x, torch.ones(40, dtype=dtype), None, (2, 40))
    tiny = AF.fused_layer_norm(leaf(torch.randn(3, 8, dtype=dtype)), 8)  # rows under 32 elements: the ops' path
    assert type(tiny.grad_fn).__name__ == "NormForwardBackward"


def test_jit_trace_records_the_op_on_the_cpu():
    """torch.jit.trace records apex_normalization's op (not the eager path's Python autograd node,
    which a traced module could not save)."""
    x, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    traced = torch.jit.trace(lambda t: AF.fused_rms_norm_affine(t, w, 64), (x,), check_trace=False)
    assert "apex_normalization::norm_forward" in str(traced.graph)
    torch.testing.assert_close(traced(x), AF.fused_rms_norm_affine(x, w, 64), rtol=0, atol=0)
