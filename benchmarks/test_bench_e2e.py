"""bench_e2e's two kits build the same math: each apex piece against its native counterpart on the
CPU (values and gradients), so that the stacks differ in kernels only."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import bench_e2e

APEX, NATIVE = bench_e2e.Kit(apex=True), bench_e2e.Kit(apex=False)


def both(fn, *inputs):
    """fn(kit, *leaves) for each kit on fresh float32 leaves: (output, gradients) per kit."""
    results = []
    for kit in (APEX, NATIVE):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out = fn(kit, *leaves)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
        results.append((out.detach(), grads))
    return results


def assert_same(results):
    (out_a, grads_a), (out_n, grads_n) = results
    torch.testing.assert_close(out_a, out_n, rtol=1e-5, atol=1e-5)
    for a, n in zip(grads_a, grads_n, strict=True):
        torch.testing.assert_close(a, n, rtol=1e-5, atol=1e-5)


def test_swiglu():
    x = torch.randn(2, 5, 2 * 12, dtype=torch.float32)
    assert_same(both(lambda kit, t: kit.swiglu(t), x))


def test_rope():
    b, s, h, d = 2, 6, 3, 8
    freqs = torch.randn(s, d, dtype=torch.float32)
    x = torch.randn(b, s, h, d, dtype=torch.float32)
    assert_same(both(lambda kit, t: kit.rope(t, kit.rope_table(freqs)), x))


@pytest.mark.parametrize("pending", [False, True])
def test_add_rms_norm(pending):
    x, p = torch.randn(4, 16, dtype=torch.float32), torch.randn(4, 16, dtype=torch.float32)

    def run(kit, x, p):
        norm = kit.rms_norm(16)
        h, total = kit.add_norm(norm, x, p if pending else None)
        return h + 0.5 * total + 0 * p  # p unused without pending: a zero gradient

    assert_same(both(run, x, p))


def test_loss():
    logits = torch.randn(7, 11, dtype=torch.float32)
    targets = torch.randint(0, 11, (7,))
    assert_same(both(lambda kit, t: kit.loss(t.clone(), targets), logits))


def test_llama_projections():
    # --llama-linear apex: FusedDense(bias=False) in the apex kit, nn.Linear in the native one, the
    # same weight loaded into both (bench_e2e loads one state dict into every stack).
    fused = bench_e2e.Kit(apex=True, fused_projections=True).projection(12, 20)
    plain = NATIVE.projection(12, 20)
    assert type(fused).__name__ == "FusedDense" and isinstance(plain, torch.nn.Linear)
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(3, 4, 12)
    results = []
    for module in (fused, plain):
        leaf = x.clone().requires_grad_()
        out = module(leaf)
        results.append((out.detach(), torch.autograd.grad(out, [leaf, module.weight], torch.ones_like(out))))
    assert_same(results)


def test_phase_rows_split_the_step_and_find_where_the_gpu_waited():
    # Two steps of two phases, ms from one start on both clocks. The host launches a step's forward in
    # 1 ms and its backward in 1 ms; the GPU needs 4 and 6. Step 2's forward mark is reached on the GPU
    # at 10 ms (after step 1's work), on the host at 2 ms: 8 ms ahead; its backward mark at 14 vs 3.
    marks = [("forward", 0.0, 0.0), ("backward", 4.0, 1.0), ("forward", 10.0, 2.0), ("backward", 14.0, 3.0)]
    rows = bench_e2e.phase_rows(marks, end=(20.0, 4.0), steps=2)
    assert rows == [
        ["forward", "4.000", "1.000", "8.00", "8.00"],
        ["backward", "6.000", "1.000", "11.00", "11.00"],
        ["step", "10.000", "2.000", "", ""],
    ]
    # One step: no mark after the first step's, so no lead.
    assert bench_e2e.phase_rows(marks[:2], end=(10.0, 2.0), steps=1)[0] == ["forward", "4.000", "1.000", "-", "-"]


def test_stack_env_splits_a_stack_from_its_settings():
    assert bench_e2e.stack_env("apex-eager") == ("apex-eager", {})
    assert bench_e2e.stack_env("apex-compiled+APEX_SIDE_STREAM=0+APEX_CUBLASLT_DISABLE=gelu_aux") == (
        "apex-compiled",
        {"APEX_SIDE_STREAM": "0", "APEX_CUBLASLT_DISABLE": "gelu_aux"},
    )
    for bad in ("apex-fast", "apex-eager+APEX_SIDE_STREAM", "apex-eager+=0"):
        with pytest.raises(ValueError, match=r"unknown stack|is not VAR=VALUE"):
            bench_e2e.stack_env(bad)
    assert bench_e2e.file_name("apex-eager+APEX_SIDE_STREAM=0") == "apex-eager_APEX_SIDE_STREAM_0"


def test_stacks_keep_the_table_order_with_variants_after_their_stack():
    args = bench_e2e.parse_args(["--stacks", "apex-eager+APEX_SIDE_STREAM=0,native-compiled,apex-eager,apex-eager"])
    assert args.stacks == ["native-compiled", "apex-eager+APEX_SIDE_STREAM=0", "apex-eager"]
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--stacks", "apex-eager+SIDE"])


def test_a_variant_steps_with_its_settings(monkeypatch):
    # The settings hold during the step (the kernels read them on every call) and are undone after it.
    monkeypatch.delenv("APEX_E2E_TEST", raising=False)
    seen = []
    variant = bench_e2e.Variant("apex-eager+APEX_E2E_TEST=1", None, None, None, [], [], torch.device("cpu"))
    monkeypatch.setattr(bench_e2e.Variant, "_step", lambda self: seen.append(os.environ.get("APEX_E2E_TEST")))
    variant.step()
    assert seen == ["1"] and "APEX_E2E_TEST" not in os.environ
