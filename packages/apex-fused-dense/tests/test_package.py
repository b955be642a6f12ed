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
