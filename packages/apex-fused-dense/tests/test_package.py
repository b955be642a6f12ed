"""The package's wiring: the plugin provides the public module and the two legacy modules, and
importing apex.fused_dense registers every op."""

from __future__ import annotations

import importlib

import torch

from apex.fused_dense._plugin import PLUGIN

OPS = [
    "linear_forward",
    "linear_backward",
    "linear_gelu_linear_forward",
    "linear_gelu_linear_backward",
    "wgrad_gemm_accum_fp32",
    "wgrad_gemm_accum_fp16",
]


def test_plugin_provides_importable_modules():
    assert PLUGIN.provides == ("apex.fused_dense", "fused_dense_cuda", "fused_weight_gradient_mlp_cuda")
    for module in PLUGIN.provides:
        importlib.import_module(module)


def test_importing_registers_the_ops():
    importlib.import_module("apex.fused_dense")
    for name in OPS:
        assert hasattr(torch.ops.apex_fused_dense, name), name


def test_the_example_gpt_picks_the_fused_dense_layers():
    import pytest

    import apex.core
    from apex.core.testing import load_example
    from apex.fused_dense import FusedDense, FusedDenseGeluDense

    demo = load_example("train_gpt", __file__)
    if demo is None:
        pytest.skip("not running from a source checkout")
    linear, mlp, choice = demo.pick_dense()
    assert (linear, mlp) == (FusedDense, FusedDenseGeluDense)
    assert choice.kernels == "fused_dense" and apex.core.status(choice.kernels).name == "apex_fused_dense"
    native_linear, native_mlp, native_choice = demo.pick_dense("native")
    assert (native_linear, native_choice.name) == (torch.nn.Linear, "torch.nn.Linear")
    # The same parameter names and function in both stacks: one state dict loads into either, and
    # their outputs agree; the dense layers' biases start at zero in both.
    cfg = demo.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)
    ours = demo.GPT(cfg, torch.nn.LayerNorm, linear, mlp)
    native = demo.GPT(cfg, torch.nn.LayerNorm, native_linear, native_mlp)
    for model in (ours, native):
        biases = [p for n, p in model.named_parameters() if ".attn." in n or ".mlp." in n if p.dim() == 1]
        assert len(biases) == 4 * cfg.n_layer and all(not b.any() for b in biases)
    native.load_state_dict(ours.state_dict())
    idx = torch.randint(0, 11, (3, 8))
    torch.testing.assert_close(ours(idx), native(idx))
