"""FusedLayerNorm, FusedRMSNorm and the mixed-dtype modules: upstream Apex's interface, PyTorch's
modules as the yardstick, the residual-add form, and the demo's use of them."""

from __future__ import annotations

import pytest
import torch

import apex.core
import apex.normalization as norm
from apex.core.testing import load_example
from apex.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm

UPSTREAM_NAMES = [
    "FusedLayerNorm",
    "FusedRMSNorm",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "fused_layer_norm",
    "fused_layer_norm_affine",
    "fused_rms_norm",
    "fused_rms_norm_affine",
    "mixed_dtype_fused_layer_norm_affine",
    "mixed_dtype_fused_rms_norm_affine",
]


def test_upstream_import_paths():
    from apex.normalization import functional, fused_layer_norm

    assert fused_layer_norm.__name__ == "apex.normalization.fused_layer_norm"
    for name in UPSTREAM_NAMES:
        assert hasattr(fused_layer_norm, name), name
        if name.startswith("Fused") or name.startswith("Mixed"):
            assert getattr(fused_layer_norm, name) is getattr(norm, name), name
        else:
            assert getattr(fused_layer_norm, name) is getattr(functional, name), name


def test_layer_norm_parameters_and_repr():
    m = FusedLayerNorm((3, 4), eps=1e-6)
    assert m.normalized_shape == torch.Size((3, 4)) and m.eps == 1e-6 and m.elementwise_affine
    assert torch.equal(m.weight, torch.ones(3, 4)) and torch.equal(m.bias, torch.zeros(3, 4))
    assert repr(m) == "FusedLayerNorm((3, 4), eps=1e-06, elementwise_affine=True)"
    plain = FusedLayerNorm(8, elementwise_affine=False, memory_efficient=True)
    assert plain.weight is None and plain.bias is None and list(plain.parameters()) == []
    assert "memory_efficient=True" in repr(plain)


def test_rms_norm_parameters():
    m = FusedRMSNorm(16)
    assert m.bias is None and [n for n, _ in m.named_parameters()] == ["weight"]
    assert torch.equal(m.weight, torch.ones(16))
    assert FusedRMSNorm(16, elementwise_affine=False).weight is None


def test_factory_kwargs():
    m = FusedLayerNorm(8, device="meta", dtype=torch.bfloat16)
    assert m.weight.device.type == "meta" and m.weight.dtype == torch.bfloat16
    out = m(torch.empty(2, 8, device="meta", dtype=torch.bfloat16))  # shape inference on meta tensors
    assert out.shape == (2, 8) and out.device.type == "meta"


def test_state_dict_is_interchangeable_with_torch():
    ours, theirs = FusedLayerNorm(12), torch.nn.LayerNorm(12)
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 12)
    torch.testing.assert_close(ours(x), theirs(x))
    rms_ours, rms_theirs = FusedRMSNorm(12, eps=1e-6), torch.nn.RMSNorm(12, eps=1e-6)
    with torch.no_grad():
        rms_theirs.weight.normal_()
    rms_ours.load_state_dict(rms_theirs.state_dict())
    torch.testing.assert_close(rms_ours(x), rms_theirs(x))


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_module_matches_torch_forward_and_backward(device, rms):
    ours = (FusedRMSNorm if rms else FusedLayerNorm)((5, 40)).to(device)
    theirs = (torch.nn.RMSNorm((5, 40), eps=1e-5) if rms else torch.nn.LayerNorm((5, 40))).to(device)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(6, 5, 40, device=device)
    dy = torch.randn(6, 5, 40, device=device)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours(xa).backward(dy)
    theirs(xb).backward(dy)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-5)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cls", [MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_mixed_modules_output_the_parameter_dtype(device, cls):
    m = cls(32).to(device)
    x = torch.randn(4, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    out = m(x)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and m.weight.grad.dtype == torch.float32
    plain = (FusedRMSNorm if cls is MixedFusedRMSNorm else FusedLayerNorm)(32).to(device)
    assert plain(x).dtype == torch.bfloat16


@pytest.mark.parametrize("cls", [MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_mixed_modules_refuse_no_affine(cls):
    with pytest.warns(UserWarning, match="elementwise_affine is ignored"):
        cls(8, elementwise_affine=True)
    with pytest.raises(RuntimeError, match="does not support elementwise_affine=False"), pytest.warns(UserWarning):
        cls(8, elementwise_affine=False)
    assert cls(8, memory_efficient=True).memory_efficient


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm])
def test_residual_form(device, cls):
    m = cls(24).to(device)
    x = torch.randn(3, 24, device=device)
    r = torch.randn(3, 24, device=device)
    out, total = m(x, r)
    torch.testing.assert_close(total, x + r)
    torch.testing.assert_close(out, m(x + r))


def test_demo_picks_fused_layer_norm():
    demo = load_example("train_gpt", __file__)
    if demo is None:
        pytest.skip("not running from a source checkout")
    cls, choice = demo.pick_norm()
    assert cls is FusedLayerNorm and choice.name == "apex.normalization.FusedLayerNorm"
    assert choice.kernels == "normalization" and apex.core.status(choice.kernels).name == "apex_normalization"
    layer = cls(16)
    assert layer(torch.randn(2, 16)).shape == (2, 16)
