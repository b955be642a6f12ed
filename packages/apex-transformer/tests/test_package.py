"""The package as code written for upstream Apex imports it: the functional names, the enums, the
ops registered by importing apex.transformer, and the top-level legacy modules."""

from __future__ import annotations

import subprocess
import sys

import torch

FUNCTIONAL = [
    "FusedScaleMaskSoftmax",
    "GenericFusedScaleMaskSoftmax",
    "scaled_upper_triang_masked_softmax",
    "scaled_masked_softmax",
    "scaled_softmax",
    "generic_scaled_masked_softmax",
    "fused_apply_rotary_pos_emb",
    "fused_apply_rotary_pos_emb_cached",
    "fused_apply_rotary_pos_emb_thd",
    "fused_apply_rotary_pos_emb_2d",
]
LEGACY = [
    "scaled_upper_triang_masked_softmax_cuda",
    "scaled_masked_softmax_cuda",
    "scaled_softmax_cuda",
    "generic_scaled_masked_softmax_cuda",
    "fused_rotary_positional_embedding",
]


def test_functional_names_through_a_bare_import_apex():
    code = (
        "import apex, sys; "
        f"missing = [n for n in {FUNCTIONAL!r} if not callable(getattr(apex.transformer.functional, n, None))]; "
        "print(missing); sys.exit(1 if missing else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_enums_have_upstreams_values():
    from apex.transformer.enums import AttnMaskType, AttnType, LayerType, ModelType

    assert (AttnMaskType.padding.value, AttnMaskType.causal.value) == (1, 2)
    assert (LayerType.encoder.value, LayerType.decoder.value) == (1, 2)
    assert (AttnType.self_attn.value, AttnType.cross_attn.value) == (1, 2)
    assert (ModelType.encoder_or_decoder.value, ModelType.encoder_and_decoder.value) == (1, 2)


def test_importing_the_package_registers_every_op():
    code = (
        "import torch, apex.transformer, sys; "
        "names = ['scaled_softmax_forward', 'scaled_softmax_backward', 'scaled_softmax_backward_', "
        "'rope', 'rope_cached', 'rope_thd', 'rope_2d']; "
        "missing = [n for n in names if not hasattr(torch.ops.apex_transformer, n)]; "
        "print(missing); sys.exit(1 if missing else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_legacy_modules_import_in_a_fresh_interpreter():
    code = f"import importlib, sys; [importlib.import_module(m) for m in {LEGACY!r}]; sys.exit(0)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_plugin_provides_the_legacy_modules():
    from apex.transformer._plugin import PLUGIN

    assert set(LEGACY) <= set(PLUGIN.provides)
    assert torch.ops.apex_transformer.rope is not None
