"""What code written for upstream Apex (Megatron-Core, NeMo) uses: the autograd Functions of
``apex.normalization.fused_layer_norm``, the mixed modules' extra keyword arguments, float64, double
backward, and export (torch.export, ONNX)."""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch
import torch.nn.functional as F

from apex.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm
from apex.normalization import fused_layer_norm as upstream

SHAPE = (4, 3, 16)
EPS = 1e-5


def leaf(t):
    return t.detach().requires_grad_()


def torch_rms(x, w, eps):
    xf = x.to(torch.float64) if x.dtype == torch.float64 else x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def inputs(device, dtype=torch.float32, weight_dtype=None):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SHAPE, generator=gen).to(device, dtype)
    w = (torch.rand(SHAPE[-1:], generator=gen) + 0.5).to(device, weight_dtype or dtype)
    b = torch.randn(SHAPE[-1:], generator=gen).to(device, weight_dtype or dtype)
    return leaf(x), leaf(w), leaf(b)


# point 8: the Functions -------------------------------------------------------------------------

FUNCTIONS = {
    # name: (affine params, rms, mixed)
    "FusedLayerNormAffineFunction": ("wb", False, False),
    "FusedLayerNormFunction": ("", False, False),
    "FusedRMSNormAffineFunction": ("w", True, False),
    "FusedRMSNormFunction": ("", True, False),
    "FusedLayerNormAffineMixedDtypesFunction": ("wb", False, True),
    "FusedRMSNormAffineMixedDtypesFunction": ("w", True, True),
}


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_function_signature_is_upstreams(name):
    cls = getattr(upstream, name)
    assert issubclass(cls, torch.autograd.Function)
    params, _, _ = FUNCTIONS[name]
    expected = ["ctx", "input", *(["weight"] if params else []), *(["bias"] if "b" in params else [])]
    expected += ["normalized_shape", "eps", "memory_efficient"]
    signature = inspect.signature(cls.forward)
    assert list(signature.parameters) == expected
    assert signature.parameters["memory_efficient"].default is False


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["input", "memory-efficient"])
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_function_matches_torch(device, name, memory_efficient):
    params, rms, mixed = FUNCTIONS[name]
    dtype = torch.bfloat16 if mixed else torch.float32
    x, w, b = inputs(device, dtype, torch.float32 if mixed else None)
    tensors = [x] + ([w] if params else []) + ([b] if "b" in params else [])
    out = getattr(upstream, name).apply(*tensors, SHAPE[-1:], EPS, memory_efficient)
    assert out.dtype == (torch.float32 if mixed else dtype)
    xf = x.float()
    wf = w.float() if params else None
    if rms:
        ref = torch_rms(xf, wf, EPS)
    else:
        ref = F.layer_norm(xf, SHAPE[-1:], wf, b.float() if "b" in params else None, EPS)
    tol = 2e-2 if mixed else 1e-5
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    dy = torch.randn_like(ref)
    got = torch.autograd.grad(out, tensors, dy.to(out.dtype))
    want = torch.autograd.grad(ref, tensors, dy)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype
        torch.testing.assert_close(g.float(), r.float(), atol=tol * 5, rtol=tol * 5)


def test_megatron_call_positional_memory_efficient():
    x, w, b = inputs("cpu")
    fn = upstream.FusedLayerNormAffineFunction
    assert "memory_efficient" in inspect.signature(fn.forward).parameters
    out = fn.apply(x, w, b, torch.Size(SHAPE[-1:]), EPS, True)
    torch.testing.assert_close(out, F.layer_norm(x, SHAPE[-1:], w, b, EPS))
    out = fn.apply(x, w, b, SHAPE[-1:], EPS)  # memory_efficient defaulted, as older callers do
    torch.testing.assert_close(out, F.layer_norm(x, SHAPE[-1:], w, b, EPS))


@pytest.mark.parametrize("cls", [MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_mixed_modules_ignore_extra_kwargs(cls):
    m = cls(16, eps=1e-5, sequence_parallel_enabled=True, sequence_parallel_enbaled=False, memory_efficient=True)
    assert m.memory_efficient and m.weight.dtype == torch.float32
    m = cls(16, 1e-5, dtype=torch.bfloat16)
    assert m.weight.dtype == torch.bfloat16


# point 6: float64 ------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm], ids=["layer", "rms"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_float64(device, cls, affine):
    m = cls(SHAPE[-1], elementwise_affine=affine).to(device, torch.float64)
    if affine:
        with torch.no_grad():
            m.weight.uniform_(0.5, 1.5)
    x, _, _ = inputs(device, torch.float64)
    out = m(x)
    assert out.dtype == torch.float64
    w = m.weight if affine else None
    if cls is FusedRMSNorm:
        ref = torch_rms(x, w, m.eps)
    else:
        ref = F.layer_norm(x, SHAPE[-1:], w, m.bias if affine else None, m.eps)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    params = [x] + ([w] if affine else [])
    dy = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, params, dy), torch.autograd.grad(ref, params, dy)):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-10)


# hostile input: double backward -------------------------------------------------------------


def _norm_fn(rms, affine, mixed=False, residual=False, memory_efficient=False):
    from apex.normalization import functional as AF

    def fn(x, w, b, r):
        if residual:
            if rms:
                out, s = AF.fused_add_rms_norm_affine(x, r, w, SHAPE[-1:], EPS)
            else:
                out, s = AF.fused_add_layer_norm_affine(x, r, w, b, SHAPE[-1:], EPS)
            return out, s
        if rms:
            if affine:
                return AF.fused_rms_norm_affine(x, w, SHAPE[-1:], EPS, memory_efficient)
            return AF.fused_rms_norm(x, SHAPE[-1:], EPS, memory_efficient)
        if affine:
            return AF.fused_layer_norm_affine(x, w, b, SHAPE[-1:], EPS, memory_efficient)
        return AF.fused_layer_norm(x, SHAPE[-1:], EPS, memory_efficient)

    return fn


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_gradgradcheck(rms, affine):
    x, w, b = inputs("cpu", torch.float64)
    fn = _norm_fn(rms, affine)
    if affine:
        args = (x, w) if rms else (x, w, b)
        f = (lambda x, w: fn(x, w, None, None)) if rms else (lambda x, w, b: fn(x, w, b, None))
    else:
        args = (x,)
        f = lambda x: fn(x, None, None, None)  # noqa: E731
    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradgradcheck(f, args)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_gradgradcheck_residual(rms):
    x, w, b = inputs("cpu", torch.float64)
    r = leaf(torch.randn_like(x))
    fn = _norm_fn(rms, True, residual=True)
    f = (lambda x, r, w: fn(x, w, None, r)) if rms else (lambda x, r, w, b: fn(x, w, b, r))
    args = (x, r, w) if rms else (x, r, w, b)
    assert torch.autograd.gradgradcheck(f, args)


def _second_order(device, rms, dtype=torch.float32):
    """Gradient of sum(dx^2) (dx the first gradient) through ours and through torch's."""
    results = []
    for ours in (True, False):
        x, w, b = inputs(device, dtype)
        if ours:
            out = _norm_fn(rms, True)(x, w, b, None)
        else:
            out = torch_rms(x, w, EPS) if rms else F.layer_norm(x, SHAPE[-1:], w, b, EPS)
        dy = torch.linspace(-1, 1, out.numel(), device=device, dtype=out.dtype).reshape(out.shape)
        params = (x, w)
        first = torch.autograd.grad(out, params, dy, create_graph=True)
        second = torch.autograd.grad(sum(g.square().sum() for g in first), params)
        results.append(second)
    return results


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_double_backward_matches_torch(device, rms):
    ours, ref = _second_order(device, rms)
    for g, r in zip(ours, ref):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_double_backward_memory_efficient_raises(device, rms):
    x, w, b = inputs(device)
    out = _norm_fn(rms, True, memory_efficient=True)(x, w, b, None)
    with pytest.raises(RuntimeError, match=r"norm_forward.*memory_efficient"):
        torch.autograd.grad(out, (x, w), torch.ones_like(out), create_graph=True)


# point 7: export ---------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = FusedLayerNorm(16)
        self.rms = FusedRMSNorm(16)
        self.mixed_ln = MixedFusedLayerNorm(16)
        self.mixed_rms = MixedFusedRMSNorm(16)
        self.linear = torch.nn.Linear(16, 16)
        with torch.no_grad():
            for m in (self.ln, self.rms, self.mixed_ln, self.mixed_rms):
                m.weight.uniform_(0.5, 1.5)
            for m in (self.ln, self.mixed_ln):
                m.bias.uniform_(-1, 1)

    def forward(self, x):
        y = self.ln(x)
        y = self.rms(self.linear(y))
        y = self.mixed_ln(y)
        return self.mixed_rms(y) + y


def test_torch_export(device):
    model = Block().to(device).eval()
    x = torch.randn(SHAPE, device=device)
    program = torch.export.export(model, (x,))
    x2 = torch.randn(SHAPE, device=device)
    torch.testing.assert_close(program.module()(x2), model(x2))
    decomposed = program.run_decompositions()
    torch.testing.assert_close(decomposed.module()(x2), model(x2))


def test_torch_export_keeps_autograd():
    model = Block()
    x = leaf(torch.randn(SHAPE))
    program = torch.export.export(model, (x,))
    out = program.module()(x)
    (gx,) = torch.autograd.grad(out.sum(), x)
    (want,) = torch.autograd.grad(model(x).sum(), x)
    torch.testing.assert_close(gx, want)


def test_onnx_export(tmp_path):
    # nox's tests session installs onnx, onnxscript and onnxruntime (the GPU machine has them too);
    # the model is exported and run on the CPU.
    for name in ("onnx", "onnxscript", "onnxruntime"):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed")
    import onnxruntime

    model = Block().eval()
    x = torch.randn(SHAPE)
    path = tmp_path / "block.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=True)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x2 = torch.randn(SHAPE)
    (got,) = session.run(None, {session.get_inputs()[0].name: x2.numpy()})
    torch.testing.assert_close(torch.from_numpy(got), model(x2), atol=1e-5, rtol=1e-5)
